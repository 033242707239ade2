"""Blockwise-FP8 HF folders (DeepSeek-V3, Kimi-K2, Qwen3-FP8): reading one (its layout, the checks that
refuse a folder that does not match it, the dequantization, streamed row block by row block) and writing
one (``tools/convert_megatron_to_hf.py --fp8``: :class:`Fp8Export`).

The format (``ops/fp8_blocks.py``): each FP8 weight ``<name>`` is ``float8_e4m3fn`` ``[rows, cols]`` with
``<name>_scale_inv`` ``[ceil(rows / br), ceil(cols / bc)]`` (``br x bc``: the config's
``weight_block_size``), edge blocks partial. Which weights are FP8: ``Fp8Layout`` (``fp8_layout.py``), the
rule SGLang's engine applies too.

Dequantization is the references' arithmetic exactly: the FP8 value widened to float32, times the block's
float32 scale (one float32 product, rounded once), then one rounding to the output dtype. Checked against:
DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant_kernel`` (``x.to(float32) * s``, stored into a
tensor of the default dtype, bf16 in its ``fp8_cast_bf16.py``; deepseek-ai/DeepSeek-V3 at 4a65fd92) and
SGLang's ``block_quant_dequant`` (``sglang/srt/layers/quantization/fp8_utils.py``, 0.5.23:
``(x_q.to(float32) * x_s.repeat_interleave(...)[:n, :k]).to(dtype)``), which ``tests/sglang_real/
test_sglang_fp8_dequant.py`` runs against this module bit for bit. slime's FP8 tooling
(THUDM/slime ``tools/convert_hf_to_fp8.py``) writes the same format (``amax / 448`` scales, partial
blocks padded with zeros).

Streaming: :func:`dequantize_weight` fills its output a few row blocks at a time, so besides the output
(the size of the weight in the conversion dtype) it holds one chunk's int32 lookup index (<= 1 MiB) and
a few cached index offsets (<= 8 MiB), not a float32 copy of the weight.

Export re-quantizes with ``ops/fp8_blocks.quantize`` (DeepGEMM's ``per_block_cast_to_fp8``, the
convention of the hub's scales). Round trip (``tests/unit/test_fp8_folder.py``, and the tiny DeepSeek in
``tests/dist/test_deepseek_fp8_import.py``): for blocks that quantizer made, ``quantize(dequantize(q, s))``
gives the codes ``q`` back bit for bit always, and the scales ``s`` too when the quantized weights were
bf16 (the hub's case: ``448 * s`` is then the block's bf16 amax) through a bf16 or fp32 import, or fp32
through an fp32 import (measured: every one of 1,024 random blocks; it rests on
``fl(fl(448 * s) / 448) == s``, not proven for every ``s``). Not exact: fp32-made scales through a bf16
import (they move by up to one bf16 rounding of the amax, relative 2**-8), and FP8 folders made by another
quantizer (another amax floor or rounding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.conversion.output_guard import ConversionInputError
from srpo_megatron.ops import fp8_blocks

FP8_DTYPE_NAMES = ("F8_E4M3", "F8_E5M2")  # safetensors' names of the float8 dtypes


def layout_of(config: dict[str, Any], where: str) -> Fp8Layout | None:
    """The blockwise-FP8 layout of an HF ``config.json`` (``where`` names it in refusals); None when it
    has no FP8 ``quantization_config``."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    return Fp8Layout.from_quantization_config(qc, where)


# Every float8_e4m3fn value by its code (0..255, NaN codes included), widened to float32.
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
# Elements dequantized per table lookup: a few row blocks at once, so a small expert weight is one call,
# and the int32 index of the chunk (4 bytes an element) stays small next to the weight.
_CHUNK = 1 << 18


