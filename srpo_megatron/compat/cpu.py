"""Let megatron-core's real code run on CPU with the gloo backend (tests, the CPU demo).

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths. When CUDA is
absent, ``enable_cpu_compat()`` covers exactly those places and nothing else:

1. Devices. ``torch.cuda.current_device()`` answers 0, and a ``TorchFunctionMode`` rewrites CUDA device
   arguments (``device="cuda"``, ``device=0``, ``torch.device("cuda")``, ``tensor.cuda()``,
   ``tensor.to("cuda")``) to the CPU, and ``torch.device(0)`` / ``torch.device("cuda")`` built under the mode
   are the CPU device. Used by megatron for buffers, p2p shapes, the schedules' ``total_num_tokens`` and
   the default-device block of the YaRN RoPE of MLA (``with torch.device(torch.cuda.current_device())``);
   ``pin_memory=True`` (host staging before a ``.cuda()``, e.g. megatron's per-CP-rank RoPE slice) is dropped.
2. Type strings. ``clip_grad_by_total_norm_fp32`` and the distributed optimizer compare
   ``tensor.type()`` with ``'torch.cuda.FloatTensor'``-style names; the same mode answers a bare
   ``tensor.type()`` with the ``torch.cuda.`` name of the tensor's dtype.
3. Synchronisation. ``torch.cuda.synchronize`` is a no-op (CPU ops are synchronous).
4. Streams (megatron-core >= 0.19). DDP's ``start_grad_sync`` asks ``torch.cuda.current_stream()`` to
   wait on CUDA-graph events before reducing a bucket; on the CPU it answers a stream whose
   ``wait_event``/``wait_stream``/``synchronize`` do nothing (CPU ops run in program order).
5. RNG. ``torch.cuda.manual_seed``/``get_rng_state``/``set_rng_state`` (also under ``torch.cuda.random``)
   and megatron's ``tensor_parallel.random._set_cuda_rng_state`` act on one private CPU
   ``torch.Generator`` that stands in for "the GPU generator", so ``model_parallel_cuda_manual_seed``
   and the RNG tracker's ``add``/``fork`` work. Nothing on the CPU draws from that generator, so the
   layer never changes numerics: CPU initialisation (``use_cpu_initialization=True``) and CPU dropout
   use torch's default CPU generator, exactly as without this layer.

When CUDA is available, ``enable_cpu_compat()`` does nothing and returns False. The layer is
process-wide and idempotent; ``disable_cpu_compat()`` undoes it (used by its tests). Every behaviour
has a test in ``tests/unit/test_cpu_compat.py`` and ``tests/dist/test_megatron_cpu.py`` that fails if
megatron-core stops needing it differently (for example a new CUDA call on the training path).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare int means a CUDA ordinal for torch factory functions and Tensor.to.
    return isinstance(device, int) and not isinstance(device, bool)


def _cuda_type_name(t: torch.Tensor) -> str:
    name = torch.Tensor.type(t)  # e.g. 'torch.FloatTensor'; called outside the mode (no recursion)
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


class _CudaAsCpu(TorchFunctionMode):
    """Rewrite CUDA device arguments to CPU; answer bare ``Tensor.type()`` with the CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            with torch._C.DisableTorchFunction():
                return _cuda_type_name(args[0])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device and len(args) == 1 and not kwargs and type(args[0]) is int:
            # ``with torch.device(torch.cuda.current_device()):`` (megatron's YarnRotaryEmbedding, MLA). Only
            # the bare index: rewriting ``torch.device("cuda:N")`` too breaks the strict-device mode, whose
            # tagged tensors report ``cuda:<rank>`` (megatron 0.19.2's batched p2p then asks gloo for a
            # CUDA backend).
            return torch.device("cpu")
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # staging for a host->CUDA copy (rope_utils' CP index): no allocator
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func in _BACKWARD_FUNCS:
            return _run_backward(func, args, kwargs)
        return func(*args, **kwargs)


