"""A checkpoint save with the colocated offload releases EVERY engine, then resyncs all of them to the
same version (``RolloutService.offloaded_for_save``; CPU, gloo, world 2, one engine per rank).

Before the fix only engine 0 (global rank 0) released: every other engine kept its memory while its
ranks' trainer state came back for the save. The resync re-pushes the served version, which a released
engine takes (the version gate refused it and every engine was restarted instead).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from srpo_megatron.testing.distributed import run_distributed

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_save_offload"), num_prompts=4)


def _save_worker(rank, world, tiny, run_dir):
    import torch.distributed as dist

    from srpo_megatron.config import load_config
    from srpo_megatron.data.dataset import build_datasets
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rewards import register_reward
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.config import TrainConfig
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.collect.rollout_service import RolloutService

    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    _, hf, data = tiny
    cfg = load_config(
        TrainConfig,
        str(RECIPE),
        [
            f"model.hf_dir={hf}",
            f"data.train_files=[{data}]",
            f"run.dir={run_dir}",
            "rollout.gpus_per_engine=1",
            "parallel.offload_during_rollout=true",
        ],
    )
    groups = initialize_model_parallel(1, 1, seed=1)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    prompts = list(build_datasets(cfg.data, tokenizer)[0])[:2]
    policy = Policy(cfg, groups)
    service = RolloutService(cfg, tokenizer, policy, groups)
    out = {"hosts": service.engine is not None}
    policy.offload.before_rollouts()
    service.sync(1)
    service.collect(prompts, step=0)  # the engines release after generating (colocated)
    policy.offload.after_rollouts()
    policy.offload.before_rollouts()  # the train loop: offload, then sync the next version
    service.sync(2)
    during: dict = {}

    def save():
        during["engine"] = service.engine.health().detail if service.engine is not None else None
        during["offloaded"] = sorted(policy.offload.away)

    with service.offloaded_for_save(policy.offload, 2):
        save()
    out.update(during=during, versions=service.engine_versions(), restarts=service.restarts)
    out["after"] = sorted(policy.offload.away)
    out["samples"] = len(service.collect(prompts, step=1).samples)  # serving again
    service.close()
    dist.barrier()
    return out


def test_every_colocated_engine_releases_for_the_save_and_serves_the_same_version_after(tiny, tmp_path):
    res = run_distributed(_save_worker, 2, tiny, str(tmp_path), timeout=900)
    assert [r["hosts"] for r in res] == [True, True], "one engine per rank"
    during = [r["during"] for r in res]
    assert all(d["engine"].startswith("released") for d in during), f"an engine kept its memory: {during}"
    assert all(d["offloaded"] == [] for d in during), "the trainer's state is on the device for the save"
    for r in res:
        assert r["versions"] == [2, 2] and r["restarts"] == 0, "resynced in place, not restarted"
        assert r["after"], "offloaded again for the rollouts"
        assert r["samples"] == 4  # the rank's DP share (DP2) of 2 prompts x G=4
