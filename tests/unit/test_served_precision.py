"""The served folder's quantization against the weight sync, refused at start-up in one line
(``rollout.served_precision``, called by ``srpo train``'s ``check_before_model`` and ``srpo launch``'s
``check_before_submit`` before any engine starts); the FP8 manifest and the FP8 export stream
(``weights.fp8_sync``); the CPU engine's FP8 emulation."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from srpo_megatron.buckets import PendingParam, TensorSpec, bucketize, flat_buckets
from srpo_megatron.config import ConfigError
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.ops.fp8_blocks import dequantize, fake_quantize
from srpo_megatron.rollout.served_precision import check_served_precision, with_fp8_scales
from srpo_megatron.weights.fp8_sync import quantize_pending

FP8_QC = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
PROJ = "model.layers.0.self_attn.q_proj.weight"


def folder(tmp_path: Path, qc: dict | None, tensors: dict[str, torch.Tensor] | None = None) -> str:
    d = tmp_path / "served"
    d.mkdir(exist_ok=True)
    config = {"model_type": "qwen3"} | ({"quantization_config": qc} if qc is not None else {})
    (d / "config.json").write_text(json.dumps(config))
    if tensors:
        save_file(tensors, str(d / "model.safetensors"))
    return str(d)


def cfg(path: str, precision: str = "bf16", engine: str = "sglang") -> SimpleNamespace:
    sglang = SimpleNamespace(model_path=path) if engine == "sglang" else None
    return SimpleNamespace(
        model=SimpleNamespace(hf_dir=path),
        rollout=SimpleNamespace(engine=engine, sglang=sglang, precision=precision),
    )


def fp8_tensors(scaled: list[str], plain: list[str]) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros(4, 4, dtype=torch.float8_e4m3fn) for n in scaled}
    out |= {n + "_scale_inv": torch.ones(1, 1) for n in scaled}
    return out | {n: torch.zeros(4, 4, dtype=torch.bfloat16) for n in plain}


def refused(c) -> str:
    with pytest.raises(ConfigError) as e:
        check_served_precision(c)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_mxfp4_folder_is_refused_naming_folder_method_and_fix(tmp_path):
    path = folder(tmp_path, {"quant_method": "mxfp4"})
    msg = refused(cfg(path))
    assert path in msg and "mxfp4" in msg and "convert_megatron_to_hf.py" in msg


def test_unknown_and_unproducible_methods_are_refused(tmp_path):
    assert "unknown quantization_config.quant_method 'mystery4'" in refused(
        cfg(folder(tmp_path, {"quant_method": "mystery4"}))
    )
    assert "quant_method 'awq' cannot be produced" in refused(
        cfg(folder(tmp_path, {"quant_method": "awq"}), "fp8")
    )
    # not blockwise: per-tensor fp8 (no weight_block_size)
    assert "is not blockwise e4m3 FP8" in refused(cfg(folder(tmp_path, {"quant_method": "fp8"}), "fp8"))


def test_fp8_folder_needs_fp8_precision_and_the_reverse(tmp_path):
    fp8 = folder(tmp_path, FP8_QC, fp8_tensors([PROJ], []))
    assert "set rollout.precision: fp8" in refused(cfg(fp8, "bf16"))
    check_served_precision(cfg(fp8, "fp8"))  # the supported pair
    bf16 = folder(tmp_path / "b", None) if (tmp_path / "b").mkdir() is None else ""
    assert "has no quantization_config" in refused(cfg(bf16, "fp8"))
    check_served_precision(cfg(bf16, "fp8", engine="hf"))  # the CPU engine emulates FP8 itself
    check_served_precision(cfg(bf16, "bf16"))


def test_fp8_on_a_layer_sglang_keeps_in_bf16_is_refused(tmp_path):
    msg = refused(cfg(folder(tmp_path, FP8_QC, fp8_tensors([PROJ, "lm_head.weight"], [])), "fp8"))
    assert "stores lm_head.weight in FP8" in msg and "SGLang keeps that layer in bf16" in msg
    # modules_to_not_convert says q_proj stays bf16, but the folder stores it FP8
    qc = FP8_QC | {"modules_to_not_convert": ["q_proj"]}
    assert f"stores {PROJ} in FP8" in refused(cfg(folder(tmp_path, qc, fp8_tensors([PROJ], [])), "fp8"))
    # and the reverse: a projection stored bf16 that the config makes FP8
    assert f"stores {PROJ} in bf16" in refused(cfg(folder(tmp_path, FP8_QC, fp8_tensors([], [PROJ])), "fp8"))


def test_start_up_checks_refuse_before_the_model(tmp_path, monkeypatch):
    """``check_before_model`` (srpo train) and ``check_before_submit`` (srpo launch) both call it."""
    from srpo_megatron.launch import start_checks
    from srpo_megatron.trainer.run import preflight

    c = cfg(folder(tmp_path, {"quant_method": "mxfp4"}))
    for name in ("check_replay_config", "check_recompute_modules", "check_layout", "check_attention_cp"):
        mod = preflight
        monkeypatch.setattr(mod, name, lambda *a, **k: None)
    monkeypatch.setattr(preflight, "read_model_config", lambda _: {})
    monkeypatch.setattr(preflight, "check_model_limits", lambda *a: None)
    monkeypatch.setattr(preflight.Architecture, "from_hf", staticmethod(lambda _: None))
    with pytest.raises(ConfigError, match="mxfp4"):
        preflight.check_before_model(c, 1)
    with pytest.raises(ConfigError, match="mxfp4"):
        start_checks.check_before_submit(c, 1, log=lambda _: None)


def test_fp8_manifest_adds_each_scale_after_its_weight():
    m = with_fp8_scales(
        {PROJ: (300, 200), "model.norm.weight": (200,), "lm_head.weight": (9, 200)}, Fp8Layout()
    )
    assert m == {
        PROJ: (300, 200),
        PROJ + "_scale_inv": (3, 2),
        "model.norm.weight": (200,),
        "lm_head.weight": (9, 200),
    }


def _pending(named: dict[str, torch.Tensor]) -> list[PendingParam]:
    return [
        PendingParam(
            n,
            t.numel() * t.element_size(),
            (lambda n=n, t=t: [(n, t)]),
            (TensorSpec(n, t.dtype, tuple(t.shape)),),
        )
        for n, t in named.items()
    ]


def test_fp8_stream_quantizes_exactly_the_layout_weights():
    g = torch.Generator().manual_seed(0)
    named = {
        "model.embed_tokens.weight": torch.randn(50, 200, generator=g).bfloat16(),
        PROJ: torch.randn(300, 200, generator=g).bfloat16(),
        "model.layers.0.mlp.gate.weight": torch.randn(8, 200, generator=g).bfloat16(),  # the router: bf16
        "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(200, 130, generator=g).bfloat16(),
    }
    for bucket in flat_buckets(quantize_pending(_pending(named), Fp8Layout()), 1 << 30):
        got = dict(bucket.views())
    assert list(got) == [
        "model.embed_tokens.weight",
        PROJ + "_scale_inv",
        PROJ,
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv",
        "model.layers.0.mlp.experts.3.down_proj.weight",
    ]
    for n in (PROJ, "model.layers.0.mlp.experts.3.down_proj.weight"):
        assert got[n].dtype == torch.float8_e4m3fn
        assert torch.equal(dequantize(got[n], got[n + "_scale_inv"]), fake_quantize(named[n].float()))
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], named["model.layers.0.mlp.gate.weight"])
    # bf16 engine: the stream is untouched
    assert [p.name for p in quantize_pending(_pending(named), None)] == list(named)


def test_a_deepseek_q_a_kv_a_pair_with_scales_stays_in_one_bucket():
    """SGLang fuses q_a and kv_a (weights and scales) only within one load_weights call."""
    p = "model.layers.0.self_attn."
    stream = [(p + "q_a_proj.weight_scale_inv", torch.ones(1, 1)), (p + "q_a_proj.weight", torch.ones(64))]
    stream += [
        (p + "q_a_layernorm.weight", torch.ones(64)),
        (p + "kv_a_proj_with_mqa.weight_scale_inv", torch.ones(1)),
    ]
    stream += [(p + "kv_a_proj_with_mqa.weight", torch.ones(64)), (p + "o_proj.weight", torch.ones(64))]
    buckets = [[n for n, _ in b] for b in bucketize(stream, 8)]
    assert buckets[0] == [n for n, _ in stream[:5]]


def test_cpu_engine_emulates_the_fp8_engine():
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.testing.tiny import tiny_hf_model

    model = tiny_hf_model("qwen3", num_layers=2)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    engine = HFEngine(model, precision="fp8")
    state = engine.model.state_dict()
    layout = Fp8Layout()
    fp8 = [n for n in state if layout.is_fp8(n)]
    assert fp8 and all(torch.equal(state[n], fake_quantize(before[n])) for n in fp8)
    assert all(torch.equal(state[n], before[n]) for n in state if n not in fp8)
    engine.update_weights(list(before.items()), 1)  # every sync: quantized again
    assert all(torch.equal(engine.model.state_dict()[n], fake_quantize(before[n])) for n in fp8)
    assert any(not torch.equal(state[n], before[n]) for n in fp8)


def test_disk_sync_writes_an_fp8_folder_sglang_can_load(tmp_path):
    """The disk path: the FP8 stream through the shared gate into a checkpoint folder with the served
    config.json (its quantization_config); the folder passes the start-up name check (each FP8 weight has
    its scale, nothing else has one) and holds exactly the quantized blocks."""
    from safetensors.torch import load_file

    from srpo_megatron.weights.disk_sync import DiskInstall
    from srpo_megatron.weights.fp8_sync import quantize_named

    g = torch.Generator().manual_seed(1)
    named = {
        PROJ: torch.randn(300, 200, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(200).bfloat16(),
    }
    served = folder(tmp_path, FP8_QC)
    manifest = with_fp8_scales({n: tuple(t.shape) for n, t in named.items()}, Fp8Layout())
    loaded = []
    engine = SimpleNamespace(weight_version=0, update_weights_from_disk=lambda f, v: loaded.append((f, v)))
    out = tmp_path / "engine0"
    DiskInstall(engine, out, manifest, frozenset(), served, 1 << 20).update_weights(
        quantize_named(named.items(), Fp8Layout()), 3
    )
    assert loaded == [(str(out), 3)]
    check_served_precision(cfg(str(out), "fp8"))
    files = {}
    for f in out.glob("*.safetensors"):
        files |= load_file(str(f))
    assert files[PROJ].dtype == torch.float8_e4m3fn
    assert torch.equal(
        dequantize(files[PROJ], files[PROJ + "_scale_inv"]), fake_quantize(named[PROJ].float())
    )
    with pytest.raises(Exception, match="mis-typed"):  # planted: today's bf16 stream
        DiskInstall(engine, out, manifest, frozenset(), served, 1 << 20).update_weights(named.items(), 4)
