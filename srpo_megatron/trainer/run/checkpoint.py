"""Atomic, resumable training checkpoints with megatron's ``dist_checkpointing`` (any TP/PP on load).

Layout of ``<run>/checkpoints/``::

    step_000010/                 one complete checkpoint (dist_checkpointing torch_dist directory)
        model.* tensors          the policy (``POLICY_PREFIX``, the converter's layout: export works on it)
        teacher.* tensors        the EMA/frozen self-teacher
        optimizer.* tensors      optimizer state (megatron's sharded optimizer state dict; its format and
                                 the TP/PP/EP/DP layout in dist_checkpointing's content metadata,
                                 see optimizer_format.py)
        hf_config.json           the policy's HF config (tools/convert_megatron_to_hf.py reads it)
        hf_source.json           the policy's model.hf_dir (export copies the hub's MTP layers from it)
        trainer_state.json       step, LR scheduler, data cursor, engine weight version, metrics tail
        recipe.yaml              the recipe in force when it was saved (resume checks changes against it)
        rollout_buffer.pt        completed rollouts not yet trained (off-policy, dynamic sampling), rank 0
        rng/rank_XXXXX.pt        RNG states of every rank, as plain tensors
        manifest.json            every other file with size and SHA-256, written last (the data files'
                                 digests taken as they are written: hashed_save.py)
    latest                       text file naming the newest complete checkpoint (a hint)

A checkpoint is written to ``step_N.tmp``, fsynced, and renamed when complete; ``latest`` is replaced
atomically afterwards, so a crash at any point leaves the previous checkpoint valid. The oldest
checkpoints beyond ``keep_last`` are deleted only after the new one is complete (in a background thread
that the next save waits for: ``checkpoint_files.prune_in_background``). Which checkpoint a run
resumes from is decided by :func:`~srpo_megatron.conversion.checkpoint_files.find_resume_checkpoint`.

Trust: the project's own files load without unpickling (RNG states with ``torch.load(weights_only=True)``,
the trainer state as JSON), but torch DCP's ``.metadata`` (and ``common.pt``, read by megatron) are
pickles: load only checkpoints from a source you trust, as torch says for ``torch.load``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from srpo_megatron.children import megatron_results_queue
from srpo_megatron.compat.float16_optimizer import fix_float16_optimizer_checkpointing
from srpo_megatron.conversion.checkpoint import HF_CONFIG_NAME, POLICY_PREFIX
from srpo_megatron.conversion.checkpoint_files import (
    LATEST,
    CheckpointError,
    digest_files,
    prune_in_background,
    step_dirs,
    wait_for_pruning,
    write_manifest,
)
from srpo_megatron.conversion.mtp import record_source
from srpo_megatron.conversion.spec_compat import drop_absent_extra_state, stored_sharded_keys
from srpo_megatron.conversion.torch_save_format import crc32_off
from srpo_megatron.durable_io import fsync_dir, fsync_dirs, write_text_durably
from srpo_megatron.models.architecture import load_hf_config_dict
from srpo_megatron.trainer.run import optimizer_format
from srpo_megatron.trainer.run.rng_state import load_rng_file, rng_state, set_rng_state
from srpo_megatron.trainer.state.ema_shard import load_teacher_fp32, teacher_fp32_state

if TYPE_CHECKING:
    from srpo_megatron.trainer.state.policy import Policy

TEACHER_PREFIX = "teacher."
STATE_FILE = "trainer_state.json"
BUFFER_FILE = "rollout_buffer.pt"
RECIPE_FILE = "recipe.yaml"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``<run>/checkpoints/latest`` names if it exists (a hint: see find_resume_checkpoint)."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def _load_tensors(policy: Policy, path: Path) -> None:
    """Policy, teacher (and its fp32 EMA copy when saved) and optimizer state from ``path``."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_content_metadata(str(path))
    sharded = _sharded_state(policy, True, optimizer_format.loadable_sharding(saved, policy.groups, path))
    stored = stored_sharded_keys(str(path))
    fp32 = sharded.get("teacher_fp32", {})
    if fp32 and any(sh.key not in stored for sh in fp32.values()):
        del sharded["teacher_fp32"]  # saved before the fp32 copy was checkpointed: rebuilt from bf16
    for part in ("model", "teacher"):  # saved without TE, resumed with TE: see drop_absent_extra_state
        if part in sharded:
            drop_absent_extra_state(sharded[part], stored, str(path))
    # torch DCP's CheckpointException (a rank's KeyError, e.g. a shard key the checkpoint lacks) is a
    # BaseException, not an Exception
    try:
        loaded = dist_checkpointing.load(sharded, str(path))
    except (Exception, CheckpointException) as e:  # megatron/torch name neither the directory nor the fix
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointError(
            f"{path}: loading the model/optimizer shards failed ({type(e).__name__}: {first}); the recipe's "
            "model must match the checkpoint's (see its recipe.yaml)"
        ) from e
    strip = lambda sd, p: {k[len(p) :] if k.startswith(p) else k: v for k, v in sd.items()}  # noqa: E731
    policy.model.load_state_dict(strip(loaded["model"], POLICY_PREFIX), strict=False)
    if policy.teacher is not None:
        if "teacher" in loaded:  # a LoRA teacher shares the student's module: only its adapter EMA is saved
            policy.teacher.module.load_state_dict(strip(loaded["teacher"], TEACHER_PREFIX), strict=False)
        policy.teacher.reset_master()
        if "teacher_fp32" in loaded:  # the exact EMA; without it one bf16 rounding (older checkpoints)
            load_teacher_fp32(policy.teacher, loaded["teacher_fp32"])
    # no_grad: megatron's dp_reshardable load (0.16.1, 0.19.2) copies into the fp32 params' main shards,
    # views of the params themselves, outside no_grad (its fully_reshardable load has the decorator)
    with (
        torch.no_grad(),
        _keep_torch_adam_step(policy.optimizer),
        fix_float16_optimizer_checkpointing(policy.optimizer),
    ):
        policy.optimizer.load_state_dict(loaded["optimizer"])
    untie_torch_adam_steps(policy.optimizer)


