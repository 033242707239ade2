"""The converter's FP8 dequantization against SGLang's own ``block_quant_dequant``
(``sglang/srt/layers/quantization/fp8_utils.py``, marker ``sglang_real``): bit for bit, in bf16 and fp32,
for 128x128 and non-square blocks with partial edge blocks (``conversion/fp8_folder.py``)."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.conversion.fp8_folder import dequantize_weight
from srpo_megatron.ops import fp8_blocks
from srpo_megatron.testing import sglang_import

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )


@pytest.mark.parametrize("block", [(128, 128), (16, 24)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantization_is_sglangs_block_quant_dequant(block, dtype):
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3)) * 2
    q, s = fp8_blocks.quantize(w, block)
    ours = dequantize_weight("w", q, s, block, dtype)
    theirs = block_quant_dequant(q, s, list(block), dtype)
    assert theirs.dtype == dtype and torch.equal(ours, theirs)
