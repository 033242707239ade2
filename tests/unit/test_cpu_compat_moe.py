"""The MoE shims of the CPU layer (srpo_megatron/compat/cpu.py), each with the upstream fact it exists for:
every ``*_upstream`` test fails once megatron-core / torch no longer need the shim, so it can be dropped.
"""

import inspect
import subprocess
import sys
from typing import ClassVar

import pytest
import torch

from srpo_megatron.compat import cpu as compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op with CUDA")


@pytest.fixture
def active():
    was_active = compat.cpu_compat_active()
    assert compat.enable_cpu_compat() is True
    yield
    if not was_active:
        compat.disable_cpu_compat()


# Whether megatron-core leaves ``moe_utils.te_general_gemm`` unbound without TE (the shim is needed):
# 0.16.1 does (its router raises NameError); 0.19.2 binds it itself (the shim must then bind nothing).
TE_GENERAL_GEMM_UNBOUND = {"0.16.1": True, "0.19.2": False}


def test_te_general_gemm_unbound_upstream_per_version_and_the_shim_routes_the_router_gemm(mcore_version):
    """A fresh process: on a version that needs it, megatron's router GEMM raises NameError without TE and
    after the shim it is x @ W^T; on a version that binds the name itself the shim binds nothing."""
    if mcore_version not in TE_GENERAL_GEMM_UNBOUND:
        pytest.skip(f"megatron-core {mcore_version} is not pinned in {sorted(TE_GENERAL_GEMM_UNBOUND)}")
    unbound = TE_GENERAL_GEMM_UNBOUND[mcore_version]
    code = """
import torch
from megatron.core.transformer.moe import moe_utils
torch.manual_seed(0)
x, w = torch.randn(5, 8).float(), torch.randn(3, 8).float()
try:
    moe_utils.router_gating_linear(x, w, None, torch.float32)
    print("no-error")
except NameError as e:
    print("NameError", "te_general_gemm" in str(e))
from srpo_megatron.compat.cpu import bind_missing_te_names
print("bound", bind_missing_te_names(), bind_missing_te_names())
out = moe_utils.router_gating_linear(x, w, None, torch.float64)
# the float64 product of the same float32 inputs: only the GEMM's summation order can differ
assert out.dtype == torch.float64 and torch.allclose(out, x.double() @ w.double().T, rtol=1e-12, atol=1e-12)
print("router-ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    if unbound:
        assert out.stdout.split() == ["NameError", "True", "bound", "True", "False", "router-ok"], out.stdout
    else:
        assert out.stdout.split() == ["no-error", "bound", "False", "False", "router-ok"], out.stdout


def test_alltoall_dispatcher_still_creates_a_cuda_stream_upstream(active):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert "torch.cuda.Stream()" in inspect.getsource(MoEAlltoAllTokenDispatcher.__init__)
    stream = torch.cuda.Stream()
    event = stream.record_event()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        event.synchronize()


def test_split_sizes_stay_tensors_upstream_and_become_numpy_under_the_shim(active):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    sizes = torch.tensor([3, 5])
    assert torch.is_tensor(moe_utils.maybe_move_tensor_to_cpu(sizes, as_numpy=True))  # the upstream fact
    shimmed = token_dispatcher.maybe_move_tensor_to_cpu(sizes, as_numpy=True)
    assert not torch.is_tensor(shimmed) and list(shimmed) == [3, 5]
    assert torch.is_tensor(token_dispatcher.maybe_move_tensor_to_cpu(sizes))


class _AllocatesOnCurrentDevice(torch.autograd.Function):
    """Like megatron's all-to-all / reduce-scatter backward: allocates on ``torch.cuda.current_device()``."""

    seen: ClassVar[dict] = {}

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _AllocatesOnCurrentDevice.seen["mode_active"] = torch._C._is_torch_function_mode_enabled()
        out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
        return out.copy_(grad * 2)


@pytest.mark.parametrize("how", ["autograd.backward", "Tensor.backward", "autograd.grad"])
def test_backward_runs_outside_the_mode_upstream_and_allocates_on_cpu(active, how):
    x = torch.ones(3, requires_grad=True)
    y = _AllocatesOnCurrentDevice.apply(x).sum()
    if how == "autograd.backward":
        torch.autograd.backward(y)
    elif how == "Tensor.backward":
        y.backward()
    else:
        (x.grad,) = torch.autograd.grad(y, x)
    assert _AllocatesOnCurrentDevice.seen["mode_active"] is False  # the upstream fact: the mode is popped
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert torch.cuda.current_device() == 0  # outside a backward megatron still gets its ordinal


def test_patched_stream_and_event_are_types_so_import_time_annotations_work():
    """transformers' continuous batching evaluates ``torch.cuda.Stream | None`` at import; with the layer on
    (as in `srpo train`, which enables it before the rollout engine loads its HF model), a factory function
    in place of the class made that import raise ``TypeError: unsupported operand type(s) for |``."""
    code = """
import torch
from srpo_megatron.compat.cpu import enable_cpu_compat
enable_cpu_compat()
assert isinstance(torch.cuda.Stream, type) and isinstance(torch.cuda.Event, type)
torch.cuda.Stream | None, torch.cuda.Event | None
import transformers.generation.continuous_batching.utils  # noqa: F401  (annotations evaluated here)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
