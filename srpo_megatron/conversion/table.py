"""One declarative two-way HF <-> megatron-core parameter table per architecture.

The tables (``LLAMA``, ``QWEN2``, ``QWEN3``, ``QWEN3_MOE``, ``GPT_OSS`` below) list, per megatron ``GPTModel``
parameter, the HF tensors it is made of and the *named transform* between them. Every direction of
every consumer (the ``tools/convert_*`` CLIs, checkpoint import/export, rollout weight sync) goes through
:class:`ConversionTable` built from these rows; there is no second mapping.

Names. Megatron names are *global* local-spec parameter names of a TP1/PP1 model, e.g.
``decoder.layers.3.self_attention.linear_qkv.weight`` (layer index counted over the whole model).
``canonical_name(name, layer_offset)`` turns what a rank sees into that form: it adds the PP stage's
layer offset (``get_transformer_layer_offset``) and maps Transformer Engine aliases
(``linear_qkv.layer_norm_weight`` = ``input_layernorm.weight``, ``linear_fc1.layer_norm_weight`` =
``pre_mlp_layernorm.weight``), which are also the ``dist_checkpointing`` keys.

Full tensors. ``to_hf(name, full)`` takes the FULL tensor of a megatron parameter, i.e. the TP shards
gathered with :func:`merge_tp_shards` (not a plain concatenation: see below), and returns
``[(hf_name, tensor), ...]``; ``to_megatron(name, hf_tensors, tp)`` is the inverse and returns the full
tensor, whose TP shard ``r`` is :func:`split_tp_shard` ``(full, partition(name), tp, r)``.

TP partitions (``partition(name)`` -> :class:`TPPartition`):
- ``dim=None``: replicated on every TP rank (norm weights, QK-norm weights).
- ``dim=0`` column-parallel (``linear_qkv`` weight/bias, ``word_embeddings``, ``output_layer``): full =
  ``cat(shards, 0)``. For QKV this is correct because megatron's fused layout is grouped per query
  group, ``[g0: q heads.., k, v | g1: ...]``, and TP ranks own whole groups.
- ``dim=1`` row-parallel (``linear_proj``, ``linear_fc2``): full = ``cat(shards, 1)``.
- ``dim=0, gated=True`` (``linear_fc1``): each rank holds ``[gate_r; up_r]``; the full tensor is
  ``[gate; up]`` (``[2F, H]``), so merging concatenates the gate halves and the up halves separately.

MoE (``QWEN3_MOE``): the HF router ``mlp.gate.weight`` is megatron's ``mlp.router.weight`` (replicated
over TP). Expert ``e``'s ``gate_proj``/``up_proj``/``down_proj`` (the hub FILE format, which transformers 5
also writes; in memory it fuses them, see ``rollout.hf_engine``) are
``mlp.experts.local_experts.{e}.linear_fc1/linear_fc2.weight`` with ``e`` the GLOBAL expert index.
``canonical_name(name, layer_offset, expert_offset)`` adds the EP rank's first expert to a rank's local index
and maps Transformer Engine's grouped-GEMM names (``mlp.experts.linear_fc1.weight{e}``) to the same rows.
Expert weights are split over the expert-tensor-parallel group (ETP), not TP: their partitions carry
``expert=True`` and consumers use the ETP size/rank for them.

Fused HF tensors (``GPT_OSS``): gpt-oss stores each layer's experts as one tensor per kind
(``mlp.experts.gate_up_proj`` ``[E, H, 2F]``, gate/up interleaved; ``down_proj`` ``[E, F, H]``; their biases).
A row names expert ``e``'s slice on dim 0 as ``x[e]`` (:func:`slice_name`), so every row stays one megatron
tensor <-> its HF tensors and the lookups stay dict hits; ``hf_tensor`` reads a slice as a view of the
(mmapped) fused tensor (MXFP4 experts: that expert's blocks dequantized, ``conversion/mxfp4.py``), and the
exporter writes each slice at its offset in the fused tensor (``hf_file_plan``, ``PlannedSafetensorsWriter``).
``hf_names``/``hf_shape`` speak the slice names (weight sync, gradients); ``hf_file_names``/``hf_file_shape``
the checkpoint files' (also the SGLang manifest).

Gradients (for trainers, not weight sync): the replicated QK-norm weights see only the local heads on
each TP rank, so their gradients are partial sums; megatron's ``finalize_model_grads`` (with megatron
DDP) sums them over TP, and sums the tied embedding gradient over the first/last pipeline stage.

Vocabulary padding: ``to_megatron`` pads embedding/output rows with zeros to ``padded_vocab_size(V, tp)``;
``to_hf`` drops rows beyond the HF ``vocab_size``. With tied embeddings there is no ``output_layer``
row (HF's ``lm_head.weight`` is not written; transformers re-ties it from ``tie_word_embeddings``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping

import torch

import srpo_megatron.conversion.mla_rows as mla_rows
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.models.architecture import Architecture, UnsupportedModelError, padded_vocab_size


# ----------------------------------------------------------------------------------- named transforms
# Each transform is a pair (to_megatron(arch, hf_tensors, tp) -> full, to_hf(arch, full) -> hf_tensors).
def _identity_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    return ts[0]


def _identity_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _qkv_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """HF q ``[nq*d, ...]``, k/v ``[ng*d, ...]`` -> megatron ``[ng*(nq/ng+2)*d, ...]``, per query group."""
    q, k, v = ts
    ng, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, (arch.num_heads // ng) * d, *rest)
    k, v = k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    ng, d = arch.num_kv_heads, arch.head_dim
    per_group = (arch.num_heads // ng) * d
    rest = t.shape[1:]
    q, k, v = t.reshape(ng, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def _gate_up_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """HF gate ``[F, H]``, up ``[F, H]`` -> megatron full ``linear_fc1`` ``[2F, H]`` = ``[gate; up]``."""
    return torch.cat(ts, dim=0)


def _gate_up_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    return [x.contiguous() for x in t.chunk(2, dim=0)]


def _vocab_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """HF ``[V, H]`` -> megatron ``[V_pad, H]`` with zero rows (V_pad = multiple of 128*TP)."""
    t = ts[0]
    pad = padded_vocab_size(arch.vocab_size, tp) - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _vocab_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    return [t[: arch.vocab_size].contiguous()]


# The same ``to_megatron`` results as row-major pieces: the full tensor's bytes are the pieces' bytes in
# order, so a checkpoint writer can stream them without building (allocating, copying) the full tensor.
def _identity_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    return [ts[0]]


def _qkv_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    """Per query group ``g``: q rows of ``g``, then its k rows, then its v rows (see ``_qkv_in``)."""
    q, k, v = ts
    ng, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, (arch.num_heads // ng) * d, *rest)
    k, v = k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)
    return [part[g] for g in range(ng) for part in (q, k, v)]


def _gate_up_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    return list(ts)


def _vocab_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    t = ts[0]
    pad = padded_vocab_size(arch.vocab_size, tp) - t.shape[0]
    return [t, t.new_zeros(pad, *t.shape[1:])] if pad else [t]


# gpt-oss experts: HF fuses every expert of a layer into one tensor per kind, gate/up INTERLEAVED on the
# output features (``gate_up_proj`` [E, H, 2F]: columns g0 u0 g1 u1 ...; ``down_proj`` [E, F, H], both
# ``x @ W`` oriented). A row reads expert e's slice (see ``slice_name``) and megatron holds
# ``linear_fc1`` = [gate; up] [2F, H] and ``linear_fc2`` [H, F] (``x @ W.T``).
def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[g0 u0 g1 u1 ...] on dim 0 -> [g0 g1 ...; u0 u1 ...]."""
    return torch.cat([t[0::2], t[1::2]], dim=0)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(t.shape).contiguous()


