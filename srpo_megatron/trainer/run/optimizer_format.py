"""Which format the distributed optimizer's checkpoint state takes, and whether this run may load it.

Megatron's training loop (megatron/training/checkpointing.py ``_build_sharded_state_dict_metadata``,
megatron-core 0.16.1 and 0.19.2) saves ``dp_reshardable`` by default and ``fully_reshardable`` only with
``--dist-ckpt-optim-fully-reshardable``; this follows it with ``run.checkpoint_fully_reshardable``:

- ``dp_reshardable`` (default): every rank writes its own bucket shards, no gather (fast). The state keeps
  the optimizer's bucket layout, so it loads only at the same TP/PP/EP/ETP (any DP or CP: the buckets are
  cut again over the new data-parallel group).
- ``fully_reshardable``: the state is gathered on DP rank 0 and stored model-shaped (slow); it loads at any
  layout.

The format and the saving layout go in ``dist_checkpointing``'s content metadata (``save(...,
content_metadata=...)``, read back by ``load_content_metadata``, as megatron does); a load uses the saved
format, and a checkpoint saved before the format was recorded was ``fully_reshardable``. Other optimizers
(no distributed optimizer) ignore the format.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from srpo_megatron.conversion.checkpoint_files import CheckpointError

if TYPE_CHECKING:
    from srpo_megatron.config.run import RunConfig
    from srpo_megatron.parallel import ParallelGroups

SHARDING_KEY = "distrib_optim_sharding_type"  # megatron's metadata key
LAYOUT_KEY = "srpo_layout"
FAST, RESHARDABLE = "dp_reshardable", "fully_reshardable"
SHAPE_AXES = ("tp", "pp", "ep", "etp")  # the axes that change the optimizer's buckets (DP/CP do not)


def layout(groups: ParallelGroups) -> dict[str, int]:
    """This run's parallel sizes, as recorded with a checkpoint."""
    return {
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "ep": groups.ep_size,
        "etp": groups.etp_size,
        "dp": groups.dp_size,
        "cp": groups.cp_size,
    }


def content_metadata(run: RunConfig, groups: ParallelGroups) -> dict[str, Any]:
    """What ``dist_checkpointing.save`` records: the optimizer format and the layout that saved it."""
    sharding = RESHARDABLE if run.checkpoint_fully_reshardable else FAST
    return {SHARDING_KEY: sharding, LAYOUT_KEY: layout(groups)}


def loadable_sharding(saved: dict | None, groups: ParallelGroups, path: str | Path) -> str:
    """The format checkpoint ``path`` was saved in (``saved``: its content metadata), refusing a fast
    checkpoint this run's layout cannot load, with the fix."""
    saved = saved or {}
    sharding = saved.get(SHARDING_KEY, RESHARDABLE)  # older checkpoints: always fully_reshardable
    if sharding == RESHARDABLE:
        return sharding
    if sharding != FAST:
        raise CheckpointError(
            f"{path}: optimizer state saved as {sharding!r}, which this trainer does not load; it writes "
            f"{FAST!r} or {RESHARDABLE!r}"
        )
    then, now = saved.get(LAYOUT_KEY, {}), layout(groups)
    changed = {a: (then.get(a), now[a]) for a in SHAPE_AXES if then.get(a) != now[a]}
    if changed:
        was = " ".join(f"{a.upper()}{then.get(a)}" for a in SHAPE_AXES)
        run = " ".join(f"{a.upper()}{now[a]}" for a in SHAPE_AXES)
        raise CheckpointError(
            f"{path}: its optimizer state was saved at {was} in the fast {FAST} format, which loads only at "
            f"the same TP/PP/EP/ETP (any DP), and this run is {run}; resume at {was} with "
            "run.checkpoint_fully_reshardable=true for one saved step, then change the layout"
        )
    return sharding
