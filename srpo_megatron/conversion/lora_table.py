"""The two-way megatron <-> PEFT name table of the LoRA adapters, derived from the base conversion table.

Names. The policy's adapters sit on megatron's linears, one adapter per HF projection (the fused QKV and
gate/up linears carry one per q/k/v and gate/up), at full (TP1, unsharded) shapes ``lora_A`` ``[r, in]``,
``lora_B`` ``[out, r]``::

    decoder.layers.{i}.self_attention.linear_qkv.lora.q_proj.lora_A        <->
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight      (PEFT's adapter_model.safetensors)

``<megatron linear>.lora.<target>.lora_{A,B}`` <-> ``base_model.model.<HF module>.lora_{A,B}.weight``,
where ``<HF module>.weight`` is one of the HF tensors of ``<megatron linear>.weight``'s row in
``conversion/table.py`` and ``<target>`` its last name component (the PEFT ``target_modules`` name). So
the LoRA rows are not a second hand-written table: :class:`LoraTable` reads them off the architecture's
:class:`ConversionTable`, and every architecture the base table covers gets its adapter names (Qwen3
dense, Qwen3-MoE experts ``mlp.experts.local_experts.{e}.linear_fc1.lora.gate_proj`` <->
``mlp.experts.{e}.gate_proj``, GLM-4.5 / DeepSeek-V3 shared experts, MLA's ``q_a_proj``/``q_b_proj``/
``kv_a_proj_with_mqa``/``kv_b_proj``).

Values. A and B keep PEFT's orientation (``nn.Linear`` weights: ``delta W = scaling * B @ A``, ``[out, in]``),
so they cross unchanged, except where the base row permutes the output rows of the HF weight (MLA's RoPE
layout for ``rope_interleave: false``, ``conversion/mla_rows.py``): B's rows are permuted the same way (B is
``delta W``'s row space; A, the input side, is unchanged). Rows the table fuses from slices of a fused HF
tensor (gpt-oss's experts) or transposes have no per-projection ``nn.Linear`` in HF and are not adapter
targets here: asking for them raises :class:`LoraTableError`.

TP/PP/EP: like the base table, names are global (layer index over the whole model, global expert index) and
tensors full; :func:`lora_canonical_name` turns a rank's local name into that form.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.table import (
    FUSE_GATE_UP,
    FUSE_QKV,
    IDENTITY,
    KV_A_ROPE,
    Q_ROPE,
    ConversionError,
    ConversionTable,
    canonical_name,
    slice_name,
)
from srpo_megatron.models.architecture import Architecture

PEFT_PREFIX = "base_model.model."
FACTORS = ("lora_A", "lora_B")
# Base transforms whose HF tensors are whole nn.Linear weights (per projection), B's rows following W's rows:
# identity/fusions (each HF projection has its own adapter) and MLA's RoPE row permutations (applied to B).
_PER_PROJECTION = (IDENTITY, FUSE_QKV, FUSE_GATE_UP)
_ROW_PERMUTATIONS = (Q_ROPE, KV_A_ROPE)
_LINEAR = re.compile(r"\.(linear_[a-z_0-9]+)\.weight$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


class LoraTableError(ConversionError):
    """A name or shape that is not an adapter of this architecture and LoRA config (one line)."""


@dataclasses.dataclass(frozen=True)
class LoraRow:
    """One adapter factor: its megatron and PEFT names, the HF module it adapts, its full shape."""

    megatron: str  # decoder.layers.0.self_attention.linear_qkv.lora.q_proj.lora_A
    peft: str  # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    hf_module: str  # model.layers.0.self_attn.q_proj
    target: str  # q_proj (the PEFT target_modules name)
    factor: str  # lora_A or lora_B
    shape: tuple[int, ...]  # A: [r, in]; B: [out, r]
    permute_rows: bool  # B of an MLA RoPE row: rows follow the base row's RoPE layout
    expert: bool  # a routed expert's adapter (lora.experts)


def lora_canonical_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Global adapter name of a rank's local one: ``module.``/``model.`` prefixes, the PP stage's layer
    offset and the EP rank's first global expert (``local_experts.{e}``) are handled."""
    name = canonical_name(name, layer_offset)
    if expert_offset and (m := _LOCAL_EXPERT.match(name)):
        name = f"{m.group(1)}{int(m.group(2)) + expert_offset}{m.group(3)}"
    return name


