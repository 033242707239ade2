"""Blockwise-FP8 HF folders for the conversion tests, made by an independent reference: a per-block Python
loop (DeepSeek-V3's ``amax / 448`` scales, DeepGEMM's ``per_block_cast_to_fp8`` convention; partial edge
blocks are their own, smaller blocks), not ``ops/fp8_blocks``, and the reference dequantization the
imported weights must equal bit for bit (per block: ``q.float() * s`` in float32, then one rounding)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from srpo_megatron.conversion.fp8_layout import Fp8Layout
from tests.helpers.conversion import read_hf_tensors

E4M3_MAX = 448.0


def _blocks(shape: tuple[int, int], block: tuple[int, int]):
    for i in range(0, shape[0], block[0]):
        for j in range(0, shape[1], block[1]):
            yield i // block[0], j // block[1], slice(i, i + block[0]), slice(j, j + block[1])


def reference_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [rows, cols] -> (float8_e4m3fn q, float32 scale_inv [ceil(rows/br), ceil(cols/bc)]), block by
    block."""
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    s = torch.empty((-(-rows // block[0]), -(-cols // block[1])), dtype=torch.float32)
    for bi, bj, r, c in _blocks((rows, cols), block):
        blk = w[r, c].float()
        amax = torch.clamp(blk.abs().max(), min=1e-4)
        q[r, c] = (blk * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
        s[bi, bj] = amax / E4M3_MAX
    return q, s


def reference_dequantize(
    q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Per block: ``q.float() * s[block]`` in float32, rounded once to ``dtype``."""
    out = torch.empty(q.shape, dtype=dtype)
    for bi, bj, r, c in _blocks(tuple(q.shape), block):
        out[r, c] = (q[r, c].float() * s[bi, bj].float()).to(dtype)
    return out


def write_fp8_folder(
    bf16_dir: Path, fp8_dir: Path, ref_dir: Path, block: tuple[int, int], extra_qc: dict | None = None
) -> dict[str, torch.Tensor]:
    """From the bf16 HF folder ``bf16_dir``: ``fp8_dir``, the same model as a blockwise-FP8 hub folder
    (``Fp8Layout``'s weights quantized by :func:`reference_quantize`, a ``quantization_config``), and
    ``ref_dir``, the bf16 folder an exact import of it must equal (FP8 weights replaced by their
    :func:`reference_dequantize`). Returns the FP8 folder's tensors."""
    config = json.loads((bf16_dir / "config.json").read_text())
    qc = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    qc.update(extra_qc or {})
    layout = Fp8Layout.from_quantization_config(qc, "test")
    fp8, ref = {}, {}
    for name, t in read_hf_tensors(bf16_dir).items():
        if layout.is_fp8(name):
            q, s = reference_quantize(t, block)
            fp8[name], fp8[Fp8Layout.scale_name(name)] = q, s
            ref[name] = reference_dequantize(q, s, block, t.dtype)
        else:
            fp8[name] = ref[name] = t
    for out, tensors, cfg in ((fp8_dir, fp8, {**config, "quantization_config": qc}), (ref_dir, ref, config)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        for asset in bf16_dir.glob("*.json"):
            if asset.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(asset, out / asset.name)
    return fp8


def save_bf16(model, out: Path) -> Path:
    """``model`` saved as bf16 safetensors, the router's expert bias kept in float32 (as the hub ships it)."""
    model.save_pretrained(out)
    tensors = {
        k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16))
        for k, v in read_hf_tensors(out).items()
    }
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