# A TorchFunctionMode is popped while its handler runs, so a backward entered through the mode (megatron's
# schedules call torch.autograd.backward) runs every autograd Function's backward WITHOUT the mode: there a
# ``torch.empty(..., device=torch.cuda.current_device())`` (e.g. the EP all-to-all's and the sequence-parallel
# all-gather's backward) asks for CUDA device 0 and fails "Cannot access accelerator device". While a
# backward runs, ``torch.cuda.current_device()`` answers "cpu" instead of 0, which every factory accepts.
# ``tests/unit/test_cpu_compat_moe.py`` fails if torch stops popping the mode there.
_BACKWARD_FUNCS = (torch.autograd.backward, torch.Tensor.backward, torch.autograd.grad)
_backward_depth = [0]


def _run_backward(func, args, kwargs):
    _backward_depth[0] += 1
    try:
        return func(*args, **kwargs)
    finally:
        _backward_depth[0] -= 1


def _current_device() -> int | str:
    """0 (megatron's device ordinal), or "cpu" inside a backward, which runs outside the mode."""
    return "cpu" if _backward_depth[0] else 0


def _fake_generator() -> torch.Generator:
    return _state["generator"]


def _manual_seed(seed: int) -> None:
    _fake_generator().manual_seed(int(seed))


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return _fake_generator().get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda", *args: Any, **kwargs: Any) -> None:
    _fake_generator().set_state(new_state.clone())


_PATCHES = [
    # (module path, attribute, replacement factory)
    ("torch.cuda", "current_device", lambda: _current_device),
    ("torch.cuda", "synchronize", lambda: lambda device=None: None),
    ("torch.cuda", "manual_seed", lambda: _manual_seed),
    ("torch.cuda", "manual_seed_all", lambda: _manual_seed),
    ("torch.cuda", "get_rng_state", lambda: _get_rng_state),
    ("torch.cuda", "set_rng_state", lambda: _set_rng_state),
    ("torch.cuda.random", "manual_seed", lambda: _manual_seed),
    ("torch.cuda.random", "manual_seed_all", lambda: _manual_seed),
    ("torch.cuda.random", "get_rng_state", lambda: _get_rng_state),
    ("torch.cuda.random", "set_rng_state", lambda: _set_rng_state),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", lambda: _set_rng_state),
]


def cuda_emulated() -> bool:
    """True while a test mode (``testing/strict_device.py``) asks the runtime to use "cuda" devices,
    which this layer maps to the host."""
    return bool(_state.get("emulate_cuda"))


def set_cuda_emulated(on: bool) -> None:
    if on and not _state.get("active"):
        raise RuntimeError("emulating CUDA needs the CPU layer: call enable_cpu_compat() first")
    _state["emulate_cuda"] = on