def _oss_fc1_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """HF expert slice ``gate_up_proj[e]`` [H, 2F] (or its bias [2F]) -> megatron [gate; up] [2F, H]."""
    t = ts[0]
    return _deinterleave(t.transpose(0, 1) if t.dim() == 2 else t)


def _oss_fc1_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    t = _interleave(t)
    return [t.transpose(0, 1).contiguous() if t.dim() == 2 else t]


def _oss_fc1_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    t = ts[0].transpose(0, 1) if ts[0].dim() == 2 else ts[0]
    return [t[0::2], t[1::2]]


def _transpose_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    return ts[0].transpose(0, 1).contiguous()


def _transpose_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(0, 1).contiguous()]


def _transpose_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    return [ts[0].transpose(0, 1)]


@dataclasses.dataclass(frozen=True)
class Transform:
    name: str  # shown in errors and docs
    to_megatron: Callable[[Architecture, list[torch.Tensor], int], torch.Tensor]
    to_hf: Callable[[Architecture, torch.Tensor], list[torch.Tensor]]
    # to_megatron as row-major pieces: cat([p.reshape(-1) for p in pieces]) == to_megatron(...).reshape(-1)
    pieces: Callable[[Architecture, list[torch.Tensor], int], list[torch.Tensor]]


IDENTITY = Transform("identity", _identity_in, _identity_out, _identity_pieces)
FUSE_QKV = Transform("fuse_qkv_grouped", _qkv_in, _qkv_out, _qkv_pieces)
FUSE_GATE_UP = Transform("fuse_gate_up", _gate_up_in, _gate_up_out, _gate_up_pieces)
PAD_VOCAB = Transform("pad_vocab", _vocab_in, _vocab_out, _vocab_pieces)
DEINTERLEAVE_GATE_UP = Transform("deinterleave_gate_up", _oss_fc1_in, _oss_fc1_out, _oss_fc1_pieces)
TRANSPOSE = Transform("transpose", _transpose_in, _transpose_out, _transpose_pieces)