def dequantize_weight(
    name: str, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``q`` (float8_e4m3fn ``[rows, cols]``) times its block scales, as ``dtype``: bit for bit
    ``ops/fp8_blocks.dequantize``, a few row blocks at a time.

    By table lookup: a block has one scale and 256 possible codes, so its 256 products ``value(c) * s``
    (float32, rounded once to ``dtype``: the reference's two roundings, on the same operands) are formed
    once, and each element is its code's entry. Same bits as widening every element and multiplying
    (``tests/unit/test_fp8_folder.py`` checks every code, NaNs included, and partial blocks); it saves
    the float8 -> float32 conversion, which torch does one element at a time (~4 ns an element here,
    against ~1 for the lookup)."""
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ConversionInputError(
            f"{name} is {q.dtype} {tuple(q.shape)}, but quantization_config says it is blockwise FP8 "
            "(a 2-D float8_e4m3fn weight with a weight_scale_inv): the folder does not match its config.json"
        )
    rows, cols = q.shape
    br = block[0]
    check_scale_shape(name, (rows, cols), tuple(scale_inv.shape), block)
    out = torch.empty((rows, cols), dtype=dtype)
    if not out.numel():
        return out
    scale = scale_inv.float()
    codes = q.view(torch.uint8)
    step = max(1, _CHUNK // (br * cols)) * br  # rows per chunk: whole row blocks
    offsets = _table_offsets(min(step, rows), cols, block)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        b0, b1 = lo // br, -(-hi // br)
        # [blocks of the chunk, 256]: each block's products, in the chunk's block order (row-major)
        table = (scale[b0:b1].reshape(-1, 1) * _E4M3_VALUES).to(dtype).reshape(-1)
        index = torch.add(codes[lo:hi], offsets[: hi - lo])  # uint8 + int32: the entry of each element
        torch.index_select(table, 0, index.view(-1), out=out[lo:hi].view(-1))
    return out


@functools.lru_cache(maxsize=8)
def _table_offsets(rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """int32 ``[rows, cols]``: 256 x the index of each element's block within a chunk of ``rows`` rows
    (row-major over the chunk's ``ceil(rows / br) x ceil(cols / bc)`` blocks). Cached: an MoE's experts
    share a few shapes."""
    br, bc = block
    grid_cols = -(-cols // bc)
    row_block = torch.arange(rows, dtype=torch.int32) // br
    col_block = torch.arange(cols, dtype=torch.int32) // bc
    return (row_block[:, None] * grid_cols + col_block[None, :]) * 256


def check_scale_shape(
    name: str, shape: tuple[int, int], scale_shape: tuple[int, ...], block: tuple[int, int]
) -> None:
    """Refuse a ``weight_scale_inv`` that does not hold one scale per ``block`` of ``shape`` (saying so
    when it is the transposed grid)."""
    want = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    if tuple(scale_shape) == want:
        return
    why = "it is transposed" if tuple(scale_shape) == want[::-1] else "wrong shape"
    raise ConversionInputError(
        f"{Fp8Layout.scale_name(name)} has shape {list(scale_shape)}, but a {shape[0]}x{shape[1]} weight in "
        f"{block[0]}x{block[1]} blocks (quantization_config.weight_block_size) needs {list(want)} ({why}): "
        "the folder does not match its config.json; copy the model again or fix weight_block_size"
    )


def check_fp8_folder(
    layout: Fp8Layout | None,
    fp8_names: list[str],
    dtypes: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    where: str,
) -> None:
    """Before any tensor is read: every FP8 weight of the layout (``fp8_names``: the conversion table's
    names the layout keeps in FP8) is float8_e4m3fn with a scale of the block grid's shape, and no other
    tensor is float8 or has a scale. ``dtypes``: safetensors dtype names of the folder's tensors (headers
    only); ``shapes``: their shapes."""
    for name in fp8_names:
        scale = Fp8Layout.scale_name(name)
        if name in dtypes and dtypes[name] != "F8_E4M3":
            raise ConversionInputError(
                f"{where}: {name} is {dtypes[name]}, but quantization_config says it is FP8 (float8_e4m3fn "
                f"with {scale}): the folder does not match its config.json; copy the model again"
            )
        if name in dtypes and scale not in dtypes:
            raise ConversionInputError(
                f"{where}: {name} is float8_e4m3fn but the folder has no {scale}: without its block scales "
                "the weight cannot be dequantized; copy the model again"
            )
        if scale in shapes and name in shapes:
            check_scale_shape(name, shapes[name][:2], shapes[scale], layout.block)
    expected = set(fp8_names)
    for name, dt in dtypes.items():
        if dt in FP8_DTYPE_NAMES and name not in expected:
            what = "it is not FP8 in the layout"
            if layout is None:
                what = "config.json has no FP8 quantization_config"
            raise ConversionInputError(
                f"{where}: {name} is {dt} but {what}, so it has no weight_scale_inv to dequantize it with; "
                "restore the folder's config.json (quantization_config) or convert its bf16 release"
            )
    for name in dtypes:
        if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") not in expected:
            raise ConversionInputError(
                f"{where}: {name} scales a weight that quantization_config keeps in bf16 (the layout of "
                "conversion/fp8_layout.py, modules_to_not_convert / ignored_layers): fix the config's lists"
            )


@dataclass
class Fp8Export:
    """What ``megatron_to_hf(fp8=True)`` writes: the layout's weights as float8_e4m3fn + float32
    ``weight_scale_inv``, and the ``quantization_config`` of ``config.json``."""

    layout: Fp8Layout
    quantization_config: dict[str, Any]
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # filled by plan()

    @classmethod
    def of(cls, config: dict[str, Any], where: str, progress: Callable[[str], None]) -> Fp8Export:
        """The source's own FP8 layout and quantization_config when ``config`` has one (the converter keeps
        it in hf_config.json), else DeepSeek-V3's: 128x128 blocks, every projection of the layers."""
        if config.get("model_type") == "gpt_oss":
            raise ConversionInputError(
                f"{where}: --fp8 writes blockwise FP8 (DeepSeek-V3's format), which gpt-oss's fused experts "
                "do not have; export gpt-oss without --fp8 (bf16)"
            )
        layout = layout_of(config, where)
        if layout is None:
            block = list(fp8_blocks.BLOCK)
            qc = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": block,
            }
            return cls(Fp8Layout(block=fp8_blocks.BLOCK), qc)
        qc = dict(config["quantization_config"])
        if qc.pop("scale_fmt", None) is not None:
            progress(
                "the source's scale_fmt is dropped: the exported scales are amax / 448, not powers of two"
            )
        return cls(layout, qc)

    def plan(self, table: Any) -> list[tuple[str, tuple[int, ...]]]:
        """The export plan of ``table`` (a ``ConversionTable``) with this layout; records the FP8 and scale
        tensors' dtypes."""
        plan = table.hf_file_plan(self.layout)
        for name, _ in plan:
            if name.endswith("_scale_inv"):
                self.dtypes[name] = torch.float32
            elif self.layout.is_fp8(name):
                self.dtypes[name] = torch.float8_e4m3fn
        return plan

    def tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(name, q), (scale name, s)]`` for an FP8 weight of the layout (quantized from the stored
        values, not from an intermediate cast), ``[]`` for any other tensor."""
        if not self.layout.is_fp8(name):
            return []
        q, s = fp8_blocks.quantize(tensor, self.layout.block)
        return [(name, q), (Fp8Layout.scale_name(name), s)]


def mtp_tensors(
    names: list[str],
    reader: Any,
    source: Fp8Layout | None,
    out: Fp8Layout | None,
    dtype: torch.dtype,
) -> list[tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]]:
    """The MTP tensors an export writes, ``(name, shape, dtype, read)``, from the HF folder ``reader``
    (``HFCheckpointReader``) whose MTP tensors are ``names``: unchanged when source and export agree; an
    FP8 source's weights dequantized (scales dropped) into a bf16 export's ``dtype``; a bf16 source's
    layout weights quantized for an FP8 export, so the folder matches its quantization_config."""
    present, plan = set(names), []
    for name in names:
        shape, scale = reader.shape(name), Fp8Layout.scale_name(name)
        if name.endswith("_scale_inv") and out is None:
            continue  # dropped with the dequantized weight
        if scale in present and out is None:  # FP8 source, bf16 export
            block = source.block if source is not None else fp8_blocks.BLOCK

            def read(n=name, sc=scale, b=block):
                return fp8_blocks.dequantize(reader.get(n), reader.get(sc), b, dtype)

            plan.append((name, shape, dtype, read))
        elif (
            out is not None and scale not in present and not name.endswith("_scale_inv") and out.is_fp8(name)
        ):
            grid = (-(-shape[0] // out.block[0]), -(-shape[1] // out.block[1]))
            plan.append(
                (
                    name,
                    shape,
                    torch.float8_e4m3fn,
                    lambda n=name: fp8_blocks.quantize(reader.get(n), out.block)[0],
                )
            )
            plan.append(
                (scale, grid, torch.float32, lambda n=name: fp8_blocks.quantize(reader.get(n), out.block)[1])
            )
        else:
            stored = reader.get(name)
            plan.append((name, shape, stored.dtype, lambda n=name: reader.get(n)))
    return plan


__all__ = [
    "Fp8Export",
    "check_fp8_folder",
    "check_scale_shape",
    "dequantize_weight",
    "layout_of",
    "mtp_tensors",
]