def untie_torch_adam_steps(optimizer: Any) -> int:
    """Give every torch-Adam parameter state its own ``step`` tensor; return how many were shared.

    Shim for megatron-core's ``DistributedOptimizer.load_state_dict`` without Apex/TE (0.16.1 and 0.19.2):
    it assigns ONE ``step`` tensor to every parameter's state, and torch Adam increments each state's
    step in place, so the first step after a resume counted P increments for P parameters and every
    bias correction after it was wrong (a resumed DP2 run drifted by ~5e-3 after one step). FusedAdam
    (GPU, TE/Apex) keeps ``step`` in the param groups and never takes this path.
    tests/dist/test_distopt_resume.py fails without it, and fails once megatron stops sharing the tensor.
    """
    shared = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        seen: set[int] = set()
        for state in getattr(inner, "state", {}).values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    shared += 1
                seen.add(id(step))
                state["step"] = step.detach().clone()
    return shared


@contextlib.contextmanager
def _keep_torch_adam_step(optimizer: Any):
    """Shim for megatron-core's distributed-optimizer load with torch Adam (no Apex/TE, i.e. CPU; 0.16.1
    and 0.19.2).

    ``DistributedOptimizer.load_state_dict`` restores torch Adam's per-parameter ``step`` from the param
    groups, then ``_set_main_param_and_optimizer_states`` copies every state key of the parameter from
    the loaded tensors. A fully_reshardable load's tensors carry no ``step`` (KeyError); a dp_reshardable
    load's carry the fresh optimizer's own ``step`` as a non-persistent object (the dummy state's, not the
    checkpoint's: it overwrote the restored step, tests/dist/test_checkpoint_format.py). The shim hands it
    the restored ``step`` itself (a copy onto itself). FusedAdam (GPU) keeps ``step`` in the param groups
    and never needs it.
    """
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "_set_main_param_and_optimizer_states"):
            continue
        original = opt._set_main_param_and_optimizer_states

        def with_step(model_param, tensors, opt=opt, original=original):
            group, order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = with_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method


