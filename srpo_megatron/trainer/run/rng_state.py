"""Every RNG one rank draws from, saved with a checkpoint and restored on resume (``rng/rank_XXXXX.pt``).

Python's ``random``, numpy's legacy generator, torch's CPU generator, the current CUDA device's default
generator and megatron's RNG tracker (the model-parallel dropout/init streams), stored as tensors and
numbers so that :func:`load_rng_file` reads them with ``torch.load(weights_only=True)``: a crafted file
cannot run code.

Across device kinds (CPU <-> GPU resume): policy, teacher and optimizer state move, because
``dist_checkpointing`` (torch_dist) stores tensors as bytes and reads them into the *loading* model's
sharded state dict on the loading rank's device. The RNG tracker state does not: a CUDA generator state
and the CPU layer's stand-in generator have different sizes. The device kind is recorded with the states
(``tracker_device``) and, on a mismatch, the tracker keeps its seeding from the recipe seed with a warning
naming the cause (:func:`rng_states_compatible`).
"""

from __future__ import annotations

import math
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import torch

from srpo_megatron.conversion.checkpoint_files import CheckpointError


def rng_device_kind() -> str:
    """``cuda`` when the RNG tracker holds CUDA generator states, ``cpu`` under the CPU layer."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def rng_states_compatible(saved_kind: str | None, path: str) -> bool:
    """Whether RNG tracker states saved on ``saved_kind`` can be restored here; warns with the cause if not.

    A CUDA generator state (16 bytes: seed and offset) and the CPU layer's stand-in generator state
    (5056 bytes) cannot be exchanged: the first ``fork()`` would raise "Expected a ... of size 5056".
    """
    here = rng_device_kind()
    if (saved_kind or "cpu") == here:
        return True
    warnings.warn(
        f"{path}: RNG tracker states were saved on {saved_kind or 'cpu'} and this run is on {here}; "
        "generator states do not move between devices, so the tracker is reseeded from run.seed "
        "(weights, optimizer state and data cursor resume exactly; only dropout/init streams restart)",
        stacklevel=2,
    )
    return False


def rng_state() -> dict[str, Any]:
    """Every RNG this rank draws from, as tensors and numbers (loadable with ``weights_only=True``)."""
    import numpy as np
    from megatron.core import tensor_parallel

    version, keys, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python_keys": torch.tensor(keys, dtype=torch.int64, device="cpu"),  # [625]
        "python_version": int(version),
        "python_gauss": math.nan if gauss is None else float(gauss),
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),  # [624]
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.cpu() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        "tracker_device": rng_device_kind(),  # CUDA and CPU-layer generator states differ in size
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's default generator
    return state


def set_rng_state(state: dict[str, Any], path: str = "") -> None:
    """Restore what :func:`rng_state` returned (``path`` names the file in warnings)."""
    import numpy as np
    from megatron.core import tensor_parallel

    gauss = state["python_gauss"]
    keys = tuple(int(k) for k in state["python_keys"].tolist())
    random.setstate((state["python_version"], keys, None if math.isnan(gauss) else gauss))
    np_keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(
        ("MT19937", np_keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    # Saved on the other device kind (CPU <-> GPU resume): the tracker keeps its seeding (warned).
    if rng_states_compatible(state.get("tracker_device"), path):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def load_rng_file(path: Path) -> dict[str, Any]:
    """An RNG file, read without running any code: anything but tensors and numbers is refused."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(
            f"{path} holds more than tensors and numbers ({first}); refusing to unpickle it. Checkpoints "
            "must come from a trusted source; if you wrote this one with an older srpo_megatron, resume "
            "with the same version or pass --override run.restart=true"
        ) from None
