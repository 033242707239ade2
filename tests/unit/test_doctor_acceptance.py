"""`srpo doctor --acceptance`: on this CPU every check is listed, ok or skipped (needs CUDA) with its
reason, rc 0; planted faults (a cuDNN below the sinks bound, TE falling back to unfused attention, the fused
output layer off megatron's numbers, a release that returns no memory, a restarted engine) fail, named.

The probes are injected (``registry.Probes``) or torch's own answer is patched: a CPU machine has no cuDNN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from srpo_megatron.doctor.acceptance import output_layer, release_resume, te_attention, train_run, versions
from srpo_megatron.doctor.acceptance.command import REGISTRY, acceptance_main
from srpo_megatron.doctor.acceptance.registry import Context, Probes, passed, run_check

REPO = Path(__file__).resolve().parents[2]


def _lines(text: str) -> tuple[list[dict], dict]:
    rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    return rows[:-1], rows[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the command")
def test_acceptance_cli_on_cpu_lists_every_check_ok_or_skipped_with_reason():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "srpo_megatron.cli", "doctor", "--acceptance", "--json"],
        capture_output=True, text=True, env=env, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    checks, summary = _lines(proc.stdout)  # stdout is JSON lines only
    assert [c["check"] for c in checks] == [c.name for c in REGISTRY]
    for c in checks:
        assert c["status"] in ("ok", "skipped"), c
        assert c["proves"]
        if c["status"] == "skipped":
            assert c["detail"].startswith("needs CUDA: ") and len(c["detail"]) > len("needs CUDA: ") + 10, c
    by_name = {c["check"]: c for c in checks}
    # what can run on a CPU ran: the versions of CPU parts and the fused output layer's numerics
    for name in ("versions.torch", "versions.transformers", "versions.megatron_core", "fused_output_layer"):
        assert by_name[name]["status"] == "ok", by_name[name]
    assert by_name["fused_output_layer"]["metrics"]["loss_vs_megatron"] < 1e-4
    assert summary["passed"] is True and summary["failed"] == [] and summary["fail"] == 0


def test_planted_cudnn_below_the_sinks_bound_fails_the_command_naming_the_check(capsys, monkeypatch):
    # the output layer's child run is covered by the CLI test: not again here
    fast = tuple(replace(c, run=lambda ctx: passed("not run here")) if c.name == "fused_output_layer" else c
                 for c in REGISTRY)  # fmt: skip
    monkeypatch.setattr("srpo_megatron.doctor.acceptance.command.REGISTRY", fast)
    probes = Probes(cudnn_version=lambda: 91200)  # cuDNN 9.12.0: below 9.13.1
    rc = acceptance_main(None, True, probes=probes)
    checks, summary = _lines(capsys.readouterr().out)
    assert rc == 1
    assert summary["passed"] is False and summary["failed"] == ["versions.cudnn"]
    row = next(c for c in checks if c["check"] == "versions.cudnn")
    assert row["status"] == "fail" and "9.12.0" in row["detail"] and "9.13.1" in row["detail"]
    assert row["fix"]
    # without the plant the same run passes
    assert acceptance_main(None, True, probes=Probes()) == 0


def test_the_default_probe_reads_torchs_cudnn_version(monkeypatch, tmp_path):
    check = next(c for c in REGISTRY if c.name == "versions.cudnn")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for raw, status in [(90100, "fail"), (91301, "warn"), (91800, "ok"), (8907, "fail")]:
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda raw=raw: raw)
        assert run_check(check, Context(Probes(), "", tmp_path)).status == status, raw
    assert versions.cudnn_tuple(91301) == (9, 13, 1) and versions.cudnn_tuple(8907) == (8, 9, 7)


def test_a_gpu_part_missing_on_a_cuda_node_fails(tmp_path):
    probes = Probes(cuda_available=lambda: True, dist_version=lambda d: None, has_module=lambda m: False)
    ctx = Context(probes, "", tmp_path)
    by_name = {c.name: c for c in REGISTRY}
    for name in ("versions.transformer_engine", "versions.sglang", "versions.apex_extensions"):
        assert run_check(by_name[name], ctx).status == "fail", name
    assert run_check(by_name["te_attention.mla.bshd"], ctx).status == "fail"
    assert run_check(by_name["versions.flash_attn"], ctx).status == "warn"  # optional: TE prefers cuDNN


def test_a_check_that_raises_is_that_checks_failure(tmp_path):
    check = replace(REGISTRY[0], name="boom", fix="fix it", run=lambda ctx: 1 / 0)
    r = run_check(check, Context(Probes(), "", tmp_path))
    assert (
        r.status == "fail"
        and "ZeroDivisionError" in r.detail
        and json.loads(r.json_line())["fix"] == "fix it"
    )


# TE's own debug lines (TransformerEngine pytorch/attention/dot_product_attention/utils.py, logger format
# "[%(levelname)-8s | %(name)-19s]: %(message)s").
FUSED_LOG = """[DEBUG    | DotProductAttention]: Running with config={'cudnn_version': '9.18.0'}
[DEBUG    | DotProductAttention]: Available backends = {FlashAttention=False, FusedAttention=True (sub-backend 1), UnfusedDotProductAttention=True}
[DEBUG    | DotProductAttention]: Selected backend = FusedAttention (sub-backend 1)
"""  # noqa: E501
UNFUSED_LOG = """[DEBUG    | DotProductAttention]: Disabling FusedAttention as no backend supports the provided input
[DEBUG    | DotProductAttention]: Available backends = {FlashAttention=False, FusedAttention=False, UnfusedDotProductAttention=True}
[DEBUG    | DotProductAttention]: Selected backend = UnfusedDotProductAttention
"""  # noqa: E501


def test_te_backend_log_parsing_and_the_cudnn_a_fallback_needs():
    stderr = f"{te_attention.MARK}gpt_oss_sliding.thd\n{UNFUSED_LOG}{te_attention.MARK}mla.bshd\n{FUSED_LOG}"
    logs = te_attention.split_case_logs(stderr)
    cases = {c.name: c for c in te_attention.CASES}
    selected, reasons = te_attention.parse_backend_log(logs["mla.bshd"])
    ok = te_attention.case_outcome(cases["mla.bshd"], selected, reasons, {"ms": 3.2}, "9.18.0")
    assert ok.status == "ok" and ok.metrics["backend"].startswith("FusedAttention")
    selected, reasons = te_attention.parse_backend_log(logs["gpt_oss_sliding.thd"])
    bad = te_attention.case_outcome(cases["gpt_oss_sliding.thd"], selected, reasons, {"ms": 90.0}, "9.13.1")
    assert bad.status == "fail" and "UnfusedDotProductAttention" in bad.detail
    assert "9.18.0" in bad.detail and "no backend supports" in bad.detail  # packed sinks need 9.18
    bshd = te_attention.case_outcome(cases["gpt_oss_full.bshd"], selected, reasons, {}, "9.12.0")
    assert "9.13.1" in bshd.detail
    assert te_attention.case_outcome(cases["mla.thd"], None, [], {}, "x").status == "fail"


def test_output_layer_judge_fails_on_wrong_numbers_or_more_memory():
    good = dict(loss_vs_megatron=1e-3, dhidden_vs_megatron=1e-3, dweight_vs_megatron=1e-3,
                fused_loss_vs_fp64=1e-3, megatron_loss_vs_fp64=1e-3, megatron_ms=90.0, fused_ms=80.0,
                megatron_peak_gib=7.5, fused_peak_gib=0.9)  # fmt: skip
    assert output_layer.judge(good, "bfloat16", cuda=True).status == "ok"
    assert output_layer.judge({**good, "dweight_vs_megatron": 0.3}, "bfloat16", True).status == "fail"
    assert output_layer.judge({**good, "fused_loss_vs_fp64": float("nan")}, "bfloat16", True).status == "fail"
    assert output_layer.judge({**good, "fused_peak_gib": 8.0}, "bfloat16", True).status == "fail"
    assert output_layer.judge(good, "float32", cuda=False).status == "fail"  # 1e-3 is above fp32's 1e-4


def test_release_resume_judge_names_a_cycle_that_returned_too_little():
    gib = 2**30
    assert release_resume.judge_cycles(10 * gib, [9 * gib] * 3, [2, 3, 4], [2, 3, 4]).status == "ok"
    low = release_resume.judge_cycles(10 * gib, [9 * gib, 1 * gib, 9 * gib], [2, 3, 4], [2, 3, 4])
    assert low.status == "fail" and "cycle(s) [2]" in low.detail
    assert release_resume.judge_cycles(10 * gib, [9 * gib] * 3, [2, 2, 4], [2, 3, 4]).status == "fail"


def test_train_judge_wants_three_finite_steps_no_restart_and_the_parity_metric(tmp_path):
    rows = [{"loss/total": 0.1, "logprob/gap_mean": 0.01, "engine/restarts": 0} for _ in range(3)]
    assert train_run.judge_metrics(rows).status == "ok"
    assert train_run.judge_metrics(rows[:2]).status == "fail"
    assert train_run.judge_metrics([*rows[:2], {**rows[2], "engine/restarts": 1}]).status == "fail"
    assert train_run.judge_metrics([*rows[:2], {"loss/total": 0.1}]).status == "fail"
    cmd = train_run.train_command(Context(Probes(), "", tmp_path), tmp_path / "run", tmp_path / "tiny")
    assert "rollout.engine=sglang" in cmd and "performance.layer_spec=te" in cmd
    from srpo_megatron.config import load_recipe

    overrides = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-o"]
    cfg = load_recipe(cmd[cmd.index("train") + 1], overrides)  # the command's recipe + overrides load
    assert cfg.rollout.engine == "sglang" and cfg.rollout.sglang.model_path == str(
        tmp_path / "tiny" / "qwen3"
    )


def _standin_engine(weights, fp8_layout=None):
    from srpo_megatron.config import SGLangEngineConfig
    from srpo_megatron.rollout.served_precision import with_fp8_scales
    from srpo_megatron.rollout.sglang.engine import SGLangEngine
    from srpo_megatron.testing.sglang_standin import SGLangStandInServer, standin_serialize
    from tests.helpers.rollout_contract import tiny_model

    server = SGLangStandInServer(tiny_model("llama", weights))
    # what SGLangEngine reads from an FP8 served folder: each FP8 weight's weight_scale_inv too
    manifest = with_fp8_scales({n: tuple(t.shape) for n, t in weights.items()}, fp8_layout)
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path="/unused", bucket_bytes=1024**2)
    return server, SGLangEngine(cfg, manifest=manifest, serializer=standin_serialize)


def test_sglang_live_sequence_against_the_standin_server_and_a_planted_no_op_update(monkeypatch):
    """The live check's pause -> update x2 -> continue sequence through the real SGLangEngine (http mode)
    against the SGLang stand-in server; then with an update that changes nothing (planted): named."""
    from srpo_megatron.doctor.acceptance import sglang_live
    from tests.helpers.rollout_contract import initial_weights

    weights = initial_weights("llama")
    server, engine = _standin_engine(weights)
    try:
        out = sglang_live.exercise(engine, weights, long_tokens=16, hold=lambda: server.hold_after_steps(3))
        assert out.status == "ok", out.detail
        assert out.metrics["aborted"] >= 1
    finally:
        server.close()

    server, engine = _standin_engine(weights)
    try:  # planted: the update installs the weights unchanged (a scaling that was dropped)
        monkeypatch.setattr(sglang_live, "scaled", lambda w, factor: w)
        out = sglang_live.exercise(engine, weights, long_tokens=16, hold=lambda: server.hold_after_steps(3))
        assert out.status == "fail" and "no effect" in out.detail, out.detail
    finally:
        server.close()


def test_sglang_live_fp8_sequence_sends_the_fp8_sync_stream_and_a_planted_bf16_update_is_named(monkeypatch):
    """The FP8 variant: the same sequence with the update through ``weights.fp8_sync`` (e4m3 weights +
    their weight_scale_inv, the stand-in installs the block dequantization); then a sync that sends bf16
    under the dense names (planted: no quantization) is refused, named."""
    from srpo_megatron.conversion.fp8_layout import Fp8Layout
    from srpo_megatron.doctor.acceptance import sglang_live, sglang_live_fp8
    from tests.helpers.rollout_contract import initial_weights

    weights, layout = initial_weights("llama"), Fp8Layout()
    fp8_names = [n for n in weights if layout.is_fp8(n)]
    assert fp8_names, "the tiny model must have FP8-layout projections"
    update = sglang_live_fp8.fp8_update(layout)
    server, engine = _standin_engine(weights, layout)
    try:
        out = sglang_live.exercise(
            engine, weights, long_tokens=16, hold=lambda: server.hold_after_steps(3), update=update
        )
        assert out.status == "ok", out.detail
        assert out.metrics["aborted"] >= 1
        received = dict(server.tensor_updates[-1][0])
        for n in fp8_names:  # what SGLang's block-FP8 linear method loads: e4m3 + fp32 scale per block
            assert (
                received[n].dtype == torch.float8_e4m3fn and received[n + "_scale_inv"].dtype == torch.float32
            )
    finally:
        server.close()

    server, engine = _standin_engine(weights, layout)
    try:  # planted: the sync forgets the served layout and sends bf16 under the dense names
        monkeypatch.setattr("srpo_megatron.weights.fp8_sync.quantize_named", lambda named, layout: named)
        out = sglang_live.exercise(
            engine, weights, long_tokens=16, hold=lambda: server.hold_after_steps(3), update=update
        )
        assert out.status == "fail" and "refused" in out.detail and "_scale_inv" in out.detail, out.detail
    finally:
        server.close()


def test_the_fp8_check_folder_is_blockwise_fp8_and_passes_the_served_precision_check(tmp_path):
    """The folder the FP8 check serves: every projection e4m3 with its scale, bf16 elsewhere, DeepSeek-V3's
    quantization_config; the start-up check passes it, and names a bf16 copy of it under the FP8 config."""
    import json

    from safetensors.torch import load_file

    from srpo_megatron.conversion.manifest import hf_manifest
    from srpo_megatron.doctor.acceptance import sglang_live_fp8
    from srpo_megatron.doctor.acceptance.engine_model import write_random_model
    from srpo_megatron.ops.fp8_blocks import dequantize
    from srpo_megatron.rollout.served_precision import served_fp8_layout, with_fp8_scales

    bf16 = write_random_model(tmp_path / "bf16")
    folder = sglang_live_fp8.write_fp8_folder(bf16, tmp_path / "fp8")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert sglang_live_fp8.served_precision_problem(folder) == ""
    src, got = load_file(str(bf16 / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    layout = served_fp8_layout(folder)
    manifest = with_fp8_scales(hf_manifest(str(folder)), layout)
    assert set(got) == set(manifest)  # the names the engine's manifest of this folder expects
    fp8 = [n for n in src if layout.is_fp8(n)]
    assert len(fp8) == 2 * 7  # q/k/v/o, gate/up/down per layer
    for n in fp8:
        assert got[n].dtype == torch.float8_e4m3fn
        w = dequantize(got[n], got[n + "_scale_inv"], dtype=torch.float64)
        err = (w - src[n].double()).abs() / src[n].double().abs().amax()
        assert float(err.max()) <= 2.0**-4  # e4m3: 3 mantissa bits, relative to the block's amax
    for n in set(src) - set(fp8):
        assert torch.equal(got[n], src[n])
    # planted: the same config over bf16 weights (scales dropped) is refused by the start-up check
    from safetensors.torch import save_file

    save_file({n: t for n, t in got.items() if not n.endswith("_scale_inv")} | {n: src[n] for n in fp8},
              str(folder / "model.safetensors"))  # fmt: skip
    assert "stores" in sglang_live_fp8.served_precision_problem(folder)


def test_checks_past_the_budget_fail_as_not_run(tmp_path):
    from srpo_megatron.doctor.acceptance.command import run_acceptance

    results = run_acceptance(None, work_dir=tmp_path, budget_s=5.0)
    assert [r.check for r in results] == [c.name for c in REGISTRY]
    assert all(r.status == "fail" and r.detail.startswith("not run") for r in results)


def test_a_recipe_the_train_check_cannot_load_is_one_line_and_exit_2(tmp_path, capsys):
    from srpo_megatron.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: -1}\n")
    assert main(["doctor", "--acceptance", str(bad), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("srpo doctor: error:")
