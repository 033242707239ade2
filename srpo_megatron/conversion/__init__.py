"""HF <-> megatron-core conversion: one declarative table per architecture (``table``), streaming
safetensors I/O (``safetensors_io``), checkpoint import/export (``checkpoint``) and loading HF weights into a
rank's policy stage (``weights``)."""

from typing import Any

# The table's names load on first use, so that a torch-free reader of this package (``output_guard``'s size
# manifest, which ``srpo plan`` and ``srpo launch`` check) does not import torch through the table.
_TABLE_NAMES = (
    "ConversionError",
    "ConversionTable",
    "TPPartition",
    "canonical_name",
    "merge_tp_shards",
    "split_tp_shard",
)


def __getattr__(name: str) -> Any:
    if name in _TABLE_NAMES:
        from srpo_megatron.conversion import table

        return getattr(table, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConversionError",
    "ConversionTable",
    "TPPartition",
    "canonical_name",
    "merge_tp_shards",
    "split_tp_shard",
]
