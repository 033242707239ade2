"""A checkpoint save that fails says why in one line, and a save that keeps failing stops the job.

:func:`guarded_save` wraps ``save_checkpoint`` (collective):

- before the save, global rank 0 compares the free space of ``<run.dir>/checkpoints`` with the size of
  the previous checkpoint (the new one is about as large, and the old one is pruned only after the new
  one is complete) and refuses with the path and both sizes;
- a save that fails with no space left (ENOSPC or EDQUOT anywhere in the exception chain, or torch's
  bare ``inline_container.cc`` write failure on a filesystem left with no free space) becomes one line
  naming the path; its half-written ``step_N.tmp`` is removed (the previous checkpoint stays);
- every failure is recorded in ``<run.dir>/.save_failure.json`` (step, path, message, bytes needed, how
  many times in a row); a successful save removes it. The next ``srpo train`` on the run refuses to start
  (:func:`save_failure_problem`, before torch loads) while the disk still has less room than the failed
  save needed (or, for a failure of another kind, once the same save failed twice in a row), until the
  space is there or the record is removed: a requeued job does not re-train the step to fail again.

Errors are :class:`~srpo_megatron.conversion.checkpoint_files.CheckpointError` (one line, exit status 2).
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from srpo_megatron.conversion.checkpoint_files import MANIFEST, CheckpointError, step_dirs, wait_for_pruning

FAILURE_FILE = ".save_failure.json"
STOP_AFTER = 2  # failures of the same save in a row (not for want of space) that refuse a new start
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL = 64 << 20  # free bytes under which a bare write failure is taken for a full disk


def checkpoint_bytes(ckpt: Path) -> int:
    """Bytes of checkpoint ``ckpt``: its manifest's sizes (no walk), else the files on disk."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        return int(sum(f["size"] for f in files.values())) + (ckpt / MANIFEST).stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())


def space_problem(root: Path, step: int, keep_last: int = 1) -> tuple[str, int] | None:
    """``(why, bytes needed)`` when ``root`` has less free space than the previous checkpoint takes.

    What ``why`` suggests is always something the run accepts: the older checkpoints may be deleted (a
    resume needs only the newest), and ``run.keep_last=1`` only when the run keeps more than one (lower
    values are refused, and retention deletes only after a save completes, so it frees nothing now)."""
    dirs = step_dirs(root) if root.is_dir() else []
    previous = next(iter(dirs), None)
    if previous is None:
        return None
    needed, free = checkpoint_bytes(previous), shutil.disk_usage(root).free
    if free >= needed:
        return None
    older = [d.name for d in dirs[1:]]
    hint = f" (a resume needs only {previous.name}; {', '.join(older)} may be deleted)" if older else ""
    keep = "; run.keep_last=1 keeps only the newest checkpoint from then on" if keep_last > 1 else ""
    why = (
        f"not saving checkpoint step {step}: {root} has {free} bytes free, the previous checkpoint "
        f"{previous} takes {needed} bytes; free space there{hint} and rerun{keep}"
    )
    return why, needed


def _no_space(error: BaseException, root: Path) -> bool:
    """Whether ``error`` (or its causes) means the disk is full."""
    seen: BaseException | None = error
    text = []
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return True
        text.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    joined = " ".join(text)
    if "No space left" in joined or "Disk quota exceeded" in joined:
        return True
    # torch's zip writer names neither errno nor path ("[enforce fail at inline_container.cc:...] ...
    # file write failed"): a write failure on a filesystem with (almost) nothing left is a full disk
    if "write failed" not in joined and "inline_container" not in joined:
        return False
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return False
    return usage.free < NEARLY_FULL


def _record(run_dir: Path, step: int, message: str, needed: int | None) -> int:
    """Count this failure in the record (same step: one more in a row); return the count."""
    path = run_dir / FAILURE_FILE
    old = read_failure(run_dir)
    count = old["count"] + 1 if old and old.get("step") == step else 1
    body = {"step": step, "count": count, "needed_bytes": needed, "path": str(run_dir), "error": message}
    with contextlib.suppress(OSError):  # a full disk may refuse even this: the error is raised anyway
        path.write_text(json.dumps(body, indent=1) + "\n")
    return count


def read_failure(run_dir: Path) -> dict[str, Any] | None:
    """The recorded save failure of ``run_dir``, or None."""
    try:
        body = json.loads((Path(run_dir) / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("count"), int) else None


def save_failure_problem(run_dir: str | Path, log: Callable[[str], None] = print) -> str | None:
    """Why this run must not start again, or None: the recorded save failed for want of space and the
    disk still lacks it (the save would fail the same way), or it failed :data:`STOP_AFTER` times in a
    row for another reason. Space freed since: logged, and the run goes on."""
    run_dir = Path(run_dir)
    record = read_failure(run_dir)
    if record is None:
        return None
    root = run_dir / "checkpoints"
    needed = record.get("needed_bytes")
    where = root if root.is_dir() else run_dir
    free = shutil.disk_usage(where).free
    if isinstance(needed, int) and free >= needed:
        log(f"{run_dir / FAILURE_FILE}: {where} now has {free} bytes free ({needed} needed); retrying")
        return None
    if not isinstance(needed, int) and record["count"] < STOP_AFTER:
        return None  # another kind of failure: a requeue may try once more
    times = f"{record['count']} time(s) in a row"
    space = f"; {where} still has {free} bytes free, {needed} needed" if isinstance(needed, int) else ""
    return (
        f"{run_dir / FAILURE_FILE}: the save of step {record.get('step')} failed {times} "
        f"({record.get('error')}){space}; not starting again: fix the cause, then delete that file"
    )


@contextlib.contextmanager
def guarded_save(
    run_dir: str | Path, step: int, log: Callable[[str], None] = print, keep_last: int = 1
) -> Iterator[None]:
    """Collective: refuse a save the disk cannot hold, turn a failed save into one line, count failures
    (``keep_last``: the run's ``run.keep_last``, for the refusal's suggestion)."""
    import torch.distributed as dist

    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    wait_for_pruning()  # the free space counts the checkpoints the previous save deleted
    verdict = space_problem(root, step, keep_last) if rank0 else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    if verdict is not None:
        _fail(run_dir, step, verdict[0], verdict[1], rank0)
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        tmp = root / f"step_{step:06d}.tmp"
        if _no_space(e, root):
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint stays complete
            # a retry needs more room than this one had (the previous checkpoint's size at least)
            previous = next(iter(step_dirs(root)), None)
            needed = max(shutil.disk_usage(root).free + 1, checkpoint_bytes(previous) if previous else 0)
            message = (
                f"saving checkpoint step {step} to {tmp} failed: no space left on device ({root}); free "
                "space there and rerun"
            )
            _fail(run_dir, step, message, needed, rank0, e)
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]  # DCP: the rank's own error
        message = f"saving checkpoint step {step} to {tmp} failed ({type(e).__name__}: {last})"
        _fail(run_dir, step, message, None, rank0, e)
    if rank0:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / FAILURE_FILE).unlink()


def _fail(
    run_dir: Path,
    step: int,
    message: str,
    needed: int | None,
    rank0: bool,
    cause: BaseException | None = None,
) -> None:
    count = _record(run_dir, step, message, needed) if rank0 else 1
    if count >= 2:
        message += f"; this save has now failed {count} times in a row"
    if needed is not None or count >= STOP_AFTER:
        message += f"; the next start is refused until it can succeed ({run_dir / FAILURE_FILE})"
    raise CheckpointError(message) from cause
