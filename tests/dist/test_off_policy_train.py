"""`srpo train` with off-policy rollouts (``rollout.off_policy_steps``) in separate placement on CPU: the
stand-in SGLang server in this process, reached through ``SRPO_ENGINE_URLS``, weights broadcast into it
(gloo), the trainer at world 1 (a spawned rank, as ``run_distributed`` starts them).

- At N = 1 every trained sample's weight version is exactly one behind the trainer's at its step (the
  first step has no older weights: it trains the starting weights' samples). Planted: a version stamped
  when the trainer receives the round (after the sync that followed its generation) instead of when it
  was dispatched is caught by the same check.
- ``srpo train`` SIGKILLed with a completed, untrained round in its last checkpoint, then resumed: per
  sample id nothing is lost or trained twice, and the run equals the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.recipe import RECIPE, REPO, tiny_config, tiny_overrides

STEPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_off_policy"), num_prompts=16)


def _overrides(tiny, n: int, *extra: str) -> list[str]:
    return [
        "rollout.engine=sglang",
        "rollout.placement=separate",
        "rollout.engine_nodes=1",
        f"rollout.sglang={{model_path: {tiny[1]}, weight_sync: distributed, bucket_bytes: 1048576}}",
        f"rollout.off_policy_steps={n}",
        f"train.steps={STEPS}",
        "run.save_every=0",
        "run.tensorboard=false",
        "train.eval_at_ends=false",
        *extra,
    ]


def _train(rank, world, tiny, run_dir, url, overrides, planted=""):
    import os

    from srpo_megatron.train import train
    from srpo_megatron.trainer.collect import off_policy

    os.environ["SRPO_ENGINE_URLS"], os.environ["SRPO_SYNC_HOST"] = url, "127.0.0.1"
    if planted == "stamp_at_completion":
        original = off_policy.GenerationWorker.wait

        def wait(self, dispatch):  # the version the engine serves when the trainer receives the round
            result = original(self, dispatch)
            for group in result.completions or []:
                for c in group:
                    c.weight_version = self.engine().weight_version
            return result

        off_policy.GenerationWorker.wait = wait
    return train(tiny_config(tiny, run_dir, overrides))


def _run(tiny, tmp_path: Path, overrides: list[str], planted: str = "") -> tuple[list[dict], list[dict]]:
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    run_dir = tmp_path / "run"
    try:
        run_distributed(_train, 1, tiny, str(run_dir), server.url, overrides, planted, timeout=900)
    finally:
        server.close()
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, metrics


def one_behind(rows: list[dict]) -> list[str]:
    """What breaks "every trained sample is exactly one version behind the trainer" (from step 2 on)."""
    out = []
    for r in rows:
        want = r["trainer_version"] - (1 if r["step"] > 1 else 0)
        wrong = sorted({v for v in r["versions"] if v != want})
        if wrong:
            out.append(f"step {r['step']} (trainer v{r['trainer_version']}): versions {wrong}, want v{want}")
    return out


@pytest.fixture(scope="module")
def n1_run(tiny, tmp_path_factory):
    return _run(tiny, tmp_path_factory.mktemp("n1"), _overrides(tiny, 1))


def test_at_n1_every_trained_sample_is_exactly_one_version_behind(n1_run):
    rows, metrics = n1_run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["trainer_version"] for r in rows] == list(range(1, STEPS + 1))
    assert not one_behind(rows), one_behind(rows)
    assert [m["async/staleness_max"] for m in metrics] == [0.0] + [1.0] * (STEPS - 1)
    assert all(m["async/dropped_stale"] == 0.0 for m in metrics)
    uids = [u for r in rows for u in r["uids"]]
    assert len(uids) == len(set(uids)) == STEPS * 4 * 4, "each sample trained once"


def test_a_version_stamped_at_completion_is_caught(tiny, tmp_path, n1_run):
    rows, _ = _run(tiny, tmp_path, _overrides(tiny, 1), planted="stamp_at_completion")
    assert one_behind(rows), "the planted stamp must break the check"
    assert not one_behind(n1_run[0])


def test_on_policy_separate_run_trains_the_current_version(tiny, tmp_path):
    rows, metrics = _run(tiny, tmp_path, _overrides(tiny, 0))
    assert all(set(r["versions"]) == {r["trainer_version"]} for r in rows)
    assert all(m["async/staleness_max"] == 0.0 for m in metrics)
    assert len(rows) == STEPS


# ---- kill -9 with buffered rollouts, then resume -------------------------------------------------------

_TIMED = (
    "time/",
    "perf/",
    "rollout/engine_seconds_max",
    "rollout/sync_s",
    "async/engine_idle",
    "async/trainer_idle",
)


def _srpo_train(tiny, run_dir: Path, url: str, overrides: list[str]) -> subprocess.Popen:
    """`srpo train` as a process of its own (world 1), so it can be killed."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "SRPO_ENGINE_URLS": url,
        "SRPO_SYNC_HOST": "127.0.0.1",
    }
    cmd = [sys.executable, "-m", "srpo_megatron.cli", "train", str(RECIPE)]
    for o in tiny_overrides(tiny, run_dir, overrides):
        cmd += ["--override", o]
    out = subprocess.PIPE
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)


