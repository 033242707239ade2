"""MXFP4 dequantization from the format (conversion/mxfp4.py): hand-made blocks and scales, known values."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.conversion.mxfp4 import dequantize, dequantize_expert


def _block(codes: list[int]) -> list[int]:
    """32 FP4 codes -> 16 bytes: element 2j in the low nibble, 2j+1 in the high nibble."""
    return [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]


def test_known_codes_and_scales_dequantize_exactly():
    # codes 0..15 twice: +0 .5 1 1.5 2 3 4 6, then the same magnitudes negative
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = list(range(16)) * 2
    values = [(-1 if c & 8 else 1) * magnitudes[c & 7] for c in codes]
    blocks = torch.tensor([[_block(codes), _block(codes[::-1])]], dtype=torch.uint8)  # [1, G=2, 16]
    scales = torch.tensor([[128, 125]], dtype=torch.uint8)  # x2 and x1/4
    want = torch.tensor([[v * 2.0 for v in values] + [v * 0.25 for v in values[::-1]]])
    got = dequantize(blocks, scales, torch.float32)
    assert got.shape == (1, 64)
    assert torch.equal(got, want)
    assert torch.equal(dequantize(blocks, scales), want.to(torch.bfloat16))  # exact in bf16 too


def test_nibble_order_low_first():
    """Byte 0x21 holds 0.5 (code 1, low nibble, even element) then 1.0 (code 2, high nibble)."""
    blocks = torch.full((1, 16), 0x21, dtype=torch.uint8)
    got = dequantize(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)
    assert got[:4].tolist() == [0.5, 1.0, 0.5, 1.0]


def test_expert_orientation_is_the_bf16_checkpoint_layout():
    """Hub blocks are [out, G, 16] (rows = output features); the bf16 tensor of one expert is [in, out]."""
    out_features, in_features = 3, 64
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (out_features, in_features // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (out_features, in_features // 32), generator=gen, dtype=torch.uint8)
    dense = dequantize(blocks, scales, torch.float32)  # [out, in]
    got = dequantize_expert(blocks, scales, torch.float32)
    assert got.shape == (in_features, out_features)
    assert torch.equal(got, dense.T)
    # element (row r, value k) comes from byte k // 2 of block k // 32, nibble k % 2, times its block's scale
    r, k = 2, 45
    byte = int(blocks[r, k // 32, (k % 32) // 2])
    code = (byte >> 4) if k % 2 else (byte & 0x0F)
    magnitude = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][code & 7]
    want = (-1 if code & 8 else 1) * magnitude * 2.0 ** (int(scales[r, k // 32]) - 127)
    assert got[k, r].item() == want


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
