"""The checkpoint file names and shapes of a model folder, from its conversion table: what every weight
receiver (the SGLang engine, the disk and broadcast syncs) validates a stream against."""

from __future__ import annotations

from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture


def hf_manifest(model_path: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint FILE names and shapes of the served model (per-expert for MoE), from the conversion
    table: every tensor a full sync sends, what SGLang's ``load_weights`` expects and what every weight
    receiver validates against. Not transformers' in-memory
    names, which differ from the files for fused modules (transformers >= 5 fuses MoE experts into
    ``mlp.experts.gate_up_proj`` / ``down_proj``)."""
    table = ConversionTable(Architecture.from_hf(model_path))
    return dict(table.hf_file_plan())  # gpt-oss: its fused expert tensors whole, as the files hold them