class _CpuEvent:
    """A CUDA event on the CPU: work is synchronous, so it has always completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream on the CPU. megatron's alltoall MoE dispatcher creates a side stream for its
    device-to-host copies of the token splits and records/waits events on it; on the CPU every op is
    synchronous and in program order, so each of those calls has nothing to do. A class, not a factory
    function: libraries evaluate annotations such as ``torch.cuda.Stream | None`` at import time
    (transformers' continuous batching), which a function would break."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _CpuStream()


@contextlib.contextmanager
def _stream_context(stream: Any = None):
    yield


def _split_sizes_to_host():
    """megatron's ``maybe_move_tensor_to_cpu`` for the alltoall dispatcher, also on CPU tensors.

    The dispatcher turns its all-to-all split sizes into numpy arrays through
    ``maybe_move_tensor_to_cpu(t, as_numpy=True)``, which converts only CUDA tensors; on the CPU the sizes
    stay tensors and ``all_to_all_single`` rejects them. This version converts CPU tensors too. It never
    records a stream: CPU ops run in program order, and under the strict-device mode (whose tensors answer
    ``is_cuda``) megatron would pass the CPU layer's stream to ``Tensor.record_stream``, which refuses it.
    """
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        out = maybe_move_tensor_to_cpu(tensor, as_numpy=as_numpy, record_stream=False)
        return out.numpy() if as_numpy and torch.is_tensor(out) else out

    return to_host


# Streams, events and host copies of megatron's MoE alltoall dispatcher (``MoEAlltoAllTokenDispatcher``):
# ``tests/unit/test_cpu_compat_moe.py`` checks the dispatcher still creates a CUDA stream and that
# ``maybe_move_tensor_to_cpu`` still leaves CPU tensors as tensors.
_STREAM_PATCHES = [
    ("torch.cuda", "Stream", lambda: _CpuStream),
    ("torch.cuda", "Event", lambda: _CpuEvent),
    # also megatron-core 0.19's DDP grad sync (param_and_grad_buffer.start_grad_sync), on dense models
    ("torch.cuda", "current_stream", lambda: lambda device=None: _CURRENT_STREAM),
    ("torch.cuda", "stream", lambda: _stream_context),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", _split_sizes_to_host),
]


def cpu_compat_active() -> bool:
    return bool(_state.get("active"))


def enable_cpu_compat() -> bool:
    """Activate the CPU layer when CUDA is unavailable. Returns True if it is active after the call."""
    if torch.cuda.is_available():
        return False
    with _lock:
        if _state.get("active"):
            return True
        import importlib

        _state["generator"] = torch.Generator(device="cpu")
        _state["generator"].manual_seed(0)
        saved = []
        for mod_name, attr, factory in _PATCHES + _STREAM_PATCHES:
            mod = importlib.import_module(mod_name)
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, factory())
        _state["saved"] = saved
        mode = _CudaAsCpu()
        mode.__enter__()
        _state["mode"] = mode
        _state["active"] = True
        return True


def disable_cpu_compat() -> None:
    """Undo ``enable_cpu_compat`` (for tests)."""
    with _lock:
        if not _state.get("active"):
            return
        _state["mode"].__exit__(None, None, None)
        for mod, attr, original in reversed(_state["saved"]):
            setattr(mod, attr, original)
        _state.clear()


# ------------------------------------------------------------------------------------- MoE (EP) on CPU
# Kept apart from the device layer above: these shims exist only for megatron's MoE layer.


def bind_missing_te_names() -> bool:
    """Bind ``moe_utils.te_general_gemm`` to ``None`` when Transformer Engine is absent; True if bound.

    megatron-core 0.16.1 imports ``te_general_gemm`` inside a try-block and later tests
    ``te_general_gemm is not None`` in ``RouterGatingLinearFunction`` (``router_gating_linear``, used when
    ``moe_router_dtype`` is set), so without TE the router raises ``NameError``. ``None`` selects the
    plain-torch GEMM that megatron intends for that case. Not CPU-specific: any TE-less process needs it.
    ``tests/unit/test_cpu_compat_moe.py`` fails once megatron binds the name itself.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def mark_te_absent_for_mla() -> bool:
    """Set ``multi_latent_attention.HAVE_TE`` to False when Transformer Engine is absent; True if changed.

    megatron-core 0.16.1's MLA module takes ``HAVE_TE = True`` as soon as
    ``megatron.core.extensions.transformer_engine`` imports, which it does without TE (it puts a MagicMock
    in TE's place), so ``TELinear`` is a MagicMock instance and ``MLASelfAttention.__init__`` raises
    ``TypeError: isinstance() arg 2 must be a type`` on ``isinstance(self.linear_proj, TELinear)``. False is
    what megatron's own import fallback means. Not CPU-specific: any TE-less process building MLA needs it.
    megatron-core 0.19.2 reads TE's absence itself; ``tests/unit/test_deepseek_mla_rules.py`` pins which
    versions need the shim and fails when one changes.
    """
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    if te_ext.HAVE_TE or not mla.HAVE_TE:
        return False
    mla.HAVE_TE = False
    return True
