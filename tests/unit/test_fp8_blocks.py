"""Blockwise e4m3 quantization (ops/fp8_blocks.py) against an independent per-block loop."""

import pytest
import torch

from srpo_megatron.ops import fp8_blocks


def _reference(w: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Quantize + dequantize one block at a time (float64 amax, DeepGEMM's clamp and 448 factor)."""
    out = torch.empty_like(w, dtype=torch.float32)
    for i in range(0, w.shape[0], br):
        for j in range(0, w.shape[1], bc):
            b = w[i : i + br, j : j + bc].float()
            amax = max(float(b.double().abs().max()), 1e-4)
            q = (b * (448.0 / amax)).to(torch.float8_e4m3fn)
            out[i : i + br, j : j + bc] = q.float() * (amax / 448.0)
    return out


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (5, 7), (257, 129)])
def test_round_trip_equals_per_block_reference_with_edge_blocks(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    q, s = fp8_blocks.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    torch.testing.assert_close(fp8_blocks.dequantize(q, s), _reference(w, 128, 128), rtol=0, atol=0)


def test_zero_block_uses_the_amax_floor_and_stays_zero():
    w = torch.zeros(130, 4)
    w[129, 0] = 1.0
    q, s = fp8_blocks.quantize(w)
    assert float(s[0, 0]) == pytest.approx(1e-4 / 448.0)
    assert float(s[1, 0]) == pytest.approx(1.0 / 448.0)
    assert torch.equal(fp8_blocks.dequantize(q, s), w)


def test_transposed_scale_is_refused_naming_the_shapes():
    q, s = fp8_blocks.quantize(torch.randn(300, 130))
    with pytest.raises(ValueError, match="transposed"):
        fp8_blocks.dequantize(q, s.t().contiguous())