class LoraTable:
    """The adapters of ``arch`` under ``lora`` (its ``target_modules`` and ``experts``), in the base
    table's row order (per row template, every layer; per module lora_A then lora_B)."""

    def __init__(self, arch: Architecture, lora: LoraConfig, base: ConversionTable | None = None):
        if not lora.enabled:
            raise LoraTableError("lora.rank is 0: there are no adapters to name; set lora.rank > 0")
        self.arch, self.lora = arch, lora
        self.base = base or ConversionTable(arch)
        self._rows: dict[str, LoraRow] = {}
        for name in self.base.megatron_names():
            self._add_rows(name)
        if not self._rows:
            raise LoraTableError(
                f"lora.target_modules={lora.target_modules} (experts={lora.experts}) names no linear of this "
                f"{arch.model_type} model; use names of its HF projections, e.g. q_proj, v_proj"
            )
        self._peft = {r.peft: r for r in self._rows.values()}

    def _add_rows(self, name: str) -> None:
        m = _LINEAR.search(name)
        if m is None:
            return
        row = self.base.row(name)
        expert = ".mlp.experts." in name
        for h in row.hf:
            sliced = slice_name(h)  # gpt-oss: expert e's slice of a fused tensor, x[e]
            module = (sliced[0] if sliced else h).removesuffix(".weight")
            target = module.rsplit(".", 1)[-1]
            if target not in self.lora.target_modules or (expert and not self.lora.experts):
                continue
            if row.transform not in _PER_PROJECTION + _ROW_PERMUTATIONS:
                raise LoraTableError(
                    f"lora.target_modules has {target!r}, but {self.arch.model_type}'s {h} is stored "
                    f"{row.transform.name} (no per-projection nn.Linear in HF, so no PEFT adapter); "
                    f"drop {target!r} from lora.target_modules"
                )
            out_f, in_f = self.base.hf_shape(h)
            stem = name.removesuffix(".weight") + f".lora.{target}."
            for factor, shape in (("lora_A", (self.lora.rank, in_f)), ("lora_B", (out_f, self.lora.rank))):
                permute = factor == "lora_B" and row.transform in _ROW_PERMUTATIONS
                self._rows[stem + factor] = LoraRow(
                    stem + factor, f"{PEFT_PREFIX}{module}.{factor}.weight", module, target, factor,
                    shape, permute, expert,
                )  # fmt: skip

    # ------------------------------------------------------------------------------------------- lookup
    def megatron_names(self) -> list[str]:
        return list(self._rows)

    def peft_names(self) -> list[str]:
        return [r.peft for r in self._rows.values()]

    def row(self, megatron_name: str) -> LoraRow:
        row = self._rows.get(megatron_name) or self._rows.get(lora_canonical_name(megatron_name))
        if row is None:
            raise LoraTableError(
                f"{megatron_name!r} is not a LoRA adapter of this {self.arch.model_type} model with "
                f"target_modules={self.lora.target_modules}, experts={self.lora.experts}"
            )
        return row

    def peft_row(self, peft_name: str) -> LoraRow:
        row = self._peft.get(peft_name)
        if row is None:
            raise LoraTableError(
                f"{peft_name!r} is not a PEFT LoRA tensor of this {self.arch.model_type} model with "
                f"target_modules={self.lora.target_modules}, experts={self.lora.experts}"
            )
        return row

    def hf_modules(self) -> list[str]:
        """The adapted HF modules (each once), in model order."""
        return list(dict.fromkeys(r.hf_module for r in self._rows.values()))

    # ----------------------------------------------------------------------------------------- tensors
    def to_peft(self, megatron_name: str, full: torch.Tensor) -> tuple[str, torch.Tensor]:
        """``(peft_name, tensor)`` for an adapter factor's FULL megatron tensor."""
        row = self._checked(self.row(megatron_name), full)
        if row.permute_rows:
            full = self._transform(row).to_hf(self.arch, full)[0]
        return row.peft, full

    def to_megatron(self, peft_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """``(megatron_name, full tensor)`` for a PEFT adapter tensor."""
        row = self._checked(self.peft_row(peft_name), tensor)
        if row.permute_rows:
            tensor = self._transform(row).to_megatron(self.arch, [tensor], 1)
        return row.megatron, tensor

    def _transform(self, row: LoraRow):
        return self.base.row(row.megatron.split(".lora.")[0] + ".weight").transform

    @staticmethod
    def _checked(row: LoraRow, t: torch.Tensor) -> LoraRow:
        if tuple(t.shape) != row.shape:
            raise LoraTableError(
                f"shape mismatch for {row.megatron}: expected {row.shape} ({row.factor} of {row.hf_module} "
                f"at rank {row.shape[0] if row.factor == 'lora_A' else row.shape[1]}), got {tuple(t.shape)}"
            )
        return row

    def numel(self) -> int:
        """Adapter parameters in all (every factor, full shapes)."""
        return sum(r.shape[0] * r.shape[1] for r in self._rows.values())


__all__ = ["FACTORS", "PEFT_PREFIX", "LoraRow", "LoraTable", "LoraTableError", "lora_canonical_name"]
