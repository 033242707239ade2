"""The Qwen3-MoE parity harness (``tests/dist/test_moe.py`` and the MoE router / conversion / weight-sync
tests): the MoE policy at a (tp, pp, ep, etp) layout on gloo ranks, its logits and gradients in HF names."""

from __future__ import annotations

import torch
import torch.distributed as dist

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import TINY_VOCAB
from tests.helpers.conversion import read_hf_tensors
from tests.helpers.megatron import merge_rank_results, run_schedule

VOCAB = TINY_VOCAB
SEQ = 8  # divisible by TP: TP > 1 with MoE runs sequence parallel
MICRO_BATCHES = 2
MICRO_BATCH_SIZE = 2


def hf_file_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the hub FILE names (per-expert gate/up/down), as save_pretrained writes."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return read_hf_tensors(Path(d))


def run_moe_policy(hf_config, layout, dispatcher, batches, *, hf_state=None, ckpt_dir=None, backward=True):
    """On this rank: build the MoE policy at ``layout``, load weights, run the schedule. Returns (logits per
    micro-batch on the last stage's TP rank 0 else None, full gradients in HF names this rank can name)."""
    from megatron.core import parallel_state as ps

    from srpo_megatron.config import MoEConfig
    from srpo_megatron.conversion.checkpoint import load_policy_checkpoint
    from srpo_megatron.conversion.table import ConversionTable, merge_tp_shards
    from srpo_megatron.conversion.weights import (
        load_hf_weights,
        rank_param_name,
        stage_expert_offset,
        stage_layer_offset,
    )
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    tp, pp, ep, etp = layout
    groups = initialize_model_parallel(tp, pp, ep=ep, etp=etp)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch, parallel_output=False, moe=MoEConfig(dispatcher=dispatcher))
    if ckpt_dir is not None:
        load_policy_checkpoint(model, ckpt_dir)
    else:
        load_hf_weights(model, table, hf_state.__getitem__)
    offset, expert_offset = stage_layer_offset(model), stage_expert_offset(table)
    model, logits = run_schedule(model, batches, arch.vocab_size, backward=backward)
    logits = logits if ps.is_pipeline_last_stage() and groups.tp_rank == 0 else None
    grads: dict[str, torch.Tensor] = {}
    if backward:
        for local_name, param in model.module.named_parameters():
            name = rank_param_name(table, local_name, offset, expert_offset)
            part = table.partition(name)
            group, size, rank = (
                (groups.etp, groups.etp_size, groups.etp_rank)
                if part.expert
                else (groups.tp, groups.tp_size, groups.tp_rank)
            )
            grad = param.main_grad
            if part.dim is not None and size > 1:
                shards = [torch.empty_like(grad) for _ in range(size)]
                dist.all_gather(shards, grad.contiguous(), group=group)
                grad = merge_tp_shards(shards, part)
            if rank == 0:
                grads.update(table.to_hf(name, grad))
    return logits, grads


def moe_worker(rank, world, layout, cases, backward):
    return [
        run_moe_policy(c, layout, d, b, hf_state=st, ckpt_dir=ck, backward=backward)
        for c, d, b, st, ck in cases
    ]


def run_moe_layout(layout, cases, *, backward=True):
    """Per case: logits per micro-batch and all gradients (HF names) of one layout."""
    tp, pp, ep, etp = layout
    world = max(tp, etp * ep) * pp
    return merge_rank_results(run_distributed(moe_worker, world, layout, cases, backward, timeout=600))


def batches_for(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ), generator=gen) for _ in range(MICRO_BATCHES)]


def hf_grads_in_file_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF gradients of transformers' fused in-memory experts (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``,
    ``mlp.experts.down_proj``) under the per-expert FILE names (``mlp.experts.{e}.gate_proj.weight`` ...)."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = g[e].chunk(2, dim=0)
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


def export_worker(rank, world, layout, hf_config, state, bucket_bytes=40_000, fuse=False):
    """The trainer's weight export of a policy loaded from ``state``: buckets of (name, tensor), the largest
    pending tensor's and the largest expert tensor's bytes (tests/dist/test_moe_weight_sync.py). ``fuse``:
    as the SGLang syncs send it (``weights.fused_experts``)."""
    from srpo_megatron.buckets import bucketize_pending
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.weights.export import iter_stage_params

    tp, pp, ep, etp = layout
    groups = initialize_model_parallel(tp, pp, ep=ep, etp=etp)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch)
    load_hf_weights(model, table, state.__getitem__)
    pending = list(iter_stage_params(model, table, groups))
    if fuse:
        from srpo_megatron.weights.fused_experts import fuse_expert_slices

        pending = list(fuse_expert_slices(pending, table))
    largest = max(p.nbytes for p in pending)
    largest_expert = max((p.nbytes for p in pending if ".experts." in p.name), default=0)
    return [list(b) for b in bucketize_pending(iter(pending), bucket_bytes)], largest, largest_expert
