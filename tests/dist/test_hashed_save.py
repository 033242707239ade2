"""The manifest's data-file digests are taken while megatron's forked writers write the files
(``trainer/run/hashed_save.py``), at DP 2 over gloo with megatron-core's real torch_dist save.

Checked against an independent read-back SHA-256 of every file: each rank reports exactly its own
``__<rank>_*.distcp`` files, the manifest equals a read-back manifest of the whole directory, the tensors
load back equal, and the manifest still refuses a corrupted (same size) or truncated data file. A write-time
digest whose byte count disagrees with the file on disk is dropped and the file is read back instead.
Planted: a hashing stream that misses one write's bytes is caught by the read-back comparison."""

from __future__ import annotations

import hashlib
from pathlib import Path

from srpo_megatron.testing.distributed import run_distributed


def _save(rank: int, world: int, ckpt: Path):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from srpo_megatron.compat.cpu import enable_cpu_compat
    from srpo_megatron.trainer.run.hashed_save import HashingTorchDistSave

    enable_cpu_compat()  # megatron's writer calls torch.cuda.synchronize (a no-op on CPU)
    g = torch.Generator().manual_seed(rank)
    tensors = {
        "sharded": torch.randn(3000, 64, generator=g),  # one shard per rank
        "replicated": torch.arange(20000, dtype=torch.float32),  # written once (replica 0: rank 0)
        "bf16": torch.randn(512, 256, generator=g).to(torch.bfloat16),
    }
    state = {
        "sharded": ShardedTensor.from_rank_offsets("sharded", tensors["sharded"], (0, rank, world)),
        "replicated": ShardedTensor.from_rank_offsets("replicated", tensors["replicated"], replica_id=rank),
        "bf16": ShardedTensor.from_rank_offsets("bf16", tensors["bf16"], (0, rank, world)),
    }
    if rank == 0:
        ckpt.mkdir(parents=True)
    dist.barrier()
    strategy = HashingTorchDistSave()
    dist_checkpointing.save(state, str(ckpt), sharded_strategy=strategy)
    return strategy, tensors


def _read_back(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _rank(rank: int, world: int, root: str, plant: str = "") -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from srpo_megatron.conversion.checkpoint_files import digest_files, verify_checkpoint, write_manifest
    from srpo_megatron.trainer.run import hashed_save

    if plant == "missed_write":  # a stream that lets one write's bytes reach the file unhashed
        write, seen = hashed_save._HashingStream.write, []

        def missing_one(self, b):
            if not seen:
                seen.append(1)
                self.state[1] += len(memoryview(b).cast("B"))
                return self.raw.write(b)
            return write(self, b)

        hashed_save._HashingStream.write = missing_one
    ckpt = Path(root) / "step_000001"
    strategy, tensors = _save(rank, world, ckpt)
    written = strategy.written(ckpt)
    out = {
        "written": sorted(written),
        "mismatched": sorted(n for n, d in written.items() if d != _read_back(ckpt / n)),
    }
    if plant == "wrong_size":  # a writer's count that disagrees with the file on disk: not trusted
        digests = strategy.hashing.digests
        strategy.hashing.digests = lambda: {p: (s + 1, h) for p, (s, h) in digests().items()}
        out["written_when_sizes_disagree"] = sorted(strategy.written(ckpt))
        written = strategy.written(ckpt)
    manifest = digest_files(ckpt, known=written)
    if rank == 0:
        write_manifest(ckpt, manifest)
        files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
        out["manifest_equals_read_back"] = manifest == {
            str(p.relative_to(ckpt)): _read_back(p) for p in files
        }
    dist.barrier()
    out["verifies"] = verify_checkpoint(ckpt)
    like = {
        k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), (0, rank, world))
        for k, v in tensors.items()
    }
    like["replicated"] = ShardedTensor.from_rank_offsets("replicated", torch.zeros(20000), replica_id=rank)
    loaded = dist_checkpointing.load(like, str(ckpt))
    out["loads_back"] = all(torch.equal(loaded[k], v) for k, v in tensors.items())
    dist.barrier()
    if rank == 0:  # the manifest still guards the data files: flip one byte in one, cut another short
        data = sorted(ckpt.glob("*.distcp"))
        flipped = bytearray(data[0].read_bytes())
        flipped[len(flipped) // 2] ^= 0x10
        data[0].write_bytes(bytes(flipped))
        out["flipped"] = str(data[0])
    dist.barrier()
    out["after_flip"] = verify_checkpoint(ckpt)
    if rank == 0:
        data[0].write_bytes(bytes(flipped[: len(flipped) // 2]))
    dist.barrier()
    out["after_truncation"] = verify_checkpoint(ckpt)
    return out


def test_write_time_digests_match_a_read_back_and_the_manifest_still_refuses_damage(tmp_path):
    results = run_distributed(_rank, 2, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        assert out["written"] and all(n.startswith(f"__{rank}_") for n in out["written"]), out["written"]
        assert out["mismatched"] == [], out
        assert out["verifies"] is None and out["loads_back"], out
    on_disk = sorted(p.name for p in (tmp_path / "step_000001").glob("*.distcp"))
    assert sorted(results[0]["written"] + results[1]["written"]) == on_disk  # every data file, once
    assert results[0]["manifest_equals_read_back"]
    flipped = results[0]["flipped"]
    assert results[0]["after_flip"] == f"{flipped} does not match its SHA-256 in manifest.json (corrupted)"
    assert (
        results[1]["after_truncation"].startswith(f"{flipped} has ")
        and "the manifest says" in (results[1]["after_truncation"])
    )


def test_a_write_time_count_that_disagrees_with_the_file_is_read_back_instead(tmp_path):
    results = run_distributed(_rank, 2, str(tmp_path), "wrong_size", timeout=300)
    for out in results:
        assert out["written_when_sizes_disagree"] == []
        assert out["verifies"] is None
    assert results[0]["manifest_equals_read_back"]


def test_planted_a_stream_that_misses_bytes_is_caught(tmp_path):
    results = run_distributed(_rank, 2, str(tmp_path), "missed_write", timeout=300)
    assert all(out["mismatched"] for out in results), results  # the read-back comparison sees it
    assert results[0]["verifies"] is not None  # and a manifest built from it would not verify