@dataclasses.dataclass(frozen=True)
class TPPartition:
    """How a megatron parameter is split over TP ranks."""

    dim: int | None  # None: replicated
    gated: bool = False  # linear_fc1: each shard is [gate_r; up_r]
    expert: bool = False  # an MoE expert weight: split over the expert-tensor-parallel group, not TP


REPLICATED = TPPartition(None)
COLUMN = TPPartition(0)
ROW = TPPartition(1)
GATED_COLUMN = TPPartition(0, gated=True)
EXPERT_GATED_COLUMN = TPPartition(0, gated=True, expert=True)
EXPERT_ROW = TPPartition(1, expert=True)
EXPERT_REPLICATED = TPPartition(None, expert=True)  # an expert's fc2 bias (ETP 1 with biases)


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row; ``{i}`` in names stands for the global layer index, ``{e}`` for the global expert.

    ``layers`` selects the decoder layers a ``{i}`` row exists in: ``"all"``, ``"dense"`` (layers with a dense
    MLP: every layer of a dense model, the first ``first_dense_layers`` of DeepSeek-V3/GLM-4.5) or ``"moe"``
    (``Architecture.is_moe_layer``)."""

    megatron: str
    hf: tuple[str, ...]
    transform: Transform
    partition: TPPartition
    layers: str = "all"


_L = "decoder.layers.{i}."
_H = "model.layers.{i}."
EMBEDDING = Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), PAD_VOCAB, COLUMN)
FINAL_NORM = Row("decoder.final_layernorm.weight", ("model.norm.weight",), IDENTITY, REPLICATED)
OUTPUT = Row("output_layer.weight", ("lm_head.weight",), PAD_VOCAB, COLUMN)
LAYER = (
    Row(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), IDENTITY, REPLICATED),
    Row(
        _L + "self_attention.linear_qkv.weight",
        tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"),
        FUSE_QKV,
        COLUMN,
    ),
    Row(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), IDENTITY, ROW),
    Row(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), IDENTITY, REPLICATED),
    Row(
        _L + "mlp.linear_fc1.weight",
        (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        FUSE_GATE_UP,
        GATED_COLUMN,
    ),
    Row(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), IDENTITY, ROW),
)
QKV_BIAS = Row(
    _L + "self_attention.linear_qkv.bias",
    tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"),
    FUSE_QKV,
    COLUMN,
)
QK_NORM = (
    Row(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), IDENTITY, REPLICATED),
    Row(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), IDENTITY, REPLICATED),
)

ATTENTION = LAYER[:4]  # input norm, QKV, output projection, pre-MLP norm
ROUTER = Row(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), IDENTITY, REPLICATED, layers="moe")
EXPERT_FC1 = Row(
    _L + "mlp.experts.local_experts.{e}.linear_fc1.weight",
    (_H + "mlp.experts.{e}.gate_proj.weight", _H + "mlp.experts.{e}.up_proj.weight"),
    FUSE_GATE_UP,
    EXPERT_GATED_COLUMN,
    layers="moe",
)
EXPERT_FC2 = Row(
    _L + "mlp.experts.local_experts.{e}.linear_fc2.weight",
    (_H + "mlp.experts.{e}.down_proj.weight",),
    IDENTITY,
    EXPERT_ROW,
    layers="moe",
)
# DeepSeek-V3 / GLM-4.5 MoE layers: the first ``first_dense_layers`` layers keep the dense MLP rows; the
# others have the router (with its selection-only expert bias, a non-trained buffer in megatron), the
# routed experts and the always-on shared experts (one SwiGLU of n_shared * moe_intermediate_size,
# split over TP like a dense MLP).
DENSE_FC1 = dataclasses.replace(LAYER[4], layers="dense")
DENSE_FC2 = dataclasses.replace(LAYER[5], layers="dense")
ROUTER_EXPERT_BIAS = Row(
    _L + "mlp.router.expert_bias",
    (_H + "mlp.gate.e_score_correction_bias",),
    IDENTITY,
    REPLICATED,
    layers="moe",
)
SHARED_FC1 = Row(
    _L + "mlp.shared_experts.linear_fc1.weight",
    (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"),
    FUSE_GATE_UP,
    GATED_COLUMN,
    layers="moe",
)
SHARED_FC2 = Row(
    _L + "mlp.shared_experts.linear_fc2.weight",
    (_H + "mlp.shared_experts.down_proj.weight",),
    IDENTITY,
    ROW,
    layers="moe",
)
DEEPSEEK_MOE = (
    DENSE_FC1,
    DENSE_FC2,
    ROUTER,
    ROUTER_EXPERT_BIAS,
    EXPERT_FC1,
    EXPERT_FC2,
    SHARED_FC1,
    SHARED_FC2,
)

# DeepSeek-V3 Multi-head Latent Attention (layouts and TP splits: conversion/mla_rows.py). The q rows come in
# two kinds: q compression (q_lora_rank set: MLA_Q_LORA) or one q projection (MLA_Q_PROJ).
Q_ROPE = Transform("q_rope_layout", mla_rows.q_rope_in, mla_rows.q_rope_out, mla_rows.q_rope_pieces)
KV_A_ROPE = Transform(
    "kv_a_rope_layout", mla_rows.kv_a_rope_in, mla_rows.kv_a_rope_out, mla_rows.kv_a_rope_pieces
)
_A = _L + "self_attention."
_HA = _H + "self_attn."
MLA_Q_LORA = (
    Row(_A + "linear_q_down_proj.weight", (_HA + "q_a_proj.weight",), IDENTITY, COLUMN),
    Row(_A + "q_layernorm.weight", (_HA + "q_a_layernorm.weight",), IDENTITY, REPLICATED),
    Row(_A + "linear_q_up_proj.weight", (_HA + "q_b_proj.weight",), Q_ROPE, COLUMN),
)
MLA_Q_PROJ = Row(_A + "linear_q_proj.weight", (_HA + "q_proj.weight",), Q_ROPE, COLUMN)
MLA = (
    LAYER[0],  # input norm
    *MLA_Q_LORA,
    MLA_Q_PROJ,
    Row(_A + "linear_kv_down_proj.weight", (_HA + "kv_a_proj_with_mqa.weight",), KV_A_ROPE, COLUMN),
    Row(_A + "kv_layernorm.weight", (_HA + "kv_a_layernorm.weight",), IDENTITY, REPLICATED),
    Row(_A + "linear_kv_up_proj.weight", (_HA + "kv_b_proj.weight",), IDENTITY, COLUMN),
    LAYER[2],  # o_proj
    LAYER[3],  # pre-MLP norm
)

# gpt-oss: biases on q/k/v (QKV_BIAS, switched on by qkv_bias), o, the router and the experts; the sink
# logits are megatron's (and TE's) core_attention.softmax_offset, one per head, split over TP like the heads.
# The experts are rows of SLICES of HF's fused per-layer tensors: ``{hf}[{e}]`` names expert e's slice on
# dim 0 (``slice_name``); readers index the fused tensor, writers place the slice at its offset.
_X = _H + "mlp.experts."
GPT_OSS = (
    EMBEDDING,
    *ATTENTION,
    Row(_L + "self_attention.linear_proj.bias", (_H + "self_attn.o_proj.bias",), IDENTITY, REPLICATED),
    Row(_L + "self_attention.core_attention.softmax_offset", (_H + "self_attn.sinks",), IDENTITY, COLUMN),
    Row(_L + "mlp.router.weight", (_H + "mlp.router.weight",), IDENTITY, REPLICATED, layers="moe"),
    Row(_L + "mlp.router.bias", (_H + "mlp.router.bias",), IDENTITY, REPLICATED, layers="moe"),
    Row(
        _L + "mlp.experts.local_experts.{e}.linear_fc1.weight",
        (_X + "gate_up_proj[{e}]",),
        DEINTERLEAVE_GATE_UP,
        EXPERT_GATED_COLUMN,
        layers="moe",
    ),
    Row(
        _L + "mlp.experts.local_experts.{e}.linear_fc1.bias",
        (_X + "gate_up_proj_bias[{e}]",),
        DEINTERLEAVE_GATE_UP,
        EXPERT_GATED_COLUMN,
        layers="moe",
    ),
    Row(
        _L + "mlp.experts.local_experts.{e}.linear_fc2.weight",
        (_X + "down_proj[{e}]",),
        TRANSPOSE,
        EXPERT_ROW,
        layers="moe",
    ),
    Row(
        _L + "mlp.experts.local_experts.{e}.linear_fc2.bias",
        (_X + "down_proj_bias[{e}]",),
        IDENTITY,
        EXPERT_REPLICATED,
        layers="moe",
    ),
    FINAL_NORM,
    OUTPUT,
)
# MXFP4 hub checkpoints store these fused expert weights as ``<name>_blocks`` + ``<name>_scales``
# (``conversion/mxfp4.py``); the biases stay dense.
MXFP4_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# The per-architecture tables. Optional rows (QKV bias on Llama with attention_bias, the untied output
# layer) are switched by the Architecture in ConversionTable.
LLAMA = (EMBEDDING, *LAYER, FINAL_NORM, OUTPUT)
QWEN2 = (EMBEDDING, *LAYER, QKV_BIAS, FINAL_NORM, OUTPUT)
QWEN3 = (EMBEDDING, *LAYER, *QK_NORM, FINAL_NORM, OUTPUT)
QWEN3_MOE = (EMBEDDING, *ATTENTION, *QK_NORM, ROUTER, EXPERT_FC1, EXPERT_FC2, FINAL_NORM, OUTPUT)
# GLM-4.5: GQA attention with q/k/v bias (``attention_bias``; its rows are dropped when off) and QK-norm
# (``use_qk_norm``; dropped when off), the DeepSeek-style MoE. The hub's MTP layers (``model.layers.{L..}``)
# are not in the table: conversion skips them on import and re-emits them on export (conversion/mtp.py).
GLM4_MOE = (EMBEDDING, *ATTENTION, QKV_BIAS, *QK_NORM, *DEEPSEEK_MOE, FINAL_NORM, OUTPUT)
# DeepSeek-V3/R1: MLA and the DeepSeek-style MoE; the MTP layers as for GLM-4.5.
DEEPSEEK_V3 = (EMBEDDING, *MLA, *DEEPSEEK_MOE, FINAL_NORM, OUTPUT)
TABLES = {
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "glm4_moe": GLM4_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "gpt_oss": GPT_OSS,
}

# Transformer Engine / dist_checkpointing aliases of local-spec names.
_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
)
_LAYER_RE = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
# A rank's local expert parameter: SequentialMLP ``local_experts.{e}.linear_fcN.weight`` or TE grouped GEMM
# ``linear_fcN.weight{e}``.
_SEQUENTIAL_EXPERT_RE = re.compile(
    r"^\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$"
)
_GROUPED_EXPERT_RE = re.compile(r"^\.mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$")
_SLICE_RE = re.compile(r"^(.*)\[(\d+)\]$")


def slice_name(hf_name: str) -> tuple[str, int] | None:
    """``("x", e)`` for a table name ``x[e]`` (slice e on dim 0 of the HF tensor ``x``), else None."""
    m = _SLICE_RE.match(hf_name)
    return (m.group(1), int(m.group(2))) if m else None


class ConversionError(ValueError):
    """Tensors do not match the table (missing, unexpected or mis-shaped); the message lists them."""


def canonical_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Global local-spec name of a rank's parameter / checkpoint key (``module.`` and ``model.`` prefixes,
    TE aliases, the PP layer offset and, for MoE experts, the EP rank's first global expert are handled)."""
    for prefix in ("module.", "model."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    m = _LAYER_RE.match(name)
    if m:
        rest = m.group(3)
        for pattern, local in _ALIASES:
            if pattern.search(rest):
                rest = "." + local
        rest = _global_expert(rest, expert_offset)
        name = f"{m.group(1)}{int(m.group(2)) + layer_offset}{rest}"
    return name


def _global_expert(rest: str, expert_offset: int) -> str:
    """``.mlp.experts.local_experts.{global}.linear_fcN.weight`` for a rank's local expert parameter."""
    if m := _SEQUENTIAL_EXPERT_RE.match(rest):
        return f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.{m.group(2)}"
    if m := _GROUPED_EXPERT_RE.match(rest):
        return f".mlp.experts.local_experts.{int(m.group(2)) + expert_offset}.{m.group(1)}"
    return rest


def merge_tp_shards(shards: list[torch.Tensor], partition: TPPartition) -> torch.Tensor:
    """Full tensor from the per-TP-rank shards (rank order)."""
    if partition.dim is None:
        return shards[0]
    if partition.gated:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition.dim)


