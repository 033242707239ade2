"""``models.lora.lora_delta`` computes each projection's adapter as PEFT's layer does, GEMM for GEMM: a
fused linear's ``x A_pᵀ`` are separate ``[*, r]`` products, never one ``[*, n·r]`` product over the
concatenated A, whose sum order can depend on the width (on AVX2 CPUs it differs by ~1e-5, which broke
``rollout.true_on_policy_mode``'s bit-equal log-probs with LoRA adapters). Checked by the shapes of the
products, so it holds on any CPU, and by the values against PEFT-style ``F.linear`` calls, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from srpo_megatron.models.lora import LoraPair, LoraPlan, lora_delta

RANK, HIDDEN = 4, 64
QKV = ("q_proj", "k_proj", "v_proj")
ROWS = [32, 16, 16]  # q, k, v output rows; one query group


class _Products(TorchFunctionMode):
    """Records the right operand's shape of every matmul / linear in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.widths.append(args[1].shape[-1])
        return func(*args, **kwargs)


def _adapters(generator: torch.Generator) -> torch.nn.ModuleDict:
    like = torch.empty(0)
    shapes = zip(QKV, ROWS, strict=True)
    pairs = torch.nn.ModuleDict({p: LoraPair((RANK, HIDDEN), (rows, RANK), like) for p, rows in shapes})
    for pair in pairs.values():
        with torch.no_grad():
            pair.lora_A.copy_(torch.randn(pair.lora_A.shape, generator=generator))
            pair.lora_B.copy_(torch.randn(pair.lora_B.shape, generator=generator))
    return pairs


def _plan() -> LoraPlan:
    return LoraPlan("column", QKV, ROWS, 1, 2.0, 0.0, 1, None, False, False, False)


def _check(delta_fn) -> None:
    g = torch.Generator().manual_seed(0)
    adapters, x = _adapters(g), torch.randn(40, 2, HIDDEN, generator=g)
    with _Products() as seen:
        delta = delta_fn(adapters, _plan(), x)
    a_products = [w for w in seen.widths if w not in ROWS]
    assert a_products == [RANK] * len(QKV), seen.widths  # x A_pᵀ: one [*, r] product per projection
    peft = [F.linear(F.linear(x, adapters[p].lora_A), adapters[p].lora_B) * 2.0 for p in QKV]
    assert torch.equal(delta, torch.cat(peft, dim=-1))


def test_each_projection_is_its_own_gemm_and_equals_peft_bit_for_bit():
    _check(lora_delta)


def test_planted_fused_a_gemm_is_caught():
    """The old computation, one GEMM over cat(A_q, A_k, A_v): the shape check fails on any CPU."""

    def fused(adapters, plan, x):
        h = x @ torch.cat([adapters[p].lora_A for p in plan.projections]).t()
        hs = h.chunk(len(plan.projections), dim=-1)
        pieces = [c @ adapters[p].lora_B.t() for p, c in zip(plan.projections, hs, strict=True)]
        return torch.cat(pieces, dim=-1) * plan.scaling

    with pytest.raises(AssertionError, match=r"\[12, "):
        _check(fused)
