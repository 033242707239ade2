"""The strict-device mode's rules on plain tensors (megatron runs: tests/dist/test_strict_device.py)."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.strict_device import StrictDeviceError, on_device, strict_device

pytestmark = pytest.mark.strict_device


def test_provenance_follows_creation_moves_and_ops():
    with strict_device():
        dev = torch.zeros(3, device="cuda")
        host = torch.ones(3)
        moved = host.to("cuda")
        assert on_device(dev) and on_device(moved) and not on_device(host)
        assert moved is not host, "a move must not turn the host tensor itself into a device tensor"
        assert dev.device.type == "cuda" and host.device.type == "cpu"
        assert on_device(dev * 2 + moved) and on_device(torch.zeros(2, device=dev.device))
        assert not on_device(dev.cpu()) and not on_device(torch.zeros_like(dev, device="cpu"))
        assert on_device(dev + torch.tensor(1.0)), "host scalars mix with device tensors, as on CUDA"
        assert on_device(dev[torch.tensor([0, 2])]), "host index tensors are accepted, as on CUDA"


def test_mixing_a_host_tensor_into_a_device_op_raises():
    with strict_device(), pytest.raises(StrictDeviceError, match="mixes device tensors with a host"):
        torch.zeros(3, device="cuda") + torch.ones(3)


def test_a_module_moved_to_the_device_has_device_parameters():
    with strict_device():
        m = torch.nn.Linear(2, 2)
        assert not on_device(m.weight)
        m.to(torch.device("cuda", 0))
        assert on_device(m.weight) and on_device(m.bias)
        assert on_device(m(torch.ones(1, 2, device="cuda")))