def _sharded_state(policy: Policy, loading: bool, sharding: str) -> dict[str, Any]:
    model_sd = policy.model.sharded_state_dict(prefix=POLICY_PREFIX)
    state: dict[str, Any] = {"model": model_sd}
    if policy.teacher is not None:
        if not getattr(policy.teacher, "shares_module", False):  # LoRA: the adapter EMA below is all
            state["teacher"] = policy.teacher.module.sharded_state_dict(prefix=TEACHER_PREFIX)
        fp32 = teacher_fp32_state(policy.teacher, policy.model, model_sd, loading)  # ema_shard.py
        if fp32:
            state["teacher_fp32"] = fp32
    meta = {"distrib_optim_sharding_type": sharding}  # other optimizers ignore it
    if loading:  # its sharded_state_dict reads the moments' step: give a fresh optimizer states to load into
        for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
            if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()  # overwritten by the load
    with fix_float16_optimizer_checkpointing(policy.optimizer):  # fp32 norms in a bf16 model (no TE)
        state["optimizer"] = policy.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=meta)
    return state


def save_checkpoint(
    policy: Policy,
    run_dir: str | Path,
    step: int,
    trainer_state: dict,
    keep_last: int,
    rollout_buffer: dict | None = None,
    timings: dict[str, float] | None = None,
) -> Path:
    """Collective: write checkpoint ``step`` (manifest last, fsynced), rename it, move ``latest``, prune.
    ``rollout_buffer`` (rank 0: the rollout pool's state, plain values and tensors) is saved with it.
    ``timings``, when given, receives this rank's seconds per part (``dist_checkpointing_s``, ``extras_s``,
    ``digest_s``, ``finalize_s``; ``tools/bench_demo_step.py``)."""
    from megatron.core import dist_checkpointing

    from srpo_megatron.config import to_dict

    clock = _PartClock(timings)
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if _rank() == 0:
        wait_for_pruning()  # the previous save's deletions
        shutil.rmtree(tmp, ignore_errors=True)
        # empty: dist_checkpointing.save takes a non-empty folder for an interrupted earlier save and
        # logs "Overwriting old incomplete / corrupted checkpoint"; our own files go in after it
        tmp.mkdir(parents=True)
    _barrier()
    megatron_results_queue()  # megatron's writer results manager dies with this process (children.py)
    with policy.offload.all_on_device():  # host-resident teacher (trainer/state/offload.py)
        content = optimizer_format.content_metadata(policy.cfg.run, policy.groups)
        sharded = _sharded_state(policy, False, content[optimizer_format.SHARDING_KEY])
        strategy, first = _save_strategy(policy, content[optimizer_format.SHARDING_KEY])
        with crc32_off():  # the manifest's SHA-256 covers every byte (torch_save_format.crc32_off)
            dist_checkpointing.save(
                sharded,
                str(tmp),
                sharded_strategy=strategy,
                validate_access_integrity=first,  # megatron: once per strategy under a constant structure
                content_metadata=content,
            )
    clock.mark("dist_checkpointing_s")
    (tmp / "rng").mkdir(exist_ok=True)  # every rank (shared or per-node filesystem alike)
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
        import yaml

        config = load_hf_config_dict(policy.cfg.model.hf_dir)
        (tmp / HF_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        record_source(tmp, policy.cfg.model.hf_dir)  # export finds the hub's MTP layers there
        trainer_state = {**trainer_state, "scheduler": policy.scheduler.state_dict(), "step": step}
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, default=float) + "\n")
        (tmp / RECIPE_FILE).write_text(yaml.safe_dump(to_dict(policy.cfg), sort_keys=False))
        if rollout_buffer is not None:
            torch.save(rollout_buffer, tmp / BUFFER_FILE)
    _barrier()
    clock.mark("extras_s")
    # each rank fsyncs its data files (hashed while written); the small rest is read back, split by size
    digests = digest_files(tmp, known=strategy.base_strategy.written(tmp))
    clock.mark("digest_s")
    if _rank() == 0:
        write_manifest(tmp, digests)  # durably
        fsync_dirs(tmp)  # every file was fsynced by the rank that wrote or hashed it (digest_files)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        write_text_durably(root / LATEST, final.name + "\n")
        prune_in_background(step_dirs(root)[keep_last:])  # only once the new one is published
    _barrier()
    clock.mark("finalize_s")
    return final


