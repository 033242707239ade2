"""End-to-end `srpo train` on a tiny random Qwen3 (real Qwen vocabulary) with the CPU rollout engine.

- 3 SRPO steps at TP2 (gloo): every method §6 metric is logged each step, the weights change, and the
  teacher forward ran on exactly the SDPO-routed samples (its own count vs the routing's).
- TP1 and TP2 give the same first-step loss.
- A run SIGKILLed after step 2 and resumed reproduces the uninterrupted run's metrics and weights at step 4;
  with LoRA too, where the stored adapters, their EMA teacher and optimizer state must be bit-identical.

The tiny model cannot solve a real task, so the recipe uses ``coin_reward`` (reward from a hash of the
response text) to produce mixed groups; everything else is the production path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.trainer.step_types import METHOD_METRICS
from tests.helpers.train import export_hf, read_metrics, train_overrides, train_rank

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=16)


@pytest.fixture(scope="module")
def tp2_run(tiny):
    run_dir = tiny[0] / "tp2"
    # fully_reshardable: test_tp2_checkpoint_resumes_at_tp1 changes the layout (the fast default format
    # resumes only at the same TP/PP/EP and refuses that in one line: tests/unit/test_optimizer_format.py)
    extra = {"parallel.tp": 2, "run.checkpoint_fully_reshardable": True}
    run_distributed(train_rank, 2, train_overrides(tiny, run_dir, **extra), timeout=600)
    return run_dir


def test_three_srpo_steps_at_tp2_log_everything_and_train(tiny, tp2_run, tmp_path):
    rows = read_metrics(tp2_run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    group = 4 * 4  # prompts_per_step × group_size of the recipe
    sdpo_total = 0
    for r in rows:
        missing = [k for k in METHOD_METRICS if r.get(k) is None]
        assert not missing, f"step {r['step']} lacks method §6 metrics {missing}"
        # The teacher's own count of scored samples equals the routing's SDPO share.
        sdpo_samples = round(r["route/sdpo_frac"] * group)
        assert r["samples/teacher_forward"] == sdpo_samples
        assert r["samples/routed_to_teacher"] == sdpo_samples
        sdpo_total += sdpo_samples
        assert r["logprob/gap_max"] < 1e-4, "engine and trainer must hold the same weights"
    assert sdpo_total > 0, "the recipe must route some samples to SDPO for this test to mean anything"
    initial = load_file(str(tiny[1] / "model.safetensors"))
    final = export_hf(tp2_run / "checkpoints" / "step_000003", tmp_path / "final")
    assert initial.keys() == final.keys()
    moved = max((final[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, "three optimizer steps must change the weights"


def test_tp1_and_tp2_give_the_same_first_step_loss(tiny, tp2_run):
    run_dir = tiny[0] / "tp1"
    run_distributed(train_rank, 1, train_overrides(tiny, run_dir, **{"train.steps": 1}), timeout=600)
    (tp1,) = read_metrics(run_dir)
    tp2 = read_metrics(tp2_run)[0]
    assert tp1["reward/mean"] == tp2["reward/mean"], "same seed, same weights: same rollouts"
    assert tp1["loss/total"] == pytest.approx(tp2["loss/total"], abs=1e-5)
    assert tp1["grad_norm"] == pytest.approx(tp2["grad_norm"], rel=1e-4)


def _srpo_train(overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "srpo_megatron.cli", "train", str(RECIPE)]
    for o in overrides:
        cmd += ["--override", o]
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _lora_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a checkpoint whose key names an adapter: the policy's adapters, the EMA
    teacher's fp32 adapters and their optimizer state (full tensors, as stored)."""
    from srpo_megatron.conversion.dist_reader import TorchDistReader

    reader = TorchDistReader(ckpt)
    try:
        keys = [k for k in reader.metadata.state_dict_metadata if ".lora." in k]
        out = {}
        for k in keys:
            md = reader.tensor_metadata(k)
            out[k] = reader.read(k, (0,) * len(md.size), tuple(md.size))
        return out
    finally:
        reader.close()


