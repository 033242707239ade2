"""Loading a torch_dist checkpoint into a model built with another layer spec (Transformer Engine vs local).

Transformer Engine modules carry ``_extra_state`` (FP8 scaling metadata; empty for bf16) that the local
spec lacks for some modules (e.g. TE's core attention), so a checkpoint written on a machine without TE
does not hold them. Both loaders of ``model.``-prefixed shards use this: the converter's
:func:`~srpo_megatron.conversion.checkpoint.load_policy_checkpoint` and the trainer's resume
(``trainer/run/checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

TE_EXTRA_STATE = "_extra_state"


def drop_absent_extra_state(sharded: dict[str, Any], stored_keys: set[str], where: str) -> list[str]:
    """Remove from ``sharded`` (a model's ``sharded_state_dict``, modified in place) the ``_extra_state``
    objects ``stored_keys`` (the checkpoint's sharded keys) does not hold; return their keys.

    Those modules keep their freshly initialised extra state, which is exactly what a bf16 run starts
    from. Any other absent key is an error naming the keys (layouts disagree).
    """
    dropped = []
    missing = []
    for name, item in list(sharded.items()):
        key = getattr(item, "key", None)
        if key is None or key in stored_keys:
            continue
        if key.endswith(TE_EXTRA_STATE):
            dropped.append(key)
            del sharded[name]
        else:
            missing.append(key)
    if missing:
        raise ValueError(
            f"checkpoint {where} lacks {len(missing)} tensor(s) the model needs, e.g. {sorted(missing)[:4]}; "
            "it was written for a different architecture or layer layout"
        )
    return dropped


def stored_sharded_keys(ckpt_dir: str) -> set[str]:
    """Keys of every ShardedTensor and ShardedObject in a torch_dist checkpoint (metadata only)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    meta = load_sharded_metadata(str(ckpt_dir))
    return {getattr(v, "key", k) for k, v in meta.items()}
