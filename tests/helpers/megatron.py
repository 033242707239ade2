"""The megatron forward/backward scaffold of the parity tests: build a policy from an HF config at a TP x PP
layout, run megatron's real schedules, and compare with transformers' fp32 model (logits and gradients in HF
names through the conversion table)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean next-token cross entropy over the real vocabulary. logits ``[b, s, >=V]``, ids ``[b, s]``."""
    logits = logits[:, :-1, :vocab].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))


def hf_reference(model, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """HF logits per micro-batch and gradients of the mean micro-batch loss."""
    model.zero_grad()
    logits = []
    for ids in batches:
        out = model(ids).logits
        (lm_loss(out, ids, model.config.vocab_size) / len(batches)).backward()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return logits, grads


def run_schedule(model, batches: list[torch.Tensor], vocab: int, *, backward: bool = True, ddp_config=None):
    """Wrap this rank's policy ``model`` in megatron DDP (``ddp_config``, default megatron's) and run
    megatron's schedule over ``batches`` (ids ``[b, s]`` per micro-batch) with :func:`lm_loss`. Returns (the
    DDP model, whose ``module`` holds the ``main_grad``s, and the logits per micro-batch this stage produced:
    empty except on the last stage)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Megatron DDP + finalize_model_grads, as in training: they sum the QK-norm gradients over TP
    # (each TP rank only sees its heads) and the tied embedding gradients over the first/last stage.
    model.config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(model.config, ddp_config or DistributedDataParallelConfig(), model)
    model.config.no_sync_func = model.no_sync
    seq = batches[0].shape[1]
    positions = torch.arange(seq).expand_as(batches[0])

    def loss_func(ids, output):
        return lm_loss(output, ids, vocab), {"logits": output.detach()}

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        return model(ids, positions, None), functools.partial(loss_func, ids)

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq,
        micro_batch_size=batches[0].shape[0],
        forward_only=not backward,
    )
    return model, [o["logits"] for o in out]


def run_policy(
    hf_config: dict,
    tp: int,
    pp: int,
    batches: list[torch.Tensor],
    *,
    hf_state: dict[str, torch.Tensor] | None = None,
    ckpt_dir: str | None = None,
    backward: bool = True,
    config_overrides: dict | None = None,
) -> tuple[list[torch.Tensor] | None, dict[str, torch.Tensor]]:
    """On this rank: build the policy, load weights, run the schedule. Returns (logits per micro-batch on the
    last stage's TP rank 0 else None, this stage's full gradients in HF names on TP rank 0 else {})."""
    from megatron.core import parallel_state as ps

    from srpo_megatron.conversion.checkpoint import load_policy_checkpoint
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights, stage_layer_offset
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(tp, pp)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch, parallel_output=False, **(config_overrides or {}))
    if ckpt_dir is not None:
        load_policy_checkpoint(model, ckpt_dir)
    else:
        load_hf_weights(model, table, hf_state.__getitem__)
    offset = stage_layer_offset(model)
    model, logits = run_schedule(model, batches, arch.vocab_size, backward=backward)
    shows_logits = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    grads = hf_named_grads(model.module, table, offset) if backward else {}
    return (logits if shows_logits else None), grads


def merge_rank_results(results: list[list[tuple]]) -> list[tuple[list[torch.Tensor], dict]]:
    """``results[rank][case] = (logits or None, grads)`` of one launch, as :func:`run_policy` returns them per
    rank, merged per case: (the logits of the rank that has them, every rank's gradients in one dict)."""
    per_case = []
    for i in range(len(results[0])):
        logits = next(r[i][0] for r in results if r[i][0] is not None)
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            grads.update(r[i][1])
        per_case.append((logits, grads))
    return per_case


def hf_named_grads(module, table, offset: int) -> dict[str, torch.Tensor]:
    """This stage's full gradients (DDP ``main_grad``) in HF names, TP shards merged (TP rank 0, else {})."""
    from megatron.core import parallel_state as ps

    from srpo_megatron.conversion.table import merge_tp_shards
    from srpo_megatron.conversion.weights import rank_param_name

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    grads: dict[str, torch.Tensor] = {}
    for local_name, param in module.named_parameters():
        name = rank_param_name(table, local_name, offset)
        if local_name == "output_layer.weight" and table.arch.tie_embeddings:
            continue  # the tied copy's gradient equals the embedding's after finalize_model_grads
        part = table.partition(name)
        grad = param.main_grad
        if part.dim is not None and tp > 1:
            shards = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(shards, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
            grad = merge_tp_shards(shards, part)
        if tp_rank == 0:
            for hf_name, g in table.to_hf(name, grad):
                grads[hf_name] = g
    return grads
