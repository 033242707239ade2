"""Atomic, resumable training checkpoints with megatron's ``dist_checkpointing`` (any TP/PP on load).

Layout of ``<run>/checkpoints/``::

    step_000010/                 one complete checkpoint (dist_checkpointing torch_dist directory)
        model.* tensors          the policy (``POLICY_PREFIX``, the converter's layout: export works on it)
        teacher.* tensors        the EMA/frozen self-teacher
        optimizer.* tensors      optimizer state (megatron's sharded optimizer state dict)
        hf_config.json           the policy's HF config (tools/convert_megatron_to_hf.py reads it)
        trainer_state.json       step, LR scheduler, data cursor, engine weight version, metrics tail
        rng/rank_XXXXX.pt        RNG states of every rank
    latest                       text file naming the newest complete checkpoint, written last

A checkpoint is written to ``step_N.tmp`` and renamed when complete; ``latest`` is replaced atomically
afterwards, so a crash at any point leaves the previous ``latest`` valid. The oldest checkpoints beyond
``keep_last`` are deleted only after the new one is complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.conversion.checkpoint import HF_CONFIG_NAME, POLICY_PREFIX
from srpo_megatron.models.architecture import load_hf_config_dict

TEACHER_PREFIX = "teacher."
STATE_FILE = "trainer_state.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint named by ``<run>/checkpoints/latest``, or None."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"{pointer} names {path.name}, which is incomplete or missing; delete {pointer} to start over "
            "or point it at an existing step_* directory"
        )
    return path


def _sharded_state(runtime: Any, loading: bool) -> dict[str, Any]:
    model_sd = runtime.model.sharded_state_dict(prefix=POLICY_PREFIX)
    state: dict[str, Any] = {"model": model_sd}
    if runtime.teacher is not None:
        state["teacher"] = runtime.teacher.module.sharded_state_dict(prefix=TEACHER_PREFIX)
    state["optimizer"] = runtime.optimizer.sharded_state_dict(model_sd, is_loading=loading)
    return state


def _rng_state() -> dict[str, Any]:
    import numpy as np
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(
    runtime: Any, run_dir: str | Path, step: int, trainer_state: dict, keep_last: int
) -> Path:
    """Collective: write checkpoint ``step`` atomically, then move ``latest`` to it, then prune."""
    from megatron.core import dist_checkpointing

    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(_sharded_state(runtime, loading=False), str(tmp))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        config = load_hf_config_dict(runtime.cfg.model.hf_dir)
        (tmp / HF_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        trainer_state = {**trainer_state, "scheduler": runtime.scheduler.state_dict(), "step": step}
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, default=float) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / "latest")
        complete = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(runtime: Any, path: str | Path) -> dict:
    """Collective: restore policy, teacher, optimizer, scheduler and RNG; return the trainer state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    loaded = dist_checkpointing.load(_sharded_state(runtime, loading=True), str(path))
    strip = lambda sd, p: {k[len(p) :] if k.startswith(p) else k: v for k, v in sd.items()}  # noqa: E731
    runtime.model.load_state_dict(strip(loaded["model"], POLICY_PREFIX), strict=False)
    if runtime.teacher is not None:
        runtime.teacher.module.load_state_dict(strip(loaded["teacher"], TEACHER_PREFIX), strict=False)
        runtime.teacher.reset_master()
    runtime.optimizer.load_state_dict(loaded["optimizer"])
    state = json.loads((path / STATE_FILE).read_text())
    runtime.scheduler.load_state_dict(state["scheduler"])
    rng = path / "rng" / f"rank_{_rank():05d}.pt"
    if rng.is_file():  # absent when resuming at a different world size: RNG then restarts from the seed
        _set_rng_state(torch.load(rng, weights_only=False))
    return state
