"""Prompt data: rows from JSONL/Parquet or the synthetic arithmetic task, chat templating, sampling."""

from srpo_megatron.data.dataset import DatasetStats, EpochSampler, Prompt, PromptDataset, build_datasets
from srpo_megatron.data.paths import default_data_dir, resolve_data_path
from srpo_megatron.data.rows import DataError, Row, load_rows

__all__ = [
    "DataError",
    "DatasetStats",
    "EpochSampler",
    "Prompt",
    "PromptDataset",
    "Row",
    "build_datasets",
    "default_data_dir",
    "load_rows",
    "resolve_data_path",
]
