"""Strict-device mode: CPU tests that fail on the host/device mix-ups a GPU run would hit.

Under the CUDA-as-CPU layer (``compat/cpu.py``) every device is the host, so a tensor that was never
moved to the accelerator works on CPU and breaks on the first GPU step. ``strict_device()`` keeps the
mapping but tracks *provenance*: a ``TorchFunctionMode`` tags

- every tensor created with a CUDA device argument (``device="cuda"``, ``torch.cuda.current_device()``,
  ``.cuda()``, ``.to("cuda")``), and the parameters and buffers of a module moved with
  ``module.to("cuda")`` / ``module.cuda()``;
- every op output with a tagged input (``.cpu()`` / ``.to("cpu")`` / ``.tolist()`` drop the tag),

and reports a tagged tensor's ``.device`` as ``cuda:<LOCAL_RANK>`` (so ``device=x.device`` keeps a tensor
on the device, as on a GPU). The runtime's device is ``cuda:<LOCAL_RANK>`` while the mode is on
(``parallel.runtime_device``). It then raises ``StrictDeviceError``

- at the model input: ``GPTModel.forward`` gets an untagged input tensor, or its parameters are untagged;
- at every collective (``torch.distributed`` functions and ``batch_isend_irecv``): a tensor on a
  device group (NCCL on GPU) is untagged, or a tensor on a host group (``parallel.host_group``, gloo) is
  tagged;
- at an op that mixes tagged and untagged tensors (CUDA rejects those too), except host scalars (0-dim)
  and host index tensors, which CUDA accepts.

Measured before this module: making ``meta`` the default device is not enough (embedding, matmul and
index_select accept a meta operand silently), hence the provenance tag.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from srpo_megatron.compat.cpu import (
    _is_cuda_device,
    cpu_compat_active,
    disable_cpu_compat,
    enable_cpu_compat,
    set_cuda_emulated,
)

TAG = "_srpo_on_device"
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
)
# Ops CUDA accepts with host operands: indexing with host indices, cross-device copies.
_CROSS_DEVICE_OK = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.index_put,
    torch.Tensor.copy_,
}
_HOST_OUT = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy}


class StrictDeviceError(RuntimeError):
    """A host tensor reached the model or a device collective (or a device tensor a host collective)."""


def on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and bool(t.__dict__.get(TAG, False))


def mark(t: torch.Tensor) -> torch.Tensor:
    t.__dict__[TAG] = True
    return t


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 2:
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif isinstance(obj, dict) and depth < 2:
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _device_index() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {list(t.shape)}"


class _Provenance(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.device and on_device(args[0]):
            return torch.device("cuda", _device_index())
        if owner is torch.Tensor.is_cuda and on_device(args[0]):
            return True
        out = func(*args, **kwargs)
        if func in _HOST_OUT:
            return _to_host(args[0], out)
        if func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, torch.Tensor):
                target = "cuda" if on_device(target) else "cpu"
            if target is not None and not isinstance(target, torch.dtype):
                return _moved(args[0], out) if _is_cuda_device(target) else _to_host(args[0], out)
        if func is torch.Tensor.cuda:
            return _moved(args[0], out)
        device = kwargs.get("device")
        if device is not None and not _is_cuda_device(device):
            return out  # an explicit host allocation (e.g. zeros_like(x, device="cpu")) stays on the host
        created = _is_cuda_device(device)
        inputs = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
        tagged = [t for t in inputs if on_device(t)]
        if tagged and _computes(func) and not _in_backward():
            host = [t for t in inputs if not on_device(t) and t.dim() > 0]
            if host:
                raise StrictDeviceError(
                    f"{getattr(func, '__name__', func)} mixes device tensors with a host "
                    f"{_describe(host[0])}; create it on the runtime's device or move it there once"
                )
        if created or tagged:
            _tag_outputs(out)
        return out


def _computes(func) -> bool:
    """An op that would run a kernel on its operands (not a descriptor, a private helper or indexing)."""
    if func in _CROSS_DEVICE_OK:
        return False
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return False
    return not (name.startswith("_") and not name.endswith("__"))


def _moved(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The result of a move to the device: a new tensor object (on a GPU the source stays on the host)."""
    if out is src and not on_device(src):
        with torch._C.DisableTorchFunction():
            out = out.view_as(out)
    return mark(out)


