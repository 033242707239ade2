"""Blockwise FP8 (e4m3) quantization of 2-D weights, DeepSeek-V3's checkpoint convention.

Format (DeepSeek-V3's ``inference/kernel.py::weight_dequant`` and SGLang's block-FP8 linear method):
- ``weight`` ``float8_e4m3fn`` ``[rows, cols]``;
- ``weight_scale_inv`` ``float32`` ``[ceil(rows / br), ceil(cols / bc)]``, one scale per ``br x bc``
  block (``quantization_config.weight_block_size``, ``[128, 128]`` on every hub checkpoint); the
  dequantized block is ``weight.float() * weight_scale_inv`` (the name says "inverse" because it is
  the inverse of the factor the quantizer multiplied by);
- edge blocks are partial: a dimension that is not a multiple of the block size keeps its last,
  smaller block, whose scale covers only the rows/columns that exist.

Quantization follows DeepGEMM's ``per_block_cast_to_fp8`` (which SGLang's tests and slime's FP8
converter use): ``amax`` per block clamped below at 1e-4, ``q = (w * (448 / amax)).to(e4m3)``,
``scale_inv = amax / 448``. 448 is e4m3fn's largest finite value.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
BLOCK = (128, 128)


def _grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """One scale per block -> one per element ``[rows, cols]`` (edge blocks cropped)."""
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[rows, cols]`` (any float dtype) -> ``(float8_e4m3fn weight, float32 scale_inv)``."""
    if weight.dim() != 2:
        raise ValueError(
            f"fp8 block quantization takes a 2-D weight, got shape {tuple(weight.shape)}; "
            "quantize each expert / matrix separately"
        )
    rows, cols = weight.shape
    gr, gc = _grid((rows, cols), block)
    padded = weight.new_zeros((gr * block[0], gc * block[1]), dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    view = padded.view(gr, block[0], gc, block[1])
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    q = (view * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
    q = q.view(gr * block[0], gc * block[1])[:rows, :cols].contiguous()
    return q, (amax / E4M3_MAX).view(gr, gc)


def dequantize(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(float8 weight [rows, cols], scale_inv [ceil(rows/br), ceil(cols/bc)])`` -> ``dtype`` weight.

    The product is formed in float32 (DeepSeek's ``weight_dequant`` kernel), then cast to ``dtype``.
    """
    shape = (q.shape[0], q.shape[1])
    expected = _grid(shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)} but a {shape[0]}x{shape[1]} weight in "
            f"{block[0]}x{block[1]} blocks needs {expected}; check quantization_config.weight_block_size "
            "and that the scale is not transposed"
        )
    return (q.float() * _expand(scale_inv.float(), shape, block)).to(dtype)


def fake_quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """``dequantize(quantize(weight))`` in ``weight``'s dtype: what an FP8 engine computes with."""
    q, s = quantize(weight, block)
    return dequantize(q, s, block, dtype=weight.dtype)
