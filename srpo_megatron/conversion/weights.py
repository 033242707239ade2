"""Copy HF weights into a rank's megatron policy stage (any TP/PP) through the conversion table.

Used by tests and by callers that hold HF tensors in memory (e.g. a freshly converted model); the
checkpoint path (``conversion.checkpoint``) goes through ``dist_checkpointing`` instead.

Policy tensors are the parameters plus one kind of buffer: the router's ``expert_bias`` (GLM-4.5 /
DeepSeek-V3's ``e_score_correction_bias``), which megatron keeps as a persistent buffer (no gradient, no
optimizer state) but which is part of the model's function. :func:`policy_named_tensors` lists both, and
every consumer of "the policy's tensors" (this loader, checkpoint import/export, weight sync in
``weights/export.py``) iterates it, so the bias is loaded, saved (it is in megatron's state dict and
``sharded_state_dict`` as a replicated tensor), exported and sent to the engine like a parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from srpo_megatron.conversion.table import ConversionError, ConversionTable, canonical_name, split_tp_shard

EXPERT_BIAS_SUFFIX = "mlp.router.expert_bias"


def policy_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(local name, tensor)`` of the policy's parameters, then its router ``expert_bias`` buffers."""
    out: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    out += [(n, b) for n, b in model.named_buffers() if n.endswith(EXPERT_BIAS_SUFFIX) and b is not None]
    return out


def stage_layer_offset(model: torch.nn.Module) -> int:
    """Global index of this pipeline stage's first layer."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return 0
    return get_transformer_layer_offset(decoder.config, getattr(model, "vp_stage", None))


def stage_expert_offset(table: ConversionTable) -> int:
    """Global index of this rank's first local MoE expert (EP rank * experts per EP rank); 0 when dense."""
    if not table.arch.is_moe:
        return 0
    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (table.arch.num_experts // ep)


def rank_param_name(
    table: ConversionTable, local_name: str, layer_offset: int, expert_offset: int = 0
) -> str:
    """Table name of a rank's local parameter; a tied ``output_layer`` (PP>1 last stage) is the embedding.
    ``expert_offset``: :func:`stage_expert_offset` (MoE experts are numbered globally in the table)."""
    name = canonical_name(local_name, layer_offset, expert_offset)
    if name == "output_layer.weight" and table.arch.tie_embeddings:
        return "embedding.word_embeddings.weight"
    return name


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    table: ConversionTable,
    get_hf: Callable[[str], torch.Tensor],
    *,
    tp: int | None = None,
    tp_rank: int | None = None,
) -> None:
    """Fill every parameter (and expert-bias buffer) of this rank's ``model`` stage from HF tensors fetched
    by ``get_hf(name)``."""
    tp = parallel_state.get_tensor_model_parallel_world_size() if tp is None else tp
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    offset, expert_offset = stage_layer_offset(model), stage_expert_offset(table)
    for local_name, param in policy_named_tensors(model):
        name = rank_param_name(table, local_name, offset, expert_offset)
        full = table.to_megatron(name, {h: table.hf_tensor(h, get_hf) for h in table.hf_names_for(name)}, tp)
        part = table.partition(name)
        if part.expert:  # experts are split over the expert-tensor-parallel group
            shard = split_tp_shard(
                full,
                part,
                parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_rank(),
            )
        else:
            shard = split_tp_shard(full, part, tp, tp_rank)
        if shard.shape != param.shape:
            raise ConversionError(
                f"shape mismatch for {local_name}: expected {tuple(param.shape)}, got {tuple(shard.shape)}"
            )
        param.copy_(shard)