_SAVE_STRATEGIES: weakref.WeakKeyDictionary[Policy, dict[str, Any]] = weakref.WeakKeyDictionary()


def _save_strategy(policy: Policy, sharding: str) -> tuple[Any, bool]:
    """(megatron's save strategy for ``policy`` in optimizer format ``sharding``, whether this is its first
    save). A run saves one state dict structure again and again (same model, teacher, optimizer), so the
    strategy is kept across saves, as megatron's training loop keeps its own in ``checkpointing_context``
    under ``--ckpt-assume-constant-structure``: the sharding is validated and the replicated shards'
    writers chosen at the first save only, and the save plan is reused once two saves planned alike
    (``hashed_save.parallel_hashing_save``; ``tools/bench_checkpoint.py``). Keyed by format: the two
    formats' optimizer state dicts differ (``tests/dist/test_checkpoint_format.py`` alternates them)."""
    from megatron.core import parallel_state

    from srpo_megatron.trainer.run.hashed_save import parallel_hashing_save

    kept = _SAVE_STRATEGIES.setdefault(policy, {})
    first = sharding not in kept
    if first:  # megatron's training-loop save: replicated shards' writes spread over DP, hashed as written
        kept[sharding] = parallel_hashing_save(
            parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    return kept[sharding], first


class _PartClock:
    """Seconds since the previous mark, recorded under each mark's name (nothing when ``out`` is None)."""

    def __init__(self, out: dict[str, float] | None) -> None:
        self.out, self.t = out, time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        if self.out is not None:
            self.out[name] = now - self.t
        self.t = now


def load_rollout_buffer(path: str | Path) -> dict | None:
    """The rollout pool's state saved with checkpoint ``path`` (None when it holds none: on-policy runs
    and checkpoints written before the pool was saved). Plain values and tensors, no unpickling."""
    file = Path(path) / BUFFER_FILE
    if not file.is_file():
        return None
    return torch.load(file, weights_only=True)


def load_checkpoint(policy: Policy, path: str | Path, log=print) -> dict:
    """Collective: restore policy, teacher, optimizer, scheduler and RNG; return the trainer state.

    ``path`` must have passed :func:`~srpo_megatron.conversion.checkpoint_files.verify_checkpoint`.
    """
    path = Path(path)
    with (
        policy.offload.all_on_device()
    ):  # the host-resident teacher loads in place (trainer/state/offload.py)
        _load_tensors(policy, path)
    state = json.loads((path / STATE_FILE).read_text())
    policy.scheduler.load_state_dict(state["scheduler"])
    rng = path / "rng" / f"rank_{_rank():05d}.pt"
    saved_ranks = len(list((path / "rng").glob("rank_*.pt")))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rng.is_file():
        set_rng_state(load_rng_file(rng), str(rng))
    if saved_ranks != world and _rank() == 0:
        log(
            f"{path} holds RNG states of {saved_ranks} ranks, this run has {world}: ranks without a saved "
            "state draw from run.seed, so sampling is not the uninterrupted run's"
        )
    return state
