"""Which megatron-core is installed, the tested range, and the API differences inside that range.

CI runs the dist and trainer tiers on both ends of the tested range: megatron-core 0.16.1 (the newest
release for Python 3.11, installed in the venv) and 0.19.2 (the newest release, what NGC containers
ship; its cp312 wheel is pure Python apart from a datasets helper and runs on Python 3.11).

Each difference between the two that the project touches is one small function here (or in
``compat.cpu`` for the CUDA-as-CPU layer), decided by *feature detection* on the installed package, not
by comparing version numbers, so a release between the two tested ones takes whichever path it
actually supports:

- ``save_writes_common_pt()``: up to 0.16 ``dist_checkpointing.save`` writes the common (non-tensor)
  state to ``common.pt`` through ``serialization.get_default_save_common_strategy``; 0.19 removed that
  function and stores the common state as one ``ShardedObject`` (key ``common_state``) inside the
  ``torch_dist`` files (0.19 still *loads* a legacy ``common.pt``).

``warn_if_untested()`` warns once per process, naming the range, when the installed version is outside
``TESTED_RANGE``; ``parallel.initialize_model_parallel`` calls it, so every trainer/converter run starts
with it.
"""

from __future__ import annotations

import warnings

TESTED_MIN = (0, 16, 1)
"""Oldest megatron-core the CI runs (inclusive)."""
TESTED_BELOW = (0, 20, 0)
"""First megatron-core version outside the tested range (exclusive upper bound)."""
TESTED_RANGE = "megatron-core>=0.16.1,<0.20"
"""The tested range as pyproject.toml states it."""

_warned: list[bool] = []


def mcore_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the megatron-core that ``import megatron.core`` resolves to."""
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH)


def mcore_version_str() -> str:
    """``"0.19.2"``: the installed megatron-core without the local (+git) suffix."""
    return ".".join(map(str, mcore_version()))


def version_is_tested(version: tuple[int, int, int] | None = None) -> bool:
    """True when ``version`` (default: the installed one) is inside ``TESTED_RANGE``."""
    version = mcore_version() if version is None else version
    return TESTED_MIN <= tuple(version) < TESTED_BELOW


def warn_if_untested() -> bool:
    """Warn once per process when the installed megatron-core is outside the tested range.

    Returns True when this call warned."""
    if _warned or version_is_tested():
        return False
    _warned.append(True)
    warnings.warn(
        f"megatron-core {mcore_version_str()} is outside the tested range {TESTED_RANGE!r}; "
        "the model builders, checkpoints and CPU layer were verified only on that range. "
        "Install a tested version or run the dist tests (tests/dist) against this one first.",
        RuntimeWarning,
        stacklevel=2,
    )
    return True


def save_writes_common_pt() -> bool:
    """True when ``dist_checkpointing.save`` writes the common state to ``common.pt`` (<= 0.16);
    False when it stores it as the ``common_state`` ShardedObject in the torch_dist files (0.19)."""
    from megatron.core.dist_checkpointing import serialization

    return hasattr(serialization, "get_default_save_common_strategy")


__all__ = [
    "TESTED_RANGE",
    "mcore_version",
    "mcore_version_str",
    "save_writes_common_pt",
    "version_is_tested",
    "warn_if_untested",
]
