"""Blockwise-FP8 HF folders in the converter (``conversion/fp8_folder.py``): the refusals of a quantization
the converter cannot read (``Architecture.from_hf``, ``tools/convert_hf_to_megatron.py``: one line, exit 2)
and of a folder that does not match its FP8 config (missing or transposed scale, an FP8 tensor with none); the
streamed dequantization against the per-block reference; the round trip quantize(dequantize(q, s)); the
planned writer's float8 layout against ``save_file``. The import at TP1/TP2/EP2 and the export are
``tests/dist/test_deepseek_fp8_import.py``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from srpo_megatron.conversion.fp8_folder import dequantize_weight
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.conversion.safetensors_io import PlannedSafetensorsWriter
from srpo_megatron.models.architecture import Architecture, UnsupportedModelError
from srpo_megatron.ops import fp8_blocks
from srpo_megatron.testing.tiny import tiny_deepseek_model
from tests.helpers.conversion import BASE, read_hf_tensors
from tests.helpers.fp8 import reference_dequantize, reference_quantize, save_bf16, write_fp8_folder

TOOLS = Path(__file__).resolve().parents[2] / "tools"
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
REFUSED = {
    "awq": {"quant_method": "awq", "bits": 4},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized"},
    "fp8 per-tensor": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
    "fp8 e5m2": {**FP8, "fmt": "e5m2"},
    "fp8 static": {**FP8, "activation_scheme": "static"},
    "fp8 1-D block": {**FP8, "weight_block_size": [128]},
    "mxfp4 on qwen3": {"quant_method": "mxfp4"},
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_from_hf_refuses_a_quantization_it_cannot_read_in_one_line(name):
    cfg = {**BASE, "model_type": "qwen3", "head_dim": 2, "quantization_config": REFUSED[name]}
    with pytest.raises(UnsupportedModelError) as e:
        Architecture.from_hf(cfg, where="/models/x/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("/models/x/config.json: ")
    assert repr(REFUSED[name]["quant_method"]) in msg or "'fp8'" in msg
    assert "bf16 release" in msg  # the fix
    if name in ("fp8 per-tensor", "fp8 e5m2", "fp8 1-D block"):  # the one FP8 rule: Fp8Layout's too
        with pytest.raises(ValueError):
            Fp8Layout.from_quantization_config(REFUSED[name], "x")


def test_from_hf_accepts_blockwise_fp8_and_gpt_oss_mxfp4():
    cfg = {**BASE, "model_type": "qwen3", "head_dim": 2}
    for qc in (FP8, {**FP8, "weight_block_size": [64, 32], "scale_fmt": "ue8m0"}, {**FP8, "fmt": None} | {}):
        qc = {k: v for k, v in qc.items() if v is not None}
        assert Architecture.from_hf({**cfg, "quantization_config": qc}) == Architecture.from_hf(cfg)
        assert Fp8Layout.from_quantization_config(qc, "x").block == tuple(qc["weight_block_size"])
    from srpo_megatron.planner.command import HF_CONFIG_DIR

    oss = json.loads((HF_CONFIG_DIR / "gpt-oss-20b.json").read_text())
    assert oss["quantization_config"]["quant_method"] == "mxfp4"
    assert Architecture.from_hf(oss).mxfp4_experts


@pytest.mark.parametrize("shape", [(300, 130), (128, 256), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streamed_dequantization_is_the_reference_bit_for_bit(shape, dtype):
    """Row block by row block, partial edge blocks: the per-block reference loop and ops/fp8_blocks."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    for block in ((128, 128), (16, 24), (24, 16)):
        q, s = reference_quantize(w, block)
        got = dequantize_weight("w", q, s, block, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, reference_dequantize(q, s, block, dtype)), block
        assert torch.equal(got, fp8_blocks.dequantize(q, s, block, dtype)), block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_table_dequantization_has_the_references_bits_for_every_code(dtype):
    """Every float8 code (NaNs, -0 and subnormals included) in blocks of different scales, over more rows
    than one lookup chunk (the chunk loop and its last, partial chunk), compared as bits: the table of
    each block's 256 products is the reference's widen-and-multiply, not merely close to it."""
    gen = torch.Generator().manual_seed(2)
    rows, cols = 2 * 1100 + 77, 300  # > 2**18 elements: several chunks, partial row and column blocks
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int32)
    codes[:1, :256] = torch.arange(256, dtype=torch.int32)
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    s = (
        torch.rand(-(-rows // 128), -(-cols // 128), generator=gen)
        * 10.0 ** torch.randint(-6, 3, (1,)).item()
    )
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    want = reference_dequantize(q, s, (128, 128), dtype)
    assert torch.equal(dequantize_weight("w", q, s, (128, 128), dtype).view(bits), want.view(bits))


def test_requantizing_an_fp8_import_gives_the_bytes_back_where_that_is_defined():
    """quantize(dequantize(q, s)) == (q, s) for blocks the quantizer made from bf16 weights (the hub's case)
    through a bf16 or fp32 import, and from fp32 weights through an fp32 import; blocks under the 1e-4 amax
    floor too. Not exact: fp32-made scales through a bf16 import (codes exact, scales within 2**-8)."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(520, 300, generator=gen) * torch.rand(520, 1, generator=gen) * 4).to(torch.bfloat16)
    w[:128, :128] = 3e-5  # a block under the floor
    q, s = fp8_blocks.quantize(w)

    def same(q2, s2):
        return torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)

    for dtype in (torch.bfloat16, torch.float32):
        assert same(*fp8_blocks.quantize(dequantize_weight("w", q, s, (128, 128), dtype))), dtype
    w32 = torch.randn(4096, 4096, generator=gen) * torch.rand(4096, 1, generator=gen)
    q, s = fp8_blocks.quantize(w32)
    assert same(*fp8_blocks.quantize(fp8_blocks.dequantize(q, s)))
    q2, s2 = fp8_blocks.quantize(fp8_blocks.dequantize(q, s, dtype=torch.bfloat16))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and not torch.equal(s2, s)
    assert ((s2 - s).abs() / s).max() <= 2**-8


def test_planned_writer_lays_out_float8_like_save_file(tmp_path):
    tensors = {
        "a.weight": torch.randn(4, 6).to(torch.float8_e4m3fn),
        "a.weight_scale_inv": torch.rand(1, 1),
        "b.weight": torch.randn(3, 6, dtype=torch.bfloat16),
        "c": torch.arange(3, dtype=torch.int16),
    }
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "planned"
    out.mkdir()
    dtypes = {k: t.dtype for k, t in tensors.items()}
    writer = PlannedSafetensorsWriter(
        out, [(k, tuple(t.shape)) for k, t in tensors.items()], torch.bfloat16, dtypes=dtypes
    )
    for k, t in tensors.items():
        writer.write(k, t)
    writer.close()
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


# ---- the converter's refusals, before any work ----------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8")
    save_bf16(tiny_deepseek_model(seed=0, num_layers=2, first_k_dense_replace=1), work / "bf16")
    write_fp8_folder(work / "bf16", work / "fp8", work / "ref", (16, 24))
    return work / "fp8"


def _broken(src, dst, edit_tensors=None, edit_config=None):
    tensors = read_hf_tensors(src)
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _convert(capsys, src, out):
    spec = importlib.util.spec_from_file_location(
        "convert_hf_to_megatron", TOOLS / "convert_hf_to_megatron.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()
    code = tool.main(["--hf-dir", str(src), "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not out.exists()  # refused before any work
    return err[0]


O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # [64, 40]: a [4, 2] scale grid in 16x24 blocks


def test_converter_refuses_an_unknown_quant_method(fp8_folder, tmp_path, capsys):
    def awq(c):
        c["quantization_config"] = {"quant_method": "awq", "bits": 4}

    src = _broken(fp8_folder, tmp_path / "awq", edit_config=awq)
    line = _convert(capsys, src, tmp_path / "out")
    assert str(src / "config.json") in line and "'awq'" in line and "bf16 release" in line


def test_converter_refuses_a_missing_scale(fp8_folder, tmp_path, capsys):
    src = _broken(fp8_folder, tmp_path / "noscale", lambda t: t.pop(O_PROJ + "_scale_inv"))
    line = _convert(capsys, src, tmp_path / "out")
    assert f"{O_PROJ} is float8_e4m3fn but the folder has no {O_PROJ}_scale_inv" in line


def test_converter_refuses_a_transposed_scale(fp8_folder, tmp_path, capsys):
    def transpose(t):
        t[O_PROJ + "_scale_inv"] = t[O_PROJ + "_scale_inv"].t().contiguous()

    line = _convert(capsys, _broken(fp8_folder, tmp_path / "t", transpose), tmp_path / "out")
    assert f"{O_PROJ}_scale_inv has shape [2, 4]" in line and "needs [4, 2] (it is transposed)" in line


def test_converter_refuses_fp8_tensors_without_a_quantization_config(fp8_folder, tmp_path, capsys):
    src = _broken(fp8_folder, tmp_path / "nocfg", edit_config=lambda c: c.pop("quantization_config"))
    line = _convert(capsys, src, tmp_path / "out")
    assert "is F8_E4M3 but config.json has no FP8 quantization_config" in line


def test_converter_refuses_a_bf16_weight_the_config_calls_fp8(fp8_folder, tmp_path, capsys):
    def widen(t):
        t[O_PROJ] = t[O_PROJ].to(torch.bfloat16)

    line = _convert(capsys, _broken(fp8_folder, tmp_path / "w", widen), tmp_path / "out")
    assert f"{O_PROJ} is BF16, but quantization_config says it is FP8" in line
