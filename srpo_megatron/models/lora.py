"""LoRA adapters on megatron-core's parallel linears, exactly PEFT's adapters on the HF model.

Every targeted linear keeps its class's behaviour and weight, gains a submodule ``lora`` (an
``nn.ModuleDict`` keyed by the HF/PEFT projection name: ``linear_qkv.lora.q_proj``, ``.k_proj``, ``.v_proj``;
``linear_proj.lora.o_proj``; ``linear_fc1.lora.gate_proj``, ``.up_proj``; ``linear_fc2.lora.down_proj``)
whose entries hold ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]`` (torch ``Linear`` layout; the
FULL shapes are HF's, each rank holds its TP shard). The output gains

    y += (alpha / rank) · (dropout(x) @ Aᵀ) @ Bᵀ

per projection, placed in megatron's fused output layout: QKV interleaved per query group
(``[q of group g; k of g; v of g]`` for this rank's groups), ``linear_fc1`` = ``[gate; up]`` of this rank.
The fused linears carry one adapter per HF projection, not one shared A, so a PEFT adapter of the HF model
is loaded one to one (``lora_A``/``lora_B`` per module) and the forward equals ``peft``'s.

Tensor parallelism (group = the linear's ``tp_group``):

- column-parallel base (``linear_qkv``, ``linear_fc1``): A replicated, B split on its output rows as the
  base's rows (this rank's heads / its gate and up halves). ``h = x Aᵀ`` is computed once; without SP
  ``copy_to_tensor_model_parallel_region(h)`` all-reduces ``dh`` (each rank's B rows give part of it), so
  dA and dx are complete on every rank. Under SP ``x`` is this rank's sequence slice:
  ``gather_from_sequence_parallel_region(h)`` (``[s, b, rank]``, not the hidden-size input) and its
  reduce-scatter backward give each rank its slice of ``dh``; A's gradient is then a sum over sequence
  slices, so A is marked ``sequence_parallel`` like the layer norms and megatron's ``finalize_model_grads``
  all-reduces it over TP (megatron-core 0.16.1 ``_allreduce_non_tensor_model_parallel_grads``).
- row-parallel base (``linear_proj``, ``linear_fc2``): A split on its input columns, B replicated.
  ``h = x A_localᵀ`` is a partial sum: ``reduce_from_tensor_model_parallel_region`` (without SP) or
  ``reduce_scatter_to_sequence_parallel_region`` (under SP, to the base output's sequence slice); under SP
  B's gradient is a sum over sequence slices, so B is marked ``sequence_parallel``.
- MoE experts (``lora.experts``, megatron's ``SequentialMLP``): one adapter per expert on its
  ``linear_fc1``/``linear_fc2``; the dispatcher does every expert communication (``explicit_expert_comm``),
  so the adapters run locally and inherit the base weight's ``allreduce`` flag (expert-data-parallel
  gradient reduction). Expert-tensor parallelism (ETP > 1) and TE's grouped experts are refused.
- PP: each stage adapts its own layers; CP: the adapters are per token, nothing to do.

Transformer Engine spec: ``TELayerNormColumnParallelLinear`` fuses the input norm into ``linear_qkv`` and
``linear_fc1``, so its input is the *un-normed* hidden state; the adapter needs the normed one, which TE
returns when ``return_layernorm_output`` is set (``(out, ln_out)``; ``(out, bias, ln_out)`` with
``return_bias``); that ``ln_out`` is this rank's sequence slice under SP (we do not set
``return_layernorm_output_gathered``), so the same column logic applies. The TE path cannot run on CPU;
it is untested here.

Checkpoints: ``sharded_state_dict`` adds the adapters with their TP axis (column B: 0, row A: 1, the rest
replicated), so ``dist_checkpointing`` stores the full HF shapes above.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from srpo_megatron.config.lora import LORA_MLA_TARGETS, LoraConfig

# megatron linear (by its attribute name) -> the HF projections it fuses, in megatron's output order
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
_LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_qkv": ("column", QKV),
    "linear_proj": ("row", ("o_proj",)),
    "linear_fc1": ("column", GATE_UP),
    "linear_fc2": ("row", ("down_proj",)),
}
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


class LoraError(ValueError):
    """A LoRA configuration the policy's layout cannot serve."""


class LoraPair(torch.nn.Module):
    """One PEFT adapter: ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]`` (local TP shards)."""

    def __init__(self, a_shape: tuple[int, int], b_shape: tuple[int, int], like: torch.Tensor) -> None:
        super().__init__()
        kw = dict(dtype=like.dtype, device=like.device)
        self.lora_A = torch.nn.Parameter(torch.zeros(a_shape, **kw))
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, **kw))


