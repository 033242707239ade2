"""Each behaviour of the CUDA-as-CPU layer (srpo_megatron/compat/cpu.py), one test each.

These fail if the layer stops covering something megatron-core calls, or if it changes numerics.
"""

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


def test_current_device_and_cuda_factories_land_on_cpu(active):
    assert torch.cuda.current_device() == 0
    for device in ("cuda", "cuda:0", 0, torch.device("cuda"), torch.cuda.current_device()):
        t = torch.empty(3, device=device)
        assert t.device.type == "cpu"
    assert torch.zeros(2, device="cuda").sum().item() == 0.0
    x = torch.ones(2)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.to(torch.cuda.current_device()).device.type == "cpu"
    assert x.to(device="cuda", dtype=torch.float64).dtype == torch.float64


def test_cuda_default_device_blocks_run_on_cpu(active):
    """megatron's YarnRotaryEmbedding (MLA) builds its frequencies under ``with torch.device(0):``."""
    for device in (torch.cuda.current_device(), "cuda"):
        with torch.device(device):
            t = torch.arange(4, dtype=torch.float32)
        assert t.device.type == "cpu"


def test_bare_type_answers_cuda_name_but_type_conversion_still_works(active):
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    converted = torch.ones(1).type(torch.float64)
    assert converted.dtype == torch.float64 and converted.device.type == "cpu"


def test_synchronize_is_a_noop(active):
    torch.cuda.synchronize()


def test_rng_functions_use_a_private_generator_and_leave_cpu_rng_alone(active):
    cpu_state = torch.get_rng_state()
    torch.cuda.manual_seed(123)
    s1 = torch.cuda.get_rng_state()
    torch.cuda.random.manual_seed(7)
    assert not torch.equal(torch.cuda.random.get_rng_state(), s1)
    torch.cuda.set_rng_state(s1)
    assert torch.equal(torch.cuda.get_rng_state(), s1)
    assert torch.equal(torch.get_rng_state(), cpu_state), "the CPU generator must not be touched"


def test_megatron_rng_tracker_add_and_fork(active):
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 11)
    before = torch.cuda.get_rng_state()
    with tracker.fork("a"):
        inside = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(999)  # changes the forked state, which fork() must store on exit
    assert torch.equal(torch.cuda.get_rng_state(), before), "fork must restore the outer state"
    assert not torch.equal(inside, before)
    assert not torch.equal(tracker.get_states()["a"], inside)


def test_layer_never_changes_numerics():
    def compute():
        g = torch.Generator().manual_seed(0)
        a = torch.randn(64, 64, generator=g, dtype=torch.float32)
        b = torch.randn(64, 64, generator=g)
        return torch.softmax(a @ b, -1).sum(0)

    reference = compute()
    was_active = compat.cpu_compat_active()
    compat.enable_cpu_compat()
    try:
        assert torch.equal(compute(), reference)
    finally:
        if not was_active:
            compat.disable_cpu_compat()


def test_noop_when_cuda_is_available(monkeypatch):
    was_active = compat.cpu_compat_active()
    if was_active:
        compat.disable_cpu_compat()
    original = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compat.enable_cpu_compat() is False
    assert not compat.cpu_compat_active()
    assert torch.cuda.current_device is original
    monkeypatch.undo()
    if was_active:
        compat.enable_cpu_compat()


def test_disable_restores_everything():
    was_active = compat.cpu_compat_active()
    if was_active:
        compat.disable_cpu_compat()
    original = torch.cuda.current_device
    compat.enable_cpu_compat()
    compat.disable_cpu_compat()
    assert torch.cuda.current_device is original
    assert torch.ones(1).type() == "torch.FloatTensor"
    if was_active:
        compat.enable_cpu_compat()


def test_current_stream_waits_are_noops_and_restored():
    """megatron-core 0.19's DDP grad sync calls ``torch.cuda.current_stream().wait_event(...)``
    (tests/unit/test_mcore_versions.py pins that call per version)."""
    was_active = compat.cpu_compat_active()
    original = torch.cuda.current_stream
    compat.enable_cpu_compat()
    try:
        stream = torch.cuda.current_stream()
        stream.wait_event(object())
        stream.wait_stream(torch.cuda.current_stream())
        stream.synchronize()
    finally:
        if not was_active:
            compat.disable_cpu_compat()
    if not was_active:
        assert torch.cuda.current_stream is original
