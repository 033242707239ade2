"""The file side of training checkpoints: manifest, fsync, verification and which checkpoint to read.

A checkpoint directory is complete when its ``manifest.json`` — every other file with its size and
SHA-256, written last — matches the files on disk. ``latest`` is only a hint: without it, or when it
names a checkpoint that does not verify, the run resumes from the newest checkpoint that verifies, and
says so. When checkpoints exist but none verifies, resuming is refused with every path and its problem
named (``--override run.restart=true`` moves them aside and starts over, once per run directory:
``find_resume_checkpoint``). Export and ``srpo eval`` pick and verify the checkpoint they read with the same
functions (``checkpoint_to_read``), so no reader loads what ``srpo train`` would refuse.

Everything here is independent of what the trainer state holds: only files, sizes and digests.

Hashing and verifying are spread over the ranks, so on 32 GPUs a checkpoint is read once in total, not once
per rank; the per-rank results travel as Python objects. A save reads back only its small files: each
rank's dist_checkpointing data files are hashed while that rank writes them (``trainer/run/hashed_save.py``).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from srpo_megatron.durable_io import fsync_file, write_text_durably

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the path, the problem and the fix."""


# ---- manifest ----------------------------------------------------------------------------------------


def _gather(obj):
    """Every rank's ``obj`` in rank order (just ``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist  # here, so that `srpo --help` does not import torch

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def list_files(ckpt: Path) -> list[str]:
    """Files under ``ckpt`` (relative, sorted), the manifest itself excluded."""
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_digest(path: Path, chunk: int = 1 << 20) -> dict:
    """``{"size": bytes, "sha256": hex}`` of one file (read into one reused buffer)."""
    h, buf = hashlib.sha256(), bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _split_by_size(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Names per rank, largest first to the least-loaded rank (the same split on every rank)."""
    load, parts = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = load.index(min(load))
        parts[r].append(name)
        load[r] += sizes[name]
    return parts


def digest_files(
    ckpt: Path, names: Iterable[str] | None = None, known: dict[str, dict] | None = None
) -> dict[str, dict]:
    """Collective: ``{name: {"size", "sha256"}}`` of ``names`` (default: rank 0's listing of ``ckpt``).

    ``known``: this rank's files already hashed while it wrote them (``trainer/run/hashed_save.py``);
    each rank fsyncs those. Every other file is fsynced and hashed by one rank, the files split by size.
    Rank 0 lists (with sizes) once for all, so ranks whose filesystem view lags still split alike."""
    rank, world = _rank_world()
    known = known or {}
    for name in known:
        fsync_file(ckpt / name)
    if names is None and rank == 0:
        names = list_files(ckpt)
    listing = None
    if rank == 0:
        listing = {n: (ckpt / n).stat().st_size if (ckpt / n).is_file() else 0 for n in names}
    shared = _gather((listing, sorted(known)))
    sizes = dict(shared[0][0])
    done = {n for _, theirs in shared for n in theirs}
    todo = {n: s for n, s in sizes.items() if n not in done}
    mine = dict(known)
    for name in _split_by_size(todo, world)[rank]:
        fsync_file(ckpt / name)
        mine[name] = file_digest(ckpt / name)
    merged: dict[str, dict] = {}
    for part in _gather(mine):
        merged.update(part)
    return merged


def write_manifest(ckpt: Path, digests: dict[str, dict]) -> None:
    """Write ``manifest.json`` (last file of a checkpoint) durably."""
    body = {"format": 1, "files": dict(sorted(digests.items()))}
    write_text_durably(ckpt / MANIFEST, json.dumps(body, indent=1) + "\n")


def _problems(ckpt: Path, files: dict[str, dict], names: list[str]) -> list[str]:
    out = []
    for name in names:
        path, want = ckpt / name, files[name]
        if not path.is_file():
            out.append(f"{path} is missing")
        elif path.stat().st_size != want["size"]:
            out.append(f"{path} has {path.stat().st_size} bytes, the manifest says {want['size']}")
        elif file_digest(path)["sha256"] != want["sha256"]:
            out.append(f"{path} does not match its SHA-256 in {MANIFEST} (corrupted)")
    return out


