"""The trainer's export stream in miniature, from an HF checkpoint: one ``PendingParam`` per megatron
parameter in table order, the expert parameters as ``weights.export`` yields them at EP ``ep`` (local
expert ``j``'s fetch returns the slices of global experts ``j, j + E/ep, ...``, EP rank order)."""

from __future__ import annotations

import torch

from srpo_megatron.buckets import PendingParam, TensorSpec
from srpo_megatron.conversion.table import ConversionTable


def _pending(name: str, pairs: list[tuple[str, torch.Tensor]]) -> PendingParam:
    specs = tuple(TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in pairs)
    return PendingParam(name, sum(s.nbytes for s in specs), lambda: [(n, t.clone()) for n, t in pairs], specs)


def _model_order(table: ConversionTable):
    """Model order (megatron's ``named_parameters``): embedding, then layer by layer (a layer's experts
    last, expert by expert: fc1 weight, bias, fc2 weight, bias), then the final norm and the output."""
    index = {n: i for i, n in enumerate(table.megatron_names())}

    def key(name: str) -> tuple:
        if not name.startswith("decoder.layers."):
            return (-1 if "embedding" in name else 1 << 30, 0, 0, index[name])
        layer = int(name.split(".")[2])
        if ".local_experts." in name:
            return (layer, 1, int(name.split(".local_experts.")[1].split(".")[0]), index[name])
        return (layer, 0, 0, index[name])

    return key


def export_stream(table: ConversionTable, files: dict[str, torch.Tensor], ep: int = 1) -> list[PendingParam]:
    def full(name: str) -> torch.Tensor:
        hf = {h: table.hf_tensor(h, files.__getitem__) for h in table.hf_names_for(name)}
        return table.to_megatron(name, hf)

    per_rank = table.arch.num_experts // ep
    out = []
    for name in sorted(table.megatron_names(), key=_model_order(table)):
        if ".local_experts." not in name:
            out.append(_pending(name, table.to_hf(name, full(name))))
            continue
        prefix, rest = name.split(".local_experts.")
        j, suffix = rest.split(".", 1)
        if int(j) >= per_rank:
            continue  # another EP rank's local expert: gathered with local index j % per_rank
        names = [f"{prefix}.local_experts.{int(j) + r * per_rank}.{suffix}" for r in range(ep)]
        out.append(_pending(name, [p for n in names for p in table.to_hf(n, full(n))]))
    return out