def split_tp_shard(full: torch.Tensor, partition: TPPartition, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of a full tensor (inverse of :func:`merge_tp_shards`)."""
    if partition.dim is None:
        return full
    if partition.gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=partition.dim)[rank]


class ConversionTable:
    """The architecture's table instantiated for every layer; see the module docstring for the API."""

    def __init__(self, arch: Architecture, fp8: Fp8Layout | None = None):
        """``fp8``: the checkpoint's blockwise-FP8 layout (``conversion/fp8_folder.py``): its FP8 weights are
        files ``<name>`` (float8_e4m3fn) + ``<name>_scale_inv``, read dequantized by :meth:`hf_tensor`."""
        if arch.model_type not in TABLES:
            raise UnsupportedModelError(
                f"no conversion table for model_type {arch.model_type!r}; have {list(TABLES)}"
            )
        self.arch, self.fp8 = arch, fp8
        rows = list(TABLES[arch.model_type])
        if not arch.qkv_bias and QKV_BIAS in rows:  # GLM-4.5's attention_bias is optional
            rows.remove(QKV_BIAS)
        if not arch.qk_norm:  # GLM-4.5's use_qk_norm is optional
            rows = [r for r in rows if r not in QK_NORM]
        if arch.qkv_bias and QKV_BIAS not in rows:
            last_layer_row = max(k for k, r in enumerate(rows) if "{i}" in r.megatron)
            rows.insert(last_layer_row + 1, QKV_BIAS)
        if arch.tie_embeddings:
            rows.remove(OUTPUT)
        if arch.is_mla:  # q compression or one q projection
            drop = MLA_Q_LORA if arch.q_lora_rank is None else (MLA_Q_PROJ,)
            rows = [r for r in rows if r not in drop]
        self._rows: dict[str, Row] = {}
        for row in rows:
            layers = self._layers(row) if "{i}" in row.megatron else [None]
            experts = range(arch.num_experts) if "{e}" in row.megatron else [None]
            for i in layers:
                for e in experts:
                    concrete = Row(
                        row.megatron.format(i=i, e=e),
                        tuple(h.format(i=i, e=e) for h in row.hf),
                        row.transform,
                        row.partition,
                        row.layers,
                    )
                    self._rows[concrete.megatron] = concrete
        # HF name -> its row: MoE tables have tens of thousands of names, so lookups must not scan rows.
        self._hf_rows: dict[str, Row] = {h: row for row in self._rows.values() for h in row.hf}
        self._hf_shapes: dict[str, tuple[int, ...]] = {}

    def _layers(self, row: Row) -> list[int]:
        """The global decoder layers ``row`` exists in (see ``Row.layers``)."""
        every = range(self.arch.num_layers)
        if row.layers == "all":
            return list(every)
        if row.layers == "moe":
            return [i for i in every if self.arch.is_moe_layer(i)]
        if row.layers == "dense":
            return [i for i in every if not self.arch.is_moe_layer(i)]
        raise ValueError(f"Row.layers={row.layers!r} for {row.megatron}; use 'all', 'dense' or 'moe'")

    # -------------------------------------------------------------------------------------- lookup
    def megatron_names(self) -> list[str]:
        """Global megatron parameter names, in model order."""
        return list(self._rows)

    def hf_names(self) -> list[str]:
        """All HF tensor names the table produces / consumes."""
        return list(self._hf_rows)

    def row(self, megatron_name: str) -> Row:
        if megatron_name in self._rows:  # already global and canonical (the common case in conversions)
            return self._rows[megatron_name]
        name = canonical_name(megatron_name)
        try:
            return self._rows[name]
        except KeyError:
            raise ConversionError(
                f"megatron parameter {megatron_name!r} is not in the {self.arch.model_type} conversion table"
            ) from None

    def partition(self, megatron_name: str) -> TPPartition:
        return self.row(megatron_name).partition

    def hf_names_for(self, megatron_name: str) -> tuple[str, ...]:
        return self.row(megatron_name).hf

    def full_shape(self, megatron_name: str, tp: int = 1) -> tuple[int, ...]:
        """Expected full megatron shape (vocab padded for ``tp``)."""
        a = self.arch
        name = self.row(megatron_name).megatron
        qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        vocab = padded_vocab_size(a.vocab_size, tp)
        if a.is_mla and (mla := mla_rows.mla_full_shape(a, name)) is not None:
            return mla
        if ".mlp.shared_experts." in name:
            f = a.shared_expert_intermediate_size
            return (2 * f, a.hidden_size) if name.endswith("linear_fc1.weight") else (a.hidden_size, f)
        if name.endswith("mlp.router.expert_bias"):
            return (a.num_experts,)
        if name.endswith("core_attention.softmax_offset"):
            return (a.num_heads,)
        if name.endswith("mlp.router.bias"):
            return (a.num_experts,)
        if ".mlp.experts." in name and name.endswith(".bias"):
            return (2 * a.moe_intermediate_size,) if "linear_fc1" in name else (a.hidden_size,)
        if ".mlp.experts." in name:
            fc1 = name.endswith("linear_fc1.weight")
            return (
                (2 * a.moe_intermediate_size, a.hidden_size)
                if fc1
                else (a.hidden_size, a.moe_intermediate_size)
            )
        for suffix, shape in (
            ("mlp.router.weight", (a.num_experts, a.hidden_size)),
            ("word_embeddings.weight", (vocab, a.hidden_size)),
            ("output_layer.weight", (vocab, a.hidden_size)),
            ("linear_qkv.weight", (qkv, a.hidden_size)),
            ("linear_qkv.bias", (qkv,)),
            ("linear_proj.weight", (a.hidden_size, a.num_heads * a.head_dim)),
            ("linear_fc1.weight", (2 * a.intermediate_size, a.hidden_size)),
            ("linear_fc2.weight", (a.hidden_size, a.intermediate_size)),
            ("q_layernorm.weight", (a.head_dim,)),
            ("k_layernorm.weight", (a.head_dim,)),
        ):
            if name.endswith(suffix):
                return shape
        return (a.hidden_size,)  # the RMSNorm weights

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """Expected HF shape of ``hf_name`` (derived by sending a meta tensor through ``to_hf``)."""
        if hf_name in self._hf_shapes:
            return self._hf_shapes[hf_name]
        row = self._hf_rows.get(hf_name)
        if row is None:
            raise ConversionError(
                f"HF tensor {hf_name!r} is not in the {self.arch.model_type} conversion table"
            )
        meta = torch.empty(self.full_shape(row.megatron), device="meta")
        for h, t in zip(row.hf, row.transform.to_hf(self.arch, meta), strict=True):
            self._hf_shapes[h] = tuple(t.shape)
        return self._hf_shapes[hf_name]

    # ------------------------------------------------------------------------ HF files (fused slices)
    def hf_file_names(self) -> list[str]:
        """The tensor names of an HF checkpoint of this table, in table order: a fused tensor ``x`` once
        for all its ``x[e]`` slices, and an MXFP4 one as ``x_blocks``, ``x_scales``."""
        out: dict[str, None] = {}
        for h in self._hf_rows:
            sliced = slice_name(h)
            base = sliced[0] if sliced else h
            if self._is_mxfp4(base):
                out.update({base + "_blocks": None, base + "_scales": None})
            else:
                out[base] = None
                if self.is_fp8(base):
                    out[Fp8Layout.scale_name(base)] = None
        return list(out)

    def is_fp8(self, hf_name: str) -> bool:
        """Whether the checkpoint stores ``hf_name`` as FP8 + ``weight_scale_inv`` (``fp8`` layout given)."""
        return self.fp8 is not None and self.fp8.is_fp8(hf_name)

    def fp8_scale_shape(self, hf_name: str, layout: Fp8Layout | None = None) -> tuple[int, int]:
        """Shape of FP8 weight ``hf_name``'s ``weight_scale_inv``: a scale per block, edge blocks partial."""
        rows, cols = self.hf_shape(hf_name)
        br, bc = (layout or self.fp8).block
        return -(-rows // br), -(-cols // bc)

    def _is_mxfp4(self, base: str) -> bool:
        return self.arch.mxfp4_experts and base.endswith(MXFP4_FUSED)

    def hf_file_shape(self, file_name: str) -> tuple[int, ...]:
        """Shape of a tensor of :meth:`hf_file_names` (a fused tensor: ``[E, *slice]``)."""
        for suffix in ("_blocks", "_scales"):
            base = file_name.removesuffix(suffix)
            if base != file_name and self._is_mxfp4(base):
                slice_in, slice_out = self.hf_shape(base + "[0]")  # bf16 orientation [in, out]
                blocks = (self.arch.num_experts, slice_out, slice_in // 32)
                return (*blocks, 16) if suffix == "_blocks" else blocks
        if file_name in self._hf_rows:
            return self.hf_shape(file_name)
        base = file_name.removesuffix("_scale_inv")
        if base != file_name and self.is_fp8(base):
            return self.fp8_scale_shape(base)
        return (self.arch.num_experts, *self.hf_shape(file_name + "[0]"))

    def hf_file_plan(self, fp8: Fp8Layout | None = None) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every tensor an export writes: dense (MXFP4 and FP8 are dequantized on
        import), or with ``fp8`` each of its FP8 weights followed by its ``weight_scale_inv``."""
        plan: dict[str, tuple[int, ...]] = {}
        for h in self._hf_rows:
            sliced = slice_name(h)
            if sliced is None:
                plan[h] = self.hf_shape(h)
                if fp8 is not None and fp8.is_fp8(h):
                    plan[Fp8Layout.scale_name(h)] = self.fp8_scale_shape(h, fp8)
            elif sliced[0] not in plan:
                plan[sliced[0]] = (self.arch.num_experts, *self.hf_shape(h))
        return list(plan.items())

    def hf_tensor(
        self, hf_name: str, get: Callable[[str], torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The table's HF tensor ``hf_name`` read through ``get(file_name)``: a slice ``x[e]`` indexes the
        fused ``x`` (a view), an MXFP4 one dequantizes expert e's blocks only, an FP8 one is dequantized
        with its ``weight_scale_inv`` into ``dtype`` (``conversion/fp8_folder.py``; ``dtype`` applies to
        FP8 weights only, every other tensor comes as stored)."""
        sliced = slice_name(hf_name)
        if sliced is None:
            if self.is_fp8(hf_name):
                from srpo_megatron.conversion.fp8_folder import dequantize_weight

                return dequantize_weight(
                    hf_name, get(hf_name), get(Fp8Layout.scale_name(hf_name)), self.fp8.block, dtype
                )
            return get(hf_name)
        base, e = sliced
        if self._is_mxfp4(base):
            from srpo_megatron.conversion.mxfp4 import dequantize_expert

            return dequantize_expert(get(base + "_blocks")[e], get(base + "_scales")[e])
        return get(base)[e]

    # ---------------------------------------------------------------------------------- transforms
    def to_hf(self, megatron_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(hf_name, tensor)]`` for a FULL megatron tensor (any TP padding of the vocab accepted)."""
        row = self.row(megatron_name)
        expected = self.full_shape(row.megatron)
        vocab_row = row.transform is PAD_VOCAB
        if (vocab_row and (full.shape[0] < expected[0] or full.shape[1:] != expected[1:])) or (
            not vocab_row and tuple(full.shape) != expected
        ):
            raise ConversionError(
                f"shape mismatch for {row.megatron}: expected {expected}, got {tuple(full.shape)}"
            )
        return list(zip(row.hf, row.transform.to_hf(self.arch, full), strict=True))

    def to_megatron(
        self, megatron_name: str, hf_tensors: Mapping[str, torch.Tensor], tp: int = 1
    ) -> torch.Tensor:
        """FULL megatron tensor (vocab padded for ``tp``) from the HF tensors of that row."""
        row = self._checked_row(megatron_name, hf_tensors)
        return row.transform.to_megatron(self.arch, [hf_tensors[h] for h in row.hf], tp)

    def to_megatron_pieces(
        self, megatron_name: str, hf_tensors: Mapping[str, torch.Tensor], tp: int = 1
    ) -> list[torch.Tensor]:
        """:meth:`to_megatron` as pieces (views of the HF tensors where possible) whose row-major bytes,
        concatenated, are the full tensor's: ``cat([p.reshape(-1) for p in pieces])`` is
        ``to_megatron(...).reshape(-1)``. Lets a writer stream a row without building the full tensor."""
        row = self._checked_row(megatron_name, hf_tensors)
        return row.transform.pieces(self.arch, [hf_tensors[h] for h in row.hf], tp)

    def _checked_row(self, megatron_name: str, hf_tensors: Mapping[str, torch.Tensor]) -> Row:
        row = self.row(megatron_name)
        missing = [h for h in row.hf if h not in hf_tensors]
        if missing:
            raise ConversionError(f"missing HF tensors for {row.megatron}: {missing}")
        for h in row.hf:
            want, got = self.hf_shape(h), tuple(hf_tensors[h].shape)
            if want != got:
                raise ConversionError(f"shape mismatch for {h}: expected {want}, got {got}")
        return row

    def check_hf_names(self, names: set[str] | list[str]) -> None:
        """Raise listing every missing and unexpected HF tensor (``lm_head.weight`` tolerated when tied)."""
        names = set(names)
        expected = set(self.hf_file_names())
        tolerated = {"lm_head.weight"} if self.arch.tie_embeddings else set()
        missing = sorted(expected - names)
        unexpected = sorted(names - expected - tolerated)
        if missing or unexpected:
            raise ConversionError(
                f"HF checkpoint does not match the {self.arch.model_type} table: "
                f"missing tensors {missing}; unexpected tensors {unexpected}"
            )

    def check_hf_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise listing every HF tensor whose shape differs from the table's (name, expected, got)."""
        files = set(self.hf_file_names())
        bad = [
            f"{name}: expected {self.hf_file_shape(name)}, got {tuple(shape)}"
            for name, shape in shapes.items()
            if name in files and self.hf_file_shape(name) != tuple(shape)
        ]
        if bad:
            raise ConversionError("shape mismatch: " + "; ".join(bad))

    def iter_to_megatron(
        self, get_hf: Callable[[str], torch.Tensor], tp: int = 1
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(megatron_name, full_tensor)`` pulling HF tensors on demand via ``get_hf(name)``."""
        for name, row in self._rows.items():
            yield name, self.to_megatron(name, {h: self.hf_tensor(h, get_hf) for h in row.hf}, tp)
