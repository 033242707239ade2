"""Qwen3-MoE policies match the HF model (transformers' Qwen3MoeForCausalLM, fp32): logits and every gradient
at TP1, EP2, TP2xEP2, PP2xEP2 and ETP2, with the alltoall and the allgather token dispatchers.

Same harness as ``test_models_tp``: megatron's real schedules on gloo ranks, megatron DDP +
``finalize_model_grads``; gradients are gathered over TP/ETP and collected over EP into HF names through the
conversion table, so a wrong expert numbering (EP offset), a wrong ETP split or a wrong router mapping fails.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from srpo_megatron.testing.distributed import run_distributed
from tests.dist.test_models_tp import hf_reference, lm_loss

pytestmark = pytest.mark.moe

VOCAB = 300
SEQ = 8  # divisible by TP: TP > 1 with MoE runs sequence parallel
MICRO_BATCHES = 2
MICRO_BATCH_SIZE = 2
EXPERTS = 4
TOP_K = 2
# (tp, pp, ep, etp); world = tp * pp * dp must also be a multiple of etp * ep * pp.
LAYOUTS = [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 2, 2, 1), (2, 1, 1, 2)]


def tiny_moe_config(norm_topk_prob: bool = True, num_layers: int = 2):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )


def tiny_moe_model(seed: int = 0, norm_topk_prob: bool = True):
    """Random HF Qwen3-MoE; norm weights around 1 and a router wide enough that no two experts tie."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(norm_topk_prob), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.eval()


def hf_file_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the hub FILE names (per-expert gate/up/down), as save_pretrained writes."""
    import tempfile

    from tests.dist.test_conversion import read_hf_tensors

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        from pathlib import Path

        return read_hf_tensors(Path(d))


def run_moe_policy(hf_config, layout, dispatcher, batches, *, hf_state=None, ckpt_dir=None, backward=True):
    """On this rank: build the MoE policy at ``layout``, load weights, run the schedule. Returns (logits per
    micro-batch on the last stage's TP rank 0 else None, full gradients in HF names this rank can name)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from srpo_megatron.conversion.checkpoint import load_policy_checkpoint
    from srpo_megatron.conversion.table import ConversionTable, merge_tp_shards
    from srpo_megatron.conversion.weights import (
        load_hf_weights,
        rank_param_name,
        stage_expert_offset,
        stage_layer_offset,
    )
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.config import MoEConfig
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
    model.config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func = model.no_sync
    positions = torch.arange(SEQ).expand_as(batches[0])

    def loss_func(ids, output):
        return lm_loss(output, ids, arch.vocab_size), {"logits": output.detach()}

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        return model(ids, positions, None), functools.partial(loss_func, ids)

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=batches[0].shape[0],
        forward_only=not backward,
    )
    logits = [o["logits"] for o in out] if ps.is_pipeline_last_stage() and groups.tp_rank == 0 else None
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
    results = run_distributed(moe_worker, world, layout, cases, backward, timeout=600)
    per_case = []
    for i in range(len(cases)):
        logits = next(r[i][0] for r in results if r[i][0] is not None)
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            grads.update(r[i][1])
        per_case.append((logits, grads))
    return per_case


def batches_for(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ), generator=gen) for _ in range(MICRO_BATCHES)]


def hf_in_file_names(grads: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """HF gradients of transformers' fused in-memory experts under the per-expert FILE names."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = g[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "tp{}pp{}ep{}etp{}".format(*lay))
def test_moe_logits_and_grads_match_hf(layout):
    variants = [("alltoall", True), ("allgather", True)]
    if layout == (1, 1, 1, 1):
        variants.append(("alltoall", False))  # no renormalisation of the top-k: megatron's pre-softmax path
    cases, refs = [], []
    for i, (dispatcher, norm) in enumerate(variants):
        hf = tiny_moe_model(seed=i, norm_topk_prob=norm)
        batches = batches_for(10 + i)
        logits, grads = hf_reference(hf, batches)
        refs.append((logits, hf_in_file_names(grads, hf)))
        cases.append((hf.config.to_dict(), dispatcher, batches, hf_file_state(hf), None))
    for (dispatcher, norm), (logits, grads), (ref_logits, ref_grads) in zip(
        variants, run_moe_layout(layout, cases), refs, strict=True
    ):
        tag = f"{layout} {dispatcher} norm_topk_prob={norm}"
        for got, want in zip(logits, ref_logits, strict=True):
            diff = (got[..., :VOCAB] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
        assert sorted(grads) == sorted(ref_grads), f"{tag}: gradient names {set(grads) ^ set(ref_grads)}"
        for name, want in ref_grads.items():
            diff = (grads[name] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: grad {name} differs by {diff}"
