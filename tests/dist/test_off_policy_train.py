"""`srpo train` with off-policy rollouts (``rollout.off_policy_steps``) in separate placement on CPU: the
stand-in SGLang server in this process, reached through ``SRPO_ENGINE_URLS``, weights broadcast into it
(gloo), the trainer at world 1 (a spawned rank, as ``run_distributed`` starts them).

- At N = 1 every trained sample's weight version is exactly one behind the trainer's at its step (the
  first step has no older weights: it trains the starting weights' samples). Planted: a version stamped
  when the trainer receives the round (after the sync that followed its generation) instead of when it
  was dispatched is caught by the same check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.recipe import tiny_config

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
    from srpo_megatron.trainer import off_policy

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
