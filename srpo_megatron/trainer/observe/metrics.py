"""Per-step metrics (method §6) to ``<run>/metrics.jsonl``, TensorBoard, optional W&B, and a console bar."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from srpo_megatron.trainer.step_types import undeclared


class MetricsLogger:
    """Rank-0 sink for step metrics. ``log`` appends one JSON object per step (flushed at once); every name
    must be declared in ``trainer/step_types.METRICS`` (the method's own are ``METHOD_METRICS`` there).

    A resumed run continues the file of the steps it kept: rows past ``start`` (the checkpoint's step;
    0 without one) and a torn last line are dropped first, each with a notice (:func:`repair_metrics`),
    and TensorBoard is told to hide its events from step ``start + 1`` on (``purge_step``)."""

    def __init__(
        self, run_dir: str | Path, run: Any, *, total: int, start: int, log: Callable[[str], None] = print
    ) -> None:
        """``run``: the recipe's ``RunConfig`` (tensorboard, wandb_project, progress_bar)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_metrics(self.path, start, log)
        self._file = self.path.open("a")
        self._tb = None
        if run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the earlier files' events at and after it (a resumed run)
            self._tb = SummaryWriter(
                str(Path(run_dir) / "tensorboard"), purge_step=start + 1 if start else None
            )
        self._wandb = None
        if run.wandb_project:
            import wandb

            self._wandb = wandb.init(project=run.wandb_project, dir=str(run_dir), resume="allow")
        self._bar = None
        if run.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="srpo", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        unknown = undeclared(metrics)
        if unknown:
            raise KeyError(
                f"metrics {unknown} are not declared: every logged metric has one entry, with its reduction, "
                "in trainer/step_types.METRICS; add it there"
            )
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, int | float) and k != "step" and v is not None:
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                reward=f"{record.get('reward/mean', float('nan')):.3f}",
                sdpo=f"{record.get('route/sdpo_frac', float('nan')):.2f}",
                loss=f"{record.get('loss/total', float('nan')):.4f}",
                s=f"{record.get('time/step_s', float('nan')):.1f}",
            )

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


def repair_metrics(path: Path, keep_through: int, log: Callable[[str], None] = print) -> None:
    """Make ``path`` (metrics.jsonl) end at step ``keep_through``, the step the run resumes after.

    A torn last line (a kill mid-write: no newline and not a whole row) is dropped, and so are the rows
    of steps after ``keep_through`` (trained before a crash, but not in the checkpoint: the resumed run
    logs them again), each with a one-line notice. Other lines stay as they are. Rewritten atomically."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if not data:
        return
    lines = data.split(b"\n")
    torn = lines.pop()  # what follows the last newline: b"" unless the last write was cut short
    if torn and _row_step(torn) is not None:  # a whole row, only its newline missing: keep it
        lines.append(torn)
        torn = b""
    kept: list[bytes] = []
    dropped: list[bytes] = []
    for line in lines:
        step = _row_step(line)
        (dropped if step is not None and step > keep_through else kept).append(line)
    if not torn and not dropped and data.endswith(b"\n"):
        return
    if torn:
        log(f"{path}: dropped a torn last line ({len(torn)} bytes), left by a run killed while writing it")
    if dropped:
        steps = [s for line in dropped if (s := _row_step(line)) is not None]
        log(
            f"{path}: dropped {len(dropped)} row(s) of steps {min(steps)}..{max(steps)} (after step "
            f"{keep_through}, the step this run resumes from); they are logged again as the steps rerun"
        )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in kept))
    os.replace(tmp, path)


def _row_step(line: bytes) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class SampleLog:
    """Rank 0: ``<run>/samples.jsonl``, one row per trained batch: the step it trains, the trainer's weight
    version then, and every sample's id, weight version, reward and (with per-token versions) the
    distinct versions its tokens came from. A resumed run appends the steps it redoes again; the last row of a
    step is the one that counts. This is what the off-policy tests count samples by."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, trainer_version: int, samples: list[Any]) -> None:
        row = {
            "step": step,
            "trainer_version": trainer_version,
            "uids": [s.uid for s in samples],
            "versions": [s.weight_version for s in samples],
            "rewards": [s.reward for s in samples],
            "token_versions": [sorted(set(s.token_versions or [s.weight_version])) for s in samples],
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
