"""Streaming safetensors reader/writer: sizes, sharding with an index, single-file output."""

from __future__ import annotations

import json

import pytest
import torch

from srpo_megatron.conversion.safetensors_io import (
    INDEX_NAME,
    HFCheckpointReader,
    ShardedSafetensorsWriter,
    parse_size,
)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size("2048") == 2048
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("five gigs")


def test_sharded_write_and_streaming_read(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=100)  # 2 tensors per shard
    for k, v in tensors.items():
        writer.add(k, v)
    writer.close()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 200
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    assert index["weight_map"]["t0"] == index["weight_map"]["t1"] != index["weight_map"]["t2"]
    assert not list(tmp_path.glob("*.tmp"))
    reader = HFCheckpointReader(tmp_path)
    assert sorted(reader.names()) == sorted(tensors)
    assert reader.shape("t3") == (10,)
    for k, v in tensors.items():
        assert torch.equal(reader.get(k), v)


def test_single_shard_is_model_safetensors(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path)
    writer.add("w", torch.ones(2, 3, dtype=torch.bfloat16))
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert HFCheckpointReader(tmp_path).dtype() == torch.bfloat16


def test_reader_names_the_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        HFCheckpointReader(tmp_path)