def _server(tiny):
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    return SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))


def _finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]


def _last_per_step(path: Path) -> dict[int, dict]:
    """A resumed run appends the steps it redoes: the last row of a step is the one that counts."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_kill_9_with_buffered_rollouts_then_resume_loses_nothing_and_trains_nothing_twice(tiny, tmp_path):
    """At N = 1 every checkpoint holds the round generated for the next step (completed, not trained).
    The run is SIGKILLed once step 2's checkpoint exists; the resumed run trains that buffered round at
    step 3 and regenerates the round that was in flight: per sample id, every sample the uninterrupted
    run trained is trained exactly once, and (deterministic engine) every metric matches it."""
    overrides = [*_overrides(tiny, 1), "run.save_every=1"]
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    server = _server(tiny)
    try:
        _finish(_srpo_train(tiny, full_dir, server.url, overrides))
    finally:
        server.close()

    server = _server(tiny)
    try:
        proc = _srpo_train(tiny, killed_dir, server.url, overrides)
        latest = killed_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 900
        while not (latest.is_file() and latest.read_text().strip() == "step_000002"):
            assert proc.poll() is None, f"run ended before step 2 was saved:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "no step-2 checkpoint within 900 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        server.close()
    buffered = torch.load(killed_dir / "checkpoints" / "step_000002" / "rollout_buffer.pt", weights_only=True)
    assert len(buffered["pool"]["kept"]) == 4, "the checkpoint holds the next step's completed round"
    assert len(_last_per_step(killed_dir / "samples.jsonl")) < STEPS, "the kill must interrupt the run"

    server = _server(tiny)
    try:
        _finish(_srpo_train(tiny, killed_dir, server.url, overrides))
    finally:
        server.close()
    ref, got = _last_per_step(full_dir / "samples.jsonl"), _last_per_step(killed_dir / "samples.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    trained = [u for s in sorted(got) for u in got[s]["uids"]]
    assert len(trained) == len(set(trained)), "no sample is trained twice"
    assert trained == [u for s in sorted(ref) for u in ref[s]["uids"]], "nothing is lost"
    assert got == ref, "the same samples, with the same versions, at the same steps"
    ref_m = _last_per_step(full_dir / "metrics.jsonl")
    got_m = _last_per_step(killed_dir / "metrics.jsonl")
    for step in (3, 4):
        diff = {k: (ref_m[step][k], got_m[step].get(k)) for k in ref_m[step] if not k.startswith(_TIMED)}
        assert all(a == b for a, b in diff.values()), {k: v for k, v in diff.items() if v[0] != v[1]}


# ---- dynamic sampling through srpo train -----------------------------------------------------------------


def test_dynamic_sampling_trains_only_mixed_groups_and_reports_rounds(tiny, tmp_path):
    """``rollout.dynamic_sampling`` at N = 1: every trained group is mixed (the tiny run's coin reward makes
    some groups all-correct or all-wrong) unless the step says it was topped up, and the rounds and drops
    are reported."""
    overrides = _overrides(tiny, 1, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3")
    rows, metrics = _run(tiny, tmp_path, overrides)
    g, mixed_trained = 4, 0
    for r, m in zip(rows, metrics, strict=True):
        groups = [r["rewards"][i : i + g] for i in range(0, len(r["rewards"]), g)]
        unmixed = sum(len({x >= 0.5 for x in grp}) == 1 for grp in groups)
        assert unmixed == m["sampling/topped_up"], (r["step"], groups)
        mixed_trained += len(groups) - unmixed
    # kept groups may be trained a step later (the surplus); every trained mixed group was kept once
    assert sum(m["sampling/kept_groups"] for m in metrics) >= mixed_trained
    assert sum(m["sampling/rounds"] for m in metrics) >= STEPS
    assert sum(m["sampling/dropped_groups"] for m in metrics) > 0, "the coin made some groups unmixed"


# ---- partial rollouts through srpo train -----------------------------------------------------------------


def test_partial_rollouts_are_aborted_at_the_sync_and_continued_with_the_new_weights(tiny, tmp_path):
    """``rollout.partial`` at N = 1: the stand-in holds the first sample of every round dispatched ahead
    at its 3rd decode step until the sync's pause aborts it (the rounds the trainer waits for, the
    round's other samples and the continuations run free), so that sample holds tokens of the version
    the round was dispatched with and of the next: per-token versions recorded, ``async/partial_share``
    counts it, staleness is by the dispatch version. One ``/generate`` per sample, one in flight
    (``rollout.sglang.concurrent_requests=1``) so the order of requests, and so the held one, is fixed."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    per_round = 16  # samples per round: one /generate each

    def hold_rounds_dispatched_ahead(step, aborted):  # after each decode step, numbered from 1
        # /generate requests in order, one in flight: 1..16 the first round (the trainer waits for it),
        # then per round dispatched ahead its 16 samples (the first held until the sync aborts it; the
        # others wait at the pause and run with the new weights) and the held sample's continuation
        n = sum(path == "/generate" for path, _ in list(server.bodies))
        if step == 3 and n > per_round and (n - per_round - 1) % (per_round + 1) == 0:
            aborted.wait(timeout=300)

    server.engine.step_hook = hold_rounds_dispatched_ahead
    run_dir = tmp_path / "run"
    try:
        overrides = _overrides(tiny, 1, "rollout.partial=true", "rollout.sglang.concurrent_requests=1")
        run_distributed(_train, 1, tiny, str(run_dir), server.url, overrides, timeout=900)
    finally:
        server.close()
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["token_versions"] == [[1]] * 16 and metrics[0]["async/partial_share"] == 0.0
    for r, m in zip(rows[1:], metrics[1:], strict=True):
        v = r["trainer_version"]
        # the first sample was held mid-way (tokens of both versions); the others were sent after it
        # came back aborted, waited at the pause and ran with the new weights: all their tokens are v's
        assert r["token_versions"] == [[v - 1, v]] + [[v]] * 15, r
        assert set(r["versions"]) == {v - 1} and m["async/staleness_max"] == 1.0, "stamped at dispatch"
        assert m["async/partial_share"] == 1 / 16
        assert m["rollout/aborted"] > 0, "the generations the sync aborted are counted"
    assert metrics[0]["rollout/aborted"] == 0.0
    generate = [b for p, b in server.bodies if p == "/generate"]
    assert all(len(b["input_ids"]) == 1 for b in generate), "one /generate per sample"
    assert "/pause_generation" in [p for p, _ in server.bodies]