@dataclass
class LoraPlan:
    """How one linear's adapters compute: geometry and communication (see the module docstring)."""

    kind: str  # "column" | "row"
    projections: tuple[str, ...]  # the HF projections of the fused output, in megatron's order
    split: list[int]  # this rank's output rows of every projection (column) in fused order
    groups: int  # QKV: this rank's query groups (outputs interleave per group); else 1
    scaling: float
    dropout: float
    tp: int
    tp_group: dist.ProcessGroup | None
    sequence_parallel: bool
    local: bool  # experts: the dispatcher communicates, the adapter runs locally
    te_norm: bool  # TE's LayerNormLinear: the adapter input is the returned normed activation


class LoraLinearMixin:
    """Added in front of a megatron linear's class by :func:`attach_lora` (forward and checkpoint)."""

    lora: torch.nn.ModuleDict
    _lora_plan: LoraPlan

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)  # type: ignore[misc]
        plan = self._lora_plan
        if plan.te_norm:  # (out, ln_out) or (out, bias, ln_out), wrapped as (that, None) without bias
            if getattr(self, "te_return_bias", False):
                output, bias, x = out
            else:
                (output, x), bias = out
        else:
            (output, bias), x = out, (args[0] if args else next(iter(kwargs.values())))
        return output + lora_delta(self.lora, plan, x), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[misc]
        for key in [k for k in sd if k.startswith(f"{prefix}lora.")]:
            del sd[key]
        params = {f"lora.{n}": p for n, p in self.lora.named_parameters()}
        axes = {k: p.lora_tp_axis for k, p in params.items() if p.lora_tp_axis is not None}
        sd.update(
            make_sharded_tensors_for_checkpoint(
                params,
                prefix,
                axes,
                sharded_offsets,
                tp_group=getattr(self, "tp_group", None),
                dp_cp_group=(metadata or {}).get("dp_cp_group"),
            )
        )
        return sd


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Lora{base.__name__}", (LoraLinearMixin, base), {})
    return _CLASSES[base]


def _dropout(x: torch.Tensor, plan: LoraPlan, training: bool) -> torch.Tensor:
    """PEFT's ``lora_dropout`` on the adapter input (training only). It draws from the default generator,
    which megatron seeds alike on the ranks of a TP group, so a replicated input (column-parallel without
    SP) gets the same mask on every rank, as the replicated ``h`` requires; the sharded inputs (row-parallel,
    SP slices) reuse that pattern on their own slices. Not compared with peft (its masks are its own)."""
    return F.dropout(x, plan.dropout, training) if plan.dropout and training else x