def _to_host(src: torch.Tensor, out: Any) -> Any:
    """The result of a move to the host: never the tagged source object itself."""
    if out is src and on_device(src):
        with torch._C.DisableTorchFunction():
            out = out.view_as(out)
    return out


def _tag_outputs(out: Any) -> Any:
    for t in _tensors(out):
        with contextlib.suppress(AttributeError, RuntimeError):
            mark(t)
    return out


def mark_module(module: torch.nn.Module) -> torch.nn.Module:
    """What ``module.cuda()`` does on a GPU: its parameters and buffers now live on the device."""
    for t in (*module.parameters(), *module.buffers()):
        mark(t)
    return module


def _in_backward() -> bool:
    """Inside autograd's backward: gradients are made by the engine (no torch function runs), and the
    engine itself keeps each gradient on its forward tensor's device, so nothing is checked there."""
    return torch._C._current_graph_task_id() != -1


def _check_collective(name: str, original, *args, **kwargs) -> None:
    from srpo_megatron.parallel import is_host_group

    if _in_backward():
        return

    try:
        bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = dict(kwargs)
    group = bound.get("group")
    tensors = [t for k, v in bound.items() if k != "group" for t in _tensors(v)]
    if is_host_group(group):
        bad = [t for t in tensors if on_device(t)]
        if bad:
            raise StrictDeviceError(f"dist.{name} on a host (gloo) group got a device {_describe(bad[0])}")
        return
    bad = [t for t in tensors if not on_device(t)]
    if bad:
        raise StrictDeviceError(
            f"dist.{name} on a device (NCCL) group got a host {_describe(bad[0])}; NCCL carries device "
            "tensors only: create it on the runtime's device, or send host objects over the gloo host group"
        )


def _wrap_collective(name: str, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        _check_collective(name, original, *args, **kwargs)
        return original(*args, **kwargs)

    return wrapper


def _wrap_batch_p2p(original):
    @functools.wraps(original)
    def wrapper(p2p_op_list, *args, **kwargs):
        for op in p2p_op_list:
            if not on_device(op.tensor):
                raise StrictDeviceError(f"batch_isend_irecv got a host {_describe(op.tensor)}")
        return original(p2p_op_list, *args, **kwargs)

    return wrapper


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        for name, p in self.named_parameters():
            if not on_device(p):
                raise StrictDeviceError(f"model parameter {name} is not on the device: move the model once")
        for t in (*_tensors(list(args)), *_tensors(kwargs)):
            if not on_device(t):
                raise StrictDeviceError(f"model input: a host {_describe(t)} reached GPTModel.forward")
        return original(self, *args, **kwargs)

    return forward


def _wrap_module_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        device = kwargs.get("device", args[0] if args else None)
        if device is not None and not isinstance(device, torch.dtype) and _is_cuda_device(device):
            mark_module(self)
        return out

    return to


@contextlib.contextmanager
def strict_device() -> Iterator[None]:
    """Run the block in strict-device mode (CPU only: needs the CUDA-as-CPU layer)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    was_active = cpu_compat_active()
    if not enable_cpu_compat():
        raise RuntimeError("strict_device() checks CPU runs; with CUDA present the real device checks")
    patches: list[tuple[Any, str, Any]] = [
        (dist, name, _wrap_collective(name, getattr(dist, name))) for name in _COLLECTIVES
    ]
    patches.append((dist, "batch_isend_irecv", _wrap_batch_p2p(dist.batch_isend_irecv)))
    patches.append((GPTModel, "forward", _wrap_forward(GPTModel.forward)))
    patches.append((torch.nn.Module, "to", _wrap_module_to(torch.nn.Module.to)))
    patches.append((torch.nn.Module, "cuda", lambda self, device=None: mark_module(self)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    set_cuda_emulated(True)
    mode = _Provenance()
    mode.__enter__()
    try:
        yield
    finally:
        mode.__exit__(None, None, None)
        set_cuda_emulated(False)
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
        if not was_active:
            disable_cpu_compat()