# LoRA: adapter-only training (base frozen), the EMA teacher an fp32 EMA of the adapters.
LORA_RESUME = {"lora.rank": 4, "lora.alpha": 8.0, "optim.lr": 1e-2}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigkill_after_step_2_then_resume_matches_uninterrupted_run(tiny, tmp_path, lora):
    steps = {"train.steps": 4, **(LORA_RESUME if lora else {})}
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    full = _srpo_train(train_overrides(tiny, full_dir, **steps))
    out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, out[-3000:]

    proc = _srpo_train(train_overrides(tiny, killed_dir, **steps))
    latest = killed_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.is_file() and latest.read_text().strip() == "step_000002"):
        assert proc.poll() is None, f"run ended before step 2 was saved:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 600 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_metrics(killed_dir)) < 4, "the kill must interrupt the run"
    resumed = _srpo_train(train_overrides(tiny, killed_dir, **steps))
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]

    ref = {r["step"]: r for r in read_metrics(full_dir)}
    got = {r["step"]: r for r in read_metrics(killed_dir)}  # steps 1-2 (maybe 3) from the first process
    for step in (3, 4):
        for key in ("loss/total", "grad_norm", "reward/mean", "route/sdpo_frac", "teacher/entropy_mean"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-6, abs=1e-9), (step, key)
    a = export_hf(full_dir / "checkpoints" / "step_000004", tmp_path / "hf_full")
    b = export_hf(killed_dir / "checkpoints" / "step_000004", tmp_path / "hf_resumed")
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-6, k
    if lora:  # the adapter-only checkpoint and the adapter EMA resume exactly
        ref_lora = _lora_tensors(full_dir / "checkpoints" / "step_000004")
        got_lora = _lora_tensors(killed_dir / "checkpoints" / "step_000004")
        assert any("teacher" in k for k in ref_lora) and len(ref_lora) > 2, sorted(ref_lora)[:8]
        assert sorted(ref_lora) == sorted(got_lora)
        for k in ref_lora:
            assert torch.equal(ref_lora[k], got_lora[k]), k


def test_tp2_checkpoint_resumes_at_tp1(tiny, tp2_run, tmp_path):
    """Policy, EMA teacher and optimizer state saved at TP2 load at TP1 and training continues."""
    import shutil

    run_dir = tmp_path / "resharded"
    shutil.copytree(tp2_run, run_dir)
    run_distributed(train_rank, 1, train_overrides(tiny, run_dir, **{"train.steps": 4}), timeout=600)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["logprob/gap_max"] < 1e-4, "the engine got the resumed TP1 weights"
    assert rows[-1]["train/skipped_steps"] == 0.0


def test_uneven_pipeline_stages_train_like_pp1(tmp_path):
    """A 3-layer policy at PP2 (stages of 1 and 2 layers) through ``srpo train``: the layout check lets it
    through, the first step equals PP1's (same rollouts, loss, grad norm), and its checkpoint exports every
    HF tensor."""
    from srpo_megatron.testing.tiny import write_tiny_qwen3, write_tiny_run

    root, _, data = write_tiny_run(tmp_path / "run", num_prompts=8)
    hf = write_tiny_qwen3(tmp_path / "qwen3_3_layers", num_layers=3)
    tiny3 = (root, hf, data)
    rows = {}
    for pp in (1, 2):
        run_dir = tmp_path / f"pp{pp}"
        extra = {"train.steps": 2 if pp == 2 else 1, "parallel.pp": pp}
        run_distributed(train_rank, pp, train_overrides(tiny3, run_dir, **extra), timeout=600)
        rows[pp] = read_metrics(run_dir)
    pp1, pp2 = rows[1][0], rows[2][0]
    assert pp1["reward/mean"] == pp2["reward/mean"], "same seed, same weights: same rollouts"
    assert pp1["loss/total"] == pytest.approx(pp2["loss/total"], abs=1e-5)
    assert pp1["grad_norm"] == pytest.approx(pp2["grad_norm"], rel=1e-4)
    assert all(r["logprob/gap_max"] < 1e-4 for r in rows[2]), "the engine got every stage's weights"
    final = export_hf(tmp_path / "pp2" / "checkpoints" / "step_000002", tmp_path / "final")
    assert final.keys() == load_file(str(hf / "model.safetensors")).keys()


def test_dynamic_sampling_on_the_colocated_cpu_engine_restarts_nothing(tiny, tmp_path):
    """Dynamic sampling's extra rounds on the colocated CPU engine (which refuses to generate while its
    memory is released, as SGLang does): every round of a step is generated by a serving engine, so no
    engine is restarted and resynced (``engine/restarts`` stays 0) and nothing says it was."""
    run_dir = tmp_path / "run"
    extra = {"train.steps": 2, "rollout.dynamic_sampling": "true", "rollout.max_sampling_rounds": 3}
    proc = _srpo_train(train_overrides(tiny, run_dir, **extra))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    rows = read_metrics(run_dir)  # asserts engine/restarts == 0 on every row (tests/helpers/healthy.py)
    assert max(r["sampling/rounds"] for r in rows) >= 2, "the run must draw extra rounds to mean anything"
    assert [r["engine/restarts"] for r in rows] == [0.0, 0.0]
    assert "memory is released" not in out and "restarting it alone" not in out, out[-3000:]