def lora_delta(adapters: torch.nn.ModuleDict, plan: LoraPlan, x: torch.Tensor) -> torch.Tensor:
    """``scaling · (dropout(x) Aᵀ) Bᵀ`` of every projection in the linear's (local, fused) output layout."""
    from megatron.core.tensor_parallel import mappings as m

    x = _dropout(x, plan, adapters.training)
    comm = plan.tp > 1 and not plan.local
    if plan.kind == "row":
        pair = adapters[plan.projections[0]]
        h = x @ pair.lora_A.t()
        if comm and plan.sequence_parallel:
            h = m.reduce_scatter_to_sequence_parallel_region(h, group=plan.tp_group)
        elif comm:
            h = m.reduce_from_tensor_model_parallel_region(h, group=plan.tp_group)
        return (h @ pair.lora_B.t()) * plan.scaling
    present = [p for p in plan.projections if p in adapters]
    # One GEMM per projection, the shapes PEFT's layers compute (x A_qᵀ, x A_kᵀ, ...), not one over the
    # concatenated A: a GEMM's sum order can depend on its width, and a fused [*, 3r] product differed from
    # the [*, r] ones by ~1e-5 on AVX2 CPUs, which broke the engine's bit-equal log-probs under
    # rollout.true_on_policy_mode (tests/integration/test_true_on_policy.py). One collective for all.
    hs = {p: x @ adapters[p].lora_A.t() for p in present}
    if comm:
        h = torch.cat(list(hs.values()), dim=-1) if len(present) > 1 else hs[present[0]]
        if plan.sequence_parallel:
            h = m.gather_from_sequence_parallel_region(h, group=plan.tp_group)
        else:
            h = m.copy_to_tensor_model_parallel_region(h, group=plan.tp_group)
        hs = {p: c.contiguous() for p, c in zip(present, h.chunk(len(present), dim=-1), strict=True)}
    pieces, lead = [], next(iter(hs.values())).shape[:-1]
    for proj, rows in zip(plan.projections, plan.split, strict=True):
        if proj in hs:
            pieces.append((hs[proj] @ adapters[proj].lora_B.t()).unflatten(-1, (plan.groups, -1)))
        else:
            pieces.append(x.new_zeros(*lead, plan.groups, rows // plan.groups))
    return torch.cat(pieces, dim=-1).flatten(-2) * plan.scaling


def _targets(cfg: LoraConfig) -> set[str]:
    mla = [t for t in cfg.target_modules if t in LORA_MLA_TARGETS]
    if mla:
        raise LoraError(
            f"lora.target_modules {mla}: adapters on MLA's projections are not wired yet; target "
            "q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj (MLA models: the MLP ones)"
        )
    return set(cfg.target_modules)


def _plan(module: torch.nn.Module, attr: str, expert: bool, cfg: LoraConfig, config) -> LoraPlan:
    kind, projections = _LINEARS[attr]
    tp_group = getattr(module, "tp_group", None)
    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    if expert and tp > 1:
        raise LoraError(
            f"lora.experts with expert tensor parallelism {tp} is not supported (the replicated expert "
            "adapter halves would need an ETP gradient reduction); set parallel.etp: 1 or lora.experts: false"
        )
    if getattr(module, "gather_output", False):
        raise LoraError(f"{attr} gathers its output; LoRA expects megatron's parallel output layout")
    out_local = module.weight.shape[0]
    groups, split = 1, [out_local]
    if projections == QKV:
        ng, nq, d = config.num_query_groups, config.num_attention_heads, config.kv_channels
        groups = ng // tp
        split = [groups * (nq // ng) * d, groups * d, groups * d]
    elif projections == GATE_UP:
        split = [out_local // 2, out_local // 2]
    te_norm = type(module).__name__ == "TELayerNormColumnParallelLinear"
    if te_norm:
        module.return_layernorm_output = True
        module.return_layernorm_output_gathered = False
    return LoraPlan(
        kind=kind,
        projections=projections,
        split=split,
        groups=groups,
        scaling=cfg.scaling,
        dropout=cfg.dropout,
        tp=tp,
        tp_group=tp_group,
        sequence_parallel=bool(getattr(module, "sequence_parallel", False)) and tp > 1,
        local=expert,
        te_norm=te_norm,
    )


def _adapters(module: torch.nn.Module, plan: LoraPlan, targets: set[str], r: int) -> torch.nn.ModuleDict:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    w = module.weight
    pairs = torch.nn.ModuleDict()
    for proj, rows in zip(plan.projections, plan.split, strict=True):
        if proj not in targets:
            continue
        if plan.kind == "column":
            pair = LoraPair((r, w.shape[1]), (rows, r), w)
            split_p, replicated = pair.lora_B, pair.lora_A
            axis = 0
        else:
            pair = LoraPair((r, w.shape[1]), (w.shape[0], r), w)
            split_p, replicated = pair.lora_A, pair.lora_B
            axis = 1
        for p in (pair.lora_A, pair.lora_B):
            p.lora_tp_axis = None
            if hasattr(w, "allreduce"):  # experts: the expert-data-parallel reduction, as the base
                p.allreduce = w.allreduce
        if plan.tp > 1 and not plan.local:
            set_tensor_model_parallel_attributes(split_p, True, axis, 1)
            split_p.lora_tp_axis = axis
            if plan.sequence_parallel:
                replicated.sequence_parallel = True  # finalize_model_grads sums it over TP
        pairs[proj] = pair
    return pairs


def _lora_sites(model: torch.nn.Module, cfg: LoraConfig) -> Iterator[tuple[str, torch.nn.Module, str, bool]]:
    for name, module in model.named_modules():
        attr = name.rpartition(".")[2]
        if attr not in _LINEARS:
            continue
        expert = ".mlp.experts." in f".{name}"
        if expert and not cfg.experts:
            continue
        if expert and _EXPERT.search(f".{name}.") is None:  # TE's grouped experts: weight0, weight1, ...
            raise LoraError(
                f"{name}: LoRA on experts needs megatron's SequentialMLP experts (local spec, "
                "moe.grouped_gemm: false); set lora.experts: false or moe.grouped_gemm: false"
            )
        if getattr(module, "weight", None) is None:
            raise LoraError(f"{name} ({type(module).__name__}) has no weight for an adapter to follow")
        yield name, module, attr, expert


def attach_lora(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze every parameter of ``model`` (one pipeline stage) and add the adapters ``cfg`` names to its
    targeted linears (A and B zero: :func:`init_lora` draws them). Returns the adapted linears' names."""
    targets = _targets(cfg)
    model.requires_grad_(False)
    config = getattr(model, "config", None)
    done = []
    for name, module, attr, expert in list(_lora_sites(model, cfg)):
        if not targets & set(_LINEARS[attr][1]):
            continue
        plan = _plan(module, attr, expert, cfg, config)
        module.lora = _adapters(module, plan, targets, cfg.rank)
        module._lora_plan = plan
        module.__class__ = _lora_class(type(module))
        done.append(name)
    if not done:
        raise LoraError(f"lora.target_modules={cfg.target_modules} matched no linear of this model")
    return done


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This rank's adapter parameters by local name (``....lora.<proj>.lora_A`` / ``lora_B``)."""
    return {n: p for n, p in model.named_parameters() if ".lora." in f".{n}"}


def global_lora_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """The name of a local adapter parameter with global layer and expert numbers (PP/EP offsets added)."""
    name = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", local_name, count=1)
    return _EXPERT.sub(
        lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.", name, count=1
    )


def full_shard(param: torch.nn.Parameter, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of the full adapter tensor ``full`` (``param.lora_tp_axis`` chunk, or all)."""
    axis = param.lora_tp_axis
    return full if axis is None else full.chunk(tp, dim=axis)[tp_rank]


def _tp_of(model: torch.nn.Module, local_name: str) -> tuple[int, int]:
    module = model.get_submodule(local_name.rsplit(".lora.", 1)[0])
    plan = module._lora_plan
    if plan.tp == 1 or plan.local:
        return 1, 0
    return plan.tp, dist.get_rank(plan.tp_group)


@torch.no_grad()
def load_lora(
    model: torch.nn.Module, get_full: Callable[[str], torch.Tensor], layer_offset: int, expert_offset: int = 0
) -> None:
    """Fill every adapter of this stage from full tensors ``get_full(global name)`` (HF shapes)."""
    for name, p in lora_parameters(model).items():
        tp, rank = _tp_of(model, name)
        p.copy_(full_shard(p, get_full(global_lora_name(name, layer_offset, expert_offset)), rank, tp))


@torch.no_grad()
def init_lora(model: torch.nn.Module, seed: int, layer_offset: int, expert_offset: int = 0) -> None:
    """PEFT's init: A kaiming-uniform (a=√5, i.e. U(±1/√in)), B zero; A drawn full-size from a generator
    seeded by ``seed`` and the global name, then sharded, so every TP/PP/EP layout starts from the same A."""

    def full(name: str) -> torch.Tensor:
        p = params[local[name]]
        tp, _ = _tp_of(model, local[name])
        shape = list(p.shape)
        if p.lora_tp_axis is not None:
            shape[p.lora_tp_axis] *= tp
        if name.endswith("lora_B"):
            return torch.zeros(shape)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)

    params = lora_parameters(model)
    local = {global_lora_name(n, layer_offset, expert_offset): n for n in params}
    load_lora(model, full, layer_offset, expert_offset)


@torch.no_grad()
def lora_weight_delta(module: torch.nn.Module) -> torch.Tensor:
    """``scaling · B A`` of a LoRA linear's adapters in its local base weight's (fused, TP-sharded) layout,
    the mirror of :func:`lora_delta` on weights: this rank's rows (column-parallel: B's row shard times the
    replicated A, interleaved per query group like ``linear_qkv``; gate/up stacked like ``linear_fc1``) or
    columns (row-parallel: the replicated B times A's column shard). So ``weight + delta`` is exactly this
    rank's shard of the merged HF weight and the base weight's gather carries it (no adapter gather)."""
    plan, adapters, w = module._lora_plan, module.lora, module.weight
    acc = torch.promote_types(w.dtype, torch.float32)
    if plan.kind == "row":
        pair = adapters[plan.projections[0]]
        return plan.scaling * (pair.lora_B.to(acc) @ pair.lora_A.to(acc))
    pieces = []
    for proj, rows in zip(plan.projections, plan.split, strict=True):
        if proj in adapters:
            d = adapters[proj].lora_B.to(acc) @ adapters[proj].lora_A.to(acc)
        else:
            d = torch.zeros(rows, w.shape[1], dtype=acc, device=w.device)
        pieces.append(d.unflatten(0, (plan.groups, -1)))
    return plan.scaling * torch.cat(pieces, dim=1).flatten(0, 1)


def merged_shard(module: torch.nn.Module) -> torch.Tensor:
    """This rank's base weight with its adapters folded in (``W + scaling · B A`` in fp32, W's dtype)."""
    w = module.weight.detach()
    return (w.to(torch.promote_types(w.dtype, torch.float32)) + lora_weight_delta(module)).to(w.dtype)
