"""Manifest hashing and verification split over 2 gloo ranks: each rank reads every other file, and
both ranks reach the same verdict (a disagreement would hang the next collective on a cluster)."""

from __future__ import annotations

from pathlib import Path

from srpo_megatron.testing.distributed import run_distributed


def _rank(rank: int, world: int, root: str) -> tuple:
    import torch.distributed as dist

    from srpo_megatron.conversion.checkpoint_files import (
        CheckpointError,
        digest_files,
        find_resume_checkpoint,
        verify_checkpoint,
        write_manifest,
    )

    ckpt = Path(root) / "checkpoints" / "step_000001"
    if rank == 0:
        (ckpt / "rng").mkdir(parents=True)
        for i in range(5):
            (ckpt / f"__{i}_0.distcp").write_bytes(bytes([i]) * (1000 + i))
        (ckpt / "rng" / "rank_00000.pt").write_bytes(b"r0")
    dist.barrier()
    digests = digest_files(ckpt)
    if rank == 0:
        write_manifest(ckpt, digests)
    dist.barrier()
    complete = verify_checkpoint(ckpt)
    found = find_resume_checkpoint(root, log=lambda _: None)
    dist.barrier()
    if rank == 0:  # damage a file that rank 1 checks (sorted names: rank 1 takes the odd ones)
        victim = ckpt / sorted(digests)[1]
        data = bytearray(victim.read_bytes())
        data[10] ^= 1
        victim.write_bytes(bytes(data))
    dist.barrier()
    damaged = verify_checkpoint(ckpt)
    try:
        find_resume_checkpoint(root, log=lambda _: None)
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    return len(digests), complete, str(found), damaged, refused


def test_two_ranks_hash_and_verify_alike(tmp_path):
    results = run_distributed(_rank, 2, str(tmp_path), timeout=240)
    assert results[0] == results[1]
    n, complete, found, damaged, refused = results[0]
    ckpt = tmp_path / "checkpoints" / "step_000001"
    assert n == 6 and complete is None and found == str(ckpt)
    assert damaged == f"{ckpt / '__1_0.distcp'} does not match its SHA-256 in manifest.json (corrupted)"
    assert damaged in refused and "run.restart=true" in refused
