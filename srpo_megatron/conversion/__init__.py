"""HF <-> megatron-core conversion: one declarative table per architecture (``table``), streaming
safetensors I/O (``safetensors_io``), checkpoint import/export (``checkpoint``) and loading HF weights into a
rank's policy stage (``weights``)."""

from srpo_megatron.conversion.table import (
    ConversionError,
    ConversionTable,
    TPPartition,
    canonical_name,
    merge_tp_shards,
    split_tp_shard,
)

__all__ = [
    "ConversionError",
    "ConversionTable",
    "TPPartition",
    "canonical_name",
    "merge_tp_shards",
    "split_tp_shard",
]