def verify_checkpoint(ckpt: Path) -> str | None:
    """Collective: None when every file of ``ckpt`` matches its manifest, else the first problem."""
    rank, world = _rank_world()
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        problem = f"{ckpt / MANIFEST} is missing (the save did not complete)"
        return _gather(problem)[0]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return _gather(f"{ckpt / MANIFEST} is not a valid manifest")[0]
    mine = _problems(ckpt, files, sorted(files)[rank::world])
    if rank == 0:  # one rank lists the directory, so every rank reaches the same verdict
        extra = sorted(set(list_files(ckpt)) - set(files))
        if extra:  # a file the manifest does not know (e.g. a shard of another save): not the saved set
            mine.append(f"{ckpt / extra[0]} is not listed in {MANIFEST}")
    found = [p for part in _gather(mine) for p in part]
    return found[0] if found else None


# ---- which checkpoint to resume ----------------------------------------------------------------------


def step_dirs(root: Path) -> list[Path]:
    """``step_N`` directories under ``root`` (temporaries excluded), newest first."""
    found = [p for p in root.glob("step_*") if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


_pruning: list[threading.Thread] = []


def prune_in_background(old: list[Path]) -> None:
    """Delete ``old`` (checkpoints past ``keep_last``, once the new one is published) in a thread, so a
    save returns without waiting for the unlinks (rank 0). Every later save, the disk-space check before
    it and the end of ``train`` wait for it first; a non-daemon thread, so the interpreter waits at exit.
    A crash midway leaves a partial ``step_N`` that never verifies (readers take the newest that does);
    the next prune removes it."""
    wait_for_pruning()
    if old:
        thread = threading.Thread(target=_remove, args=(old,), name="srpo-checkpoint-prune")
        thread.start()
        _pruning.append(thread)


def _remove(old: list[Path]) -> None:
    for path in old:
        shutil.rmtree(path, ignore_errors=True)


def wait_for_pruning() -> None:
    """Block until the checkpoints a save started deleting are gone (no-op when none is)."""
    while _pruning:
        _pruning.pop().join()


def clean_temporaries(root: Path, log: Callable[[str], None] = print) -> None:
    """Remove what an interrupted save left (``step_N.tmp``, ``latest.tmp``); rank 0 only."""
    for leftover in sorted(root.glob("*.tmp")):
        log(f"removing {leftover}, left by an interrupted checkpoint save")
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()


def newest_complete(
    root: Path, log: Callable[[str], None] = print, verb: str = "resuming from"
) -> tuple[Path | None, list[str]]:
    """Collective: ``(the newest step_N under root that verifies, the problems of the newer ones)``.

    The one selection every reader uses (train's resume, export, ``srpo eval``): only ``step_N``
    directories of ``root`` are candidates, so a ``latest`` naming ``../x`` or garbage is never followed;
    ``latest`` is a hint whose disagreement is logged."""
    pointer = root / LATEST
    hint, said = latest_hint(pointer)
    problems = []
    for ckpt in step_dirs(root):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            if hint != ckpt.name:
                log(f"{said}; {verb} {ckpt}, the newest checkpoint that verifies")
            for p in problems:
                log(f"skipped: {p}")
            return ckpt, problems
        problems.append(problem)
    if not problems and (pointer.exists() or pointer.is_symlink()):
        where = "which does not exist as a step_N of" if hint else "and there is no step_N checkpoint in"
        problems.append(f"{said}, {where} {root}")
    return None, problems


def latest_hint(pointer: Path) -> tuple[str | None, str]:
    """``(the step_N name latest holds or None, a line saying what it is)``: missing, a directory, a
    checkpoint name, or bytes that are none (counted, never echoed: they may be anything)."""
    if not (pointer.exists() or pointer.is_symlink()):
        return None, f"{pointer} is missing"
    if pointer.is_dir():
        return None, f"{pointer} is a directory, not the file naming the newest checkpoint"
    try:
        raw = pointer.read_bytes()
    except OSError as e:
        return None, f"{pointer} cannot be read ({e.strerror or type(e).__name__})"
    name = raw.decode("ascii", errors="replace").strip()
    if _STEP_DIR.fullmatch(name):
        return name, f"{pointer} names {name!r}"
    return None, f"{pointer} holds {len(raw)} bytes that are not a checkpoint name (step_N; not shown)"


def find_resume_checkpoint(
    run_dir: str | Path, restart: bool = False, log: Callable[[str], None] = print, keep_last: int = 2
) -> Path | None:
    """Collective: the newest checkpoint of ``run_dir`` that verifies, or None to start from step 0.

    ``latest`` names the expected one; a missing or broken ``latest`` falls back to the newest complete
    checkpoint (logged). Checkpoints that exist but do not verify refuse the start (CheckpointError).

    ``restart`` acts once per run directory: the first start with it moves ``checkpoints/`` aside (rank 0;
    only the newest ``keep_last`` moved-aside folders are kept) and records that in ``RESTART_RECORD``;
    every later start with it (a Slurm requeue, the same command again) resumes like any start.
    """
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    rank, _ = _rank_world()
    record = run_dir / RESTART_RECORD
    if restart:
        done = _gather(_read_record(record) if rank == 0 else None)[0]
        if done is None:
            _gather(None)  # every rank has looked before rank 0 may move anything
            if rank == 0:
                _restart(run_dir, keep_last, log)
            _gather(None)  # everyone waits for the move
            return None
        log(
            f"run.restart=true already acted on this run.dir ({record}, {done}); resuming instead "
            f"(delete {record} to start over once more)"
        )
    if not root.is_dir():
        return None
    if (root / LATEST).is_dir():  # every save replaces latest with a file: the first save would fail
        raise CheckpointError(
            f"{root / LATEST} is a directory, not the file naming the newest checkpoint; each save replaces "
            f"it with that file, so the run would fail at its first save: move it out of {root}"
        )
    ckpt, problems = newest_complete(root, log)
    if ckpt is not None:
        return ckpt
    if problems:
        again = (
            f"delete {record}, then pass --override run.restart=true"
            if record.is_file()
            else "pass --override run.restart=true"
        )
        raise CheckpointError(
            f"cannot resume {run_dir}: no complete checkpoint ({'; '.join(problems)}); restore the files, or "
            f"{again} to move checkpoints/ aside and train from step 0"
        )
    return None


RESTART_RECORD = "restart_done.json"
_ASIDE = "checkpoints.replaced-"


def _read_record(record: Path) -> str | None:
    """What ``RESTART_RECORD`` says (its text, shortened), or None when there is none."""
    if not record.exists():
        return None
    return " ".join(record.read_text(errors="replace").split())[:200] or "empty"


def _restart(run_dir: Path, keep_last: int, log: Callable[[str], None]) -> None:
    """rank 0: move ``checkpoints/`` aside (if any), record the restart, prune old moved-aside folders."""
    root = run_dir / "checkpoints"
    aside = None
    if root.is_dir() and any(root.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = run_dir / f"{_ASIDE}{stamp}"
        n = 1
        while aside.exists():
            n += 1
            aside = run_dir / f"{_ASIDE}{stamp}-{n}"
        root.rename(aside)
        log(f"run.restart=true: moved the existing checkpoints to {aside}; starting from step 0")
    run_dir.mkdir(parents=True, exist_ok=True)
    body = {"restarted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "moved_aside": aside and str(aside)}
    write_text_durably(run_dir / RESTART_RECORD, json.dumps(body) + "\n")
    log(
        f"run.restart=true: recorded in {run_dir / RESTART_RECORD}; a later start with the flag resumes "
        "(delete that file to start over again)"
    )
    for old in sorted(p for p in run_dir.glob(f"{_ASIDE}*") if p.is_dir())[:-keep_last]:
        log(f"removing {old}: run.keep_last={keep_last} moved-aside checkpoint folders are kept")
        shutil.rmtree(old, ignore_errors=True)


def is_trainer_checkpoint(path: Path) -> bool:
    """A ``step_N`` directory the trainer wrote (it has, or should have, a manifest)."""
    return (path / MANIFEST).is_file() or (path / "trainer_state.json").is_file()


def checkpoint_to_read(path: str | Path, log: Callable[[str], None] = print) -> Path:
    """Collective: the checkpoint export and ``srpo eval`` read when given ``path``, by train's policy.

    A run directory, its ``checkpoints/`` folder or its ``latest`` file: the newest checkpoint that
    verifies (:func:`newest_complete`). A trainer checkpoint: itself, once it matches its manifest. Anything
    else (a converter output, an HF folder) is returned as it is. Refusals are CheckpointError (one line).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: pass a run directory, a checkpoint or an HF folder")
    root = None
    if path.is_file() and path.name == LATEST:
        root = path.parent
    elif (path / "checkpoints").is_dir():
        root = path / "checkpoints"
    elif path.is_dir() and ((path / LATEST).exists() or step_dirs(path)):
        root = path
    if root is not None:
        ckpt, problems = newest_complete(root, log, "reading")
        if ckpt is None:
            listed = "; ".join(problems) or "it holds no step_N checkpoint"
            raise CheckpointError(
                f"{path}: no complete checkpoint in {root} ({listed}); restore the files or pass another run"
            )
        return ckpt
    if path.is_dir() and is_trainer_checkpoint(path):
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(
                f"{path} cannot be read: {problem}; restore the file, or pass the run directory to read "
                "its newest checkpoint that verifies"
            )
    return path
