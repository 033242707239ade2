"""MXFP4 (OCP Microscaling: FP4 E2M1 elements, E8M0 block scales) -> dense tensors, for gpt-oss experts.

Format (the OCP MX spec v1.0; gpt-oss checkpoints store it as two tensors per expert weight):
- ``<name>_blocks`` uint8 ``[..., rows, G, 16]``: each byte packs two FP4 E2M1 codes, the LOW nibble the
  even element, the HIGH nibble the odd one, so a row of ``G`` blocks holds ``G * 32`` values;
- ``<name>_scales`` uint8 ``[..., rows, G]``: one E8M0 exponent per 32-value block, bias 127
  (the block's values are multiplied by ``2 ** (scale - 127)``);
- an E2M1 code is sign bit (8) + 3 magnitude bits: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

gpt-oss stores ``mlp.experts.gate_up_proj_blocks`` ``[E, 2F, H/32, 16]`` and ``down_proj_blocks``
``[E, H, F/32, 16]``: rows are the OUTPUT features, the reverse of the bf16 tensors ``gate_up_proj``
``[E, H, 2F]`` / ``down_proj`` ``[E, F, H]``; :func:`dequantize_expert` returns one expert in the bf16
orientation. Every FP4 value times a power of two is exact in bf16 and fp32 (E2M1 has 2 significant
bits), so the dequantized weights are the checkpoint's values exactly for scales within bf16's range.
"""

from __future__ import annotations

import torch

# The 16 E2M1 codes: bit 3 sign, bits 0-2 magnitude.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK = 32  # values per scale


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``blocks`` uint8 ``[..., G, 16]``, ``scales`` uint8 ``[..., G]`` -> ``[..., G * 32]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: blocks "
            f"must be [..., G, {BLOCK // 2}] with scales [..., G]"
        )
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    low, high = (blocks & 0x0F).long(), (blocks >> 4).long()
    values = torch.stack([lut[low], lut[high]], dim=-1).reshape(*blocks.shape[:-1], BLOCK)  # [..., G, 32]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponent[..., None])
    return values.reshape(*scales.shape[:-1], -1).to(dtype)


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """One expert's ``[out, G, 16]`` blocks and ``[out, G]`` scales -> the bf16 checkpoint's ``[in, out]``."""
    return dequantize(blocks, scales, dtype).transpose(0, 1).contiguous()
