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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_mapped_reader_equals_safetensors_own_reader(tmp_path, dtype):
    """The mmap + frombuffer reader returns exactly what safe_open returns, for every tensor of a file
    with mixed shapes (empty and 0-d included), and writing into a tensor never reaches the file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 5), "b": (7,), "c": (0, 4), "d": (), "e": (2, 3, 4)}
    tensors = {k: (torch.randn(s, generator=g) * 10).to(dtype) for k, s in shapes.items()}
    tensors["f32"] = torch.randn(4, 4, generator=g)  # a second dtype in the same file
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = HFCheckpointReader(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        for name in tensors:
            want, have = f.get_tensor(name), reader.get(name)
            assert have.dtype == want.dtype and have.shape == want.shape, name
            assert torch.equal(have, want), name
            assert reader.shape(name) == tuple(want.shape), name
    reader.get("a").fill_(1)  # copy-on-write: the file keeps its bytes
    reader.close()
    assert torch.equal(HFCheckpointReader(tmp_path).get("a"), tensors["a"])


def test_mapped_reader_refuses_a_truncated_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64), "v": torch.ones(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-16])
    reader = HFCheckpointReader(tmp_path)
    name = max(["w", "v"], key=lambda n: reader.get_handle(n)._info(n)["data_offsets"][1])
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor {name} has data offsets .* truncated"):
        reader.get(name)
