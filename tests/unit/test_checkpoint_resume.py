"""Which checkpoint a run resumes from, and what a checkpoint file may contain.

Checkpoint directories here are plain files with a manifest written by the trainer's own functions
(``digest_files`` + ``write_manifest``); the scenarios are the ways a run directory breaks: ``latest``
deleted, ``latest`` naming a truncated checkpoint, a corrupted shard of the same size, leftovers of an
interrupted save, and a crafted pickle in an RNG file. None of them may start from step 0 silently.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from srpo_megatron.config import ConfigError
from srpo_megatron.conversion.checkpoint_files import (
    CheckpointError,
    clean_temporaries,
    digest_files,
    find_resume_checkpoint,
    list_files,
    prune_in_background,
    verify_checkpoint,
    wait_for_pruning,
    write_manifest,
)
from srpo_megatron.conversion.spec_compat import drop_absent_extra_state
from srpo_megatron.trainer.run.resume import MAY_CHANGE_ON_RESUME, check_resume_recipe, recipe_changes
from srpo_megatron.trainer.run.rng_state import rng_states_compatible


def _save(run: Path, step: int, latest: bool = True) -> Path:
    """A checkpoint directory as save_checkpoint lays it out (shards, state, RNG), manifest last."""
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    (ckpt / "rng").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(4096))
    (ckpt / ".metadata").write_bytes(b"metadata" * 10)
    (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')
    torch.save({"torch": torch.get_rng_state()}, ckpt / "rng" / "rank_00000.pt")
    write_manifest(ckpt, digest_files(ckpt, list_files(ckpt)))
    if latest:
        (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    return ckpt


def _find(run: Path, **kw) -> tuple[Path | None, list[str]]:
    lines: list[str] = []
    return find_resume_checkpoint(run, log=lines.append, **kw), lines


def test_fresh_run_starts_at_step_0(tmp_path):
    assert _find(tmp_path) == (None, [])
    (tmp_path / "checkpoints").mkdir()
    assert _find(tmp_path) == (None, [])


def test_latest_deleted_resumes_from_newest_complete(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (tmp_path / "checkpoints" / "latest").unlink()
    found, lines = _find(tmp_path)
    assert found == newest
    assert "latest is missing; resuming from" in lines[0] and newest.name in lines[0]


def test_latest_naming_a_truncated_checkpoint_falls_back(tmp_path):
    older = _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    found, lines = _find(tmp_path)
    assert found == older
    assert any(str(shard) in line and "bytes" in line for line in lines), lines


def test_corrupted_shard_of_same_size_falls_back(tmp_path):
    older = _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(newest) == f"{shard} does not match its SHA-256 in manifest.json (corrupted)"
    assert _find(tmp_path)[0] == older


@pytest.mark.parametrize("damage", ["manifest", "extra_file", "missing_rng"])
def test_incomplete_checkpoints_are_not_used(tmp_path, damage):
    older = _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    if damage == "manifest":
        (newest / "manifest.json").unlink()  # the save died before its last file
    elif damage == "extra_file":
        (newest / "__1_0.distcp").write_bytes(b"x")
    else:
        (newest / "rng" / "rank_00000.pt").unlink()
    assert verify_checkpoint(newest) is not None
    assert _find(tmp_path)[0] == older


def test_pruning_runs_after_the_save_returns_and_is_waited_for(tmp_path, monkeypatch):
    """A save hands the deletion of checkpoints past keep_last to a thread; wait_for_pruning (called by
    the next save, the disk-space check and the end of train) returns only once they are gone."""
    import threading

    from srpo_megatron.conversion import checkpoint_files

    old = [_save(tmp_path, 1), _save(tmp_path, 2)]
    newest = _save(tmp_path, 3)
    gate, remove = threading.Event(), checkpoint_files._remove
    monkeypatch.setattr(checkpoint_files, "_remove", lambda dirs: (gate.wait(10), remove(dirs)))
    prune_in_background(old)
    assert all(d.is_dir() for d in old)  # the caller is not held up by the deletion
    gate.set()
    wait_for_pruning()
    assert not any(d.exists() for d in old) and verify_checkpoint(newest) is None
    assert _find(tmp_path)[0] == newest


def test_nothing_complete_refuses_with_paths_unless_restart(tmp_path):
    ckpt = _save(tmp_path, 1)
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        _find(tmp_path)
    msg = str(err.value)
    assert str(ckpt / "trainer_state.json") in msg and "run.restart=true" in msg and "\n" not in msg
    found, lines = _find(tmp_path, restart=True)
    assert found is None and "moved the existing checkpoints" in lines[0]
    assert not (tmp_path / "checkpoints").exists()
    assert len(list(tmp_path.glob("checkpoints.replaced-*/step_000001"))) == 1  # kept, not deleted


def test_latest_naming_a_missing_checkpoint_refuses(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000007\n")
    with pytest.raises(CheckpointError, match="names 'step_000007', which does not exist"):
        _find(tmp_path)


def test_leftover_temporaries_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_000003.tmp" / "rng").mkdir(parents=True)
    (root / "latest.tmp").write_text("step_000003\n")
    keep = _save(tmp_path, 2)
    clean_temporaries(root, log=lambda _: None)
    assert sorted(p.name for p in root.iterdir()) == ["latest", keep.name]


# ---- trust: RNG files are tensors, never pickled objects -------------------------------------------------


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickle_in_rng_file_is_refused_not_executed(tmp_path):
    from srpo_megatron.trainer.run.rng_state import load_rng_file

    marker = tmp_path / "PWNED"
    evil = tmp_path / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state(), "x": _Exploit(marker)}, evil)
    with pytest.raises(CheckpointError, match=r"refusing to unpickle it.*trusted source"):
        load_rng_file(evil)
    assert not marker.exists()
    with open(evil, "wb") as f:  # a bare pickle (not torch's zip format) is refused too
        pickle.dump(_Exploit(marker), f)
    with pytest.raises(CheckpointError):
        load_rng_file(evil)
    assert not marker.exists()


def test_rng_state_round_trips_through_weights_only(tmp_path):
    from srpo_megatron.trainer.run.rng_state import load_rng_file, rng_state, set_rng_state

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # leave a cached Gaussian in numpy's state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expect = (random.random(), np.random.standard_normal(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(load_rng_file(tmp_path / "rng.pt"))
    got = (random.random(), np.random.standard_normal(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])


# ---- checkpoints across layer specs and device kinds ------------------------------------------------


def test_drop_absent_extra_state_drops_only_te_extra_state():
    @dataclasses.dataclass
    class Item:
        key: str

    sharded = {
        "decoder.layers.0.self_attention.linear_qkv.weight": Item(
            "decoder.layers.self_attention.linear_qkv.weight"
        ),
        "decoder.layers.0.self_attention.core_attention._extra_state": Item(
            "decoder.layers.self_attention.core_attention._extra_state"
        ),
    }
    stored = {"decoder.layers.self_attention.linear_qkv.weight"}
    dropped = drop_absent_extra_state(sharded, stored, "ckpt")
    assert dropped == ["decoder.layers.self_attention.core_attention._extra_state"]
    assert list(sharded) == ["decoder.layers.0.self_attention.linear_qkv.weight"]
    with pytest.raises(ValueError, match=r"ckpt lacks 1 tensor.*linear_qkv.weight"):
        drop_absent_extra_state(sharded, set(), "ckpt")


def test_rng_states_from_the_other_device_kind_are_refused_with_the_cause():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rng_states_compatible("cpu", "rank_00000.pt")
        assert rng_states_compatible(None, "rank_00000.pt")  # files from before the field existed
    with pytest.warns(UserWarning, match=r"saved on cuda and this run is on cpu.*reseeded from run.seed"):
        assert not rng_states_compatible("cuda", "rank_00000.pt")


# ---- recipe changes on resume ------------------------------------------------------------------------


def test_recipe_change_table():
    saved = {"train": {"steps": 10, "mini_batches": 1}, "optim": {"lr": 1e-3}, "eval": {"every_n_steps": 5}}
    now = {"train": {"steps": 20, "mini_batches": 1}, "optim": {"lr": 0.5}, "eval": {"every_n_steps": 2}}
    applied, refused = recipe_changes(saved, now)
    assert applied == ["eval.every_n_steps: 5 -> 2", "train.steps: 10 -> 20"]
    assert refused == ["optim.lr: 0.001 -> 0.5"]
    # requests in flight per engine: throughput only, the same samples
    sglang = recipe_changes(
        {"rollout": {"sglang": {"concurrent_requests": 512}}},
        {"rollout": {"sglang": {"concurrent_requests": 8}}},
    )
    assert sglang == (["rollout.sglang.concurrent_requests: 512 -> 8"], [])
    for key in ("model.hf_dir", "loss.mode", "optim.adam_beta1", "data.train_files", "run.seed"):
        assert not any(key == pattern for pattern in MAY_CHANGE_ON_RESUME), key


def test_changed_lr_on_resume_is_refused_with_one_line(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Optim:
        lr: float = 0.5

    @dataclass
    class Cfg:
        optim: Optim

    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"optim": {"lr": 1e-3}}))
    with pytest.raises(ConfigError) as err:
        check_resume_recipe(Cfg(Optim()), tmp_path)
    msg = str(err.value)
    assert "optim.lr: 0.001 -> 0.5 cannot change on resume" in msg and "\n" not in msg
    assert check_resume_recipe(Cfg(Optim(lr=1e-3)), tmp_path) == []


def test_conversion_removes_temporaries_of_dead_conversions_only(tmp_path):
    from srpo_megatron.conversion.checkpoint import atomic_output_dir

    out = tmp_path / "model-mcore"
    dead = tmp_path / ".model-mcore.tmp-999999999"  # above pid_max: that process cannot exist
    live = tmp_path / f".model-mcore.tmp-{os.getppid()}"  # a running process (another conversion)
    other = tmp_path / ".other.tmp-999999999"  # another output's: not ours to judge
    for d in (dead, live, other):
        d.mkdir()
    with atomic_output_dir(out, force=False) as tmp:
        (tmp / "x").write_text("1")
    assert (out / "x").read_text() == "1"
    assert not dead.exists() and live.exists() and other.exists()
