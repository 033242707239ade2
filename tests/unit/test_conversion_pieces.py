"""The streaming forms of the conversion: ``to_megatron_pieces`` (the full tensor as row-major pieces, never
concatenated), spliced ``torch.save`` bytes (``torch_save_format``) and the planned safetensors writer of the
streamed export, each against the plain form it replaces, byte for byte."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from srpo_megatron.conversion.safetensors_io import PlannedSafetensorsWriter, ShardedSafetensorsWriter
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.conversion.torch_save_format import TorchSaveEnvelopes, envelope, tensor_bytes
from srpo_megatron.models.architecture import Architecture
from tests.helpers.conversion import MOE_CONFIG, arch, random_hf


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_pieces_are_the_full_tensor_row_major(model_type, tp):
    a = Architecture.from_hf(MOE_CONFIG) if model_type == "qwen3_moe" else arch(model_type)
    table = ConversionTable(a)
    hf = random_hf(table, seed=tp)
    kinds = set()
    for name in table.megatron_names():
        row = {h: hf[h] for h in table.hf_names_for(name)}
        full = table.to_megatron(name, row, tp)
        pieces = table.to_megatron_pieces(name, row, tp)
        assert all(p.is_contiguous() for p in pieces), name
        assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), full.reshape(-1)), name
        kinds.add(table.row(name).transform.name)
    assert {"identity", "fuse_qkv_grouped", "fuse_gate_up", "pad_vocab"} <= kinds


@pytest.fixture
def crc_off():
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.float32, (1,)),
        (torch.float32, (1, 1, 24, 8)),
        (torch.bfloat16, (3, 5)),
        (torch.float16, (1, 7)),
        (torch.int64, (2, 2, 2)),
        (torch.float32, (1 << 20,)),
    ],
)
def test_spliced_torch_save_bytes_equal_torch_save(crc_off, dtype, shape):
    envelopes = TorchSaveEnvelopes()
    for seed in range(2):  # two payloads, one envelope: it does not depend on the data
        g = torch.Generator().manual_seed(seed)
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
        prefix, suffix = envelopes.get(dtype, shape)
        half = t.numel() // 2  # written as two pieces, as a fused QKV or gate/up row is
        flat = t.reshape(-1)
        spliced = prefix + bytes(tensor_bytes(flat[:half])) + bytes(tensor_bytes(flat[half:])) + suffix
        assert spliced == _torch_save(t)
        assert torch.equal(torch.load(io.BytesIO(spliced), weights_only=True), t)


def test_envelope_needs_crc_off_and_a_payload():
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        with pytest.raises(RuntimeError, match="CRC32s off"):
            envelope(torch.float32, (4,))
    finally:
        torch.serialization.set_crc32_options(before)
    torch.serialization.set_crc32_options(False)
    try:
        assert envelope(torch.float32, (0, 3)) is None  # no payload to splice: callers use torch.save
    finally:
        torch.serialization.set_crc32_options(before)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("max_shard", [10**9, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_writer_writes_the_sharded_writers_files(tmp_path, max_shard, dtype):
    g = torch.Generator().manual_seed(0)
    # Names out of sort order ("layers.10" < "layers.2"), sizes that cut shards unevenly.
    shapes = [("model.layers.2.w", (7, 5)), ("model.layers.10.w", (3,)), ("lm_head.weight", (11, 4))]
    shapes += [(f"model.layers.{i}.mlp.experts.{e}.w", (4, 3)) for i in (0, 1) for e in range(3)]
    tensors = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes}
    ref, got = tmp_path / "ref", tmp_path / "got"
    ref.mkdir(), got.mkdir()
    sharded = ShardedSafetensorsWriter(ref, max_shard)
    for n, t in tensors.items():
        sharded.add(n, t)
    sharded.close()
    planned = PlannedSafetensorsWriter(got, shapes, dtype, max_shard)
    for n in reversed(list(tensors)):  # any order
        planned.write(n, tensors[n])
    planned.close()
    assert _files(got) == _files(ref)
    assert (len(_files(ref)) > 2) == (max_shard == 300)  # the small bound shards (with an index)


def test_planned_writer_refuses_what_the_plan_does_not_say(tmp_path):
    plan = [("a", (2,)), ("b", (3,))]
    w = PlannedSafetensorsWriter(tmp_path, plan, torch.float32)
    with pytest.raises(ValueError, match="not in the plan"):
        w.write("c", torch.zeros(2))
    with pytest.raises(ValueError, match=r"planned \(2,\)"):
        w.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="planned"):
        w.write("a", torch.zeros(2, dtype=torch.float16))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="written twice"):
        w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match=r"never written: \['b'\]"):
        w.close()


@pytest.mark.parametrize("short", [False, True])
def test_data_file_gathers_items_in_order(tmp_path, monkeypatch, short):
    """The data file's staged writes (items copied into small aligned buffers, written by a thread) put
    every item at the offset it reports, also when the kernel writes only part of a buffer."""
    from srpo_megatron.conversion import stream_writer, write_behind

    monkeypatch.setattr(stream_writer._DataFile, "_BUFFER", 2 * write_behind.ALIGN)  # items span buffers
    if short:  # the kernel may stop a write early (signals, a full device): here one block at a time
        real_pwrite = write_behind.os.pwrite

        def short_pwrite(fd, data, offset):
            return real_pwrite(fd, memoryview(data)[: write_behind.ALIGN], offset)

        monkeypatch.setattr(write_behind.os, "pwrite", short_pwrite)
    g = torch.Generator().manual_seed(0)
    torch.serialization.set_crc32_options(False)
    try:
        items, path = [], tmp_path / "data.distcp"
        with stream_writer._DataFile(path) as f:
            for i in range(40):
                t = torch.randn(1 + i % 7, 3 + i % 5, generator=g)
                pieces = [t.reshape(-1)[:5], t.reshape(-1)[5:]] if i % 3 else [t]
                items.append((t, f.put_tensor(t.dtype, t.shape, pieces)))
                if i % 10 == 0:
                    items.append((None, f.put_object(None)))
    finally:
        torch.serialization.set_crc32_options(True)
    raw = path.read_bytes()
    assert len(raw) == items[-1][1].offset + items[-1][1].length
    for want, info in items:
        got = torch.load(io.BytesIO(raw[info.offset : info.offset + info.length]), weights_only=False)
        if want is None:
            assert got == [None]
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("crc_on", [False, True])
def test_dist_reader_reads_spliced_chunks_without_torch_load(tmp_path, monkeypatch, crc_on):
    """Chunks the stream writer spliced (CRC32s off) are read straight into the tensor, no torch.load;
    chunks torch.save wrote with CRC32s on (as megatron's own save does) do not match the envelope and
    go through torch.load. Both read back exactly."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from srpo_megatron.conversion import dist_reader, stream_writer

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(5, 3, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 3, 4, generator=g).to(torch.float16),
    }
    sharded = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}
    # common state as a ShardedObject (0.19's layout): common.pt would need a process group here
    monkeypatch.setattr(stream_writer, "save_writes_common_pt", lambda: False)
    if crc_on:  # every item through torch.save itself, CRCs left on
        monkeypatch.setattr(stream_writer.TorchSaveEnvelopes, "get", lambda self, dtype, shape: None)
        monkeypatch.setattr(stream_writer.torch.serialization, "set_crc32_options", lambda on: None)
    stream_writer.write_streamed_checkpoint(tmp_path, sharded, {}, lambda group: [sh.data for sh in group])
    monkeypatch.undo()
    loads = []
    real_load = torch.load
    monkeypatch.setattr(dist_reader.torch, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    reader = dist_reader.TorchDistReader(tmp_path)
    for k, t in tensors.items():
        got = reader.read(k, (0,) * t.dim(), tuple(t.shape))
        assert got.dtype == t.dtype and torch.equal(got, t), k
    reader.close()
    assert len(loads) == (len(tensors) if crc_on else 0)


def test_planned_writer_with_per_tensor_dtypes_writes_save_files_bytes(tmp_path):
    """A bf16 export keeps the fp32 expert biases: mixed dtypes laid out as safetensors' save_file does."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "b.e_score_correction_bias": torch.randn(5, generator=g),
        "c.weight": torch.randn(2, generator=g).to(torch.bfloat16),
        "d.e_score_correction_bias": torch.randn(3, generator=g),
    }
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    out = tmp_path / "got"
    out.mkdir()
    fp32 = {n: torch.float32 for n in tensors if n.endswith("bias")}
    w = PlannedSafetensorsWriter(
        out, [(n, tuple(t.shape)) for n, t in tensors.items()], torch.bfloat16, dtypes=fp32
    )
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
