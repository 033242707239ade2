"""`srpo train` as users run it: the torchrun line `srpo launch --cluster cluster/local.yaml` generates
(``tests/helpers/torchrun.py``), two SRPO steps of a tiny model per run.

- separate placement at world 2 (PP2, both stage senders broadcasting) into the stand-in SGLang server in
  this process, which the workers reach through ``SRPO_ENGINE_URLS`` as on a cluster (no
  ``SRPO_SYNC_HOST``: the sender finds its address itself);
- colocated, two CPU engines at world 4 (TP2, ``rollout.gpus_per_engine=2``);
- MoE at EP2 (world 2); MoE at PP2 x EP2 (world 4) with full recompute and routing replay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from srpo_megatron.config import apply_overrides, load_yaml
from srpo_megatron.launch.experiment import srpo_train_command
from tests.helpers.torchrun import check, run_torchrun

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
TIMEOUT_S = 720  # one whole torchrun run; a hang (e.g. a rendezvous nobody hosts) is killed and fails


def _recipe(tmp_path: Path, tiny, *overrides: str) -> tuple[Path, dict]:
    """The tiny recipe with this run's paths and ``overrides`` written to a file. Values with YAML brackets
    live in the file: nemo-run shell-quotes torchrun's arguments and its local scheduler passes them to
    ``Popen`` quotes and all."""
    _, hf, data = tiny
    recipe = apply_overrides(
        load_yaml(RECIPE),
        [
            f"model.hf_dir={hf}",
            f"data.train_files=[{data}]",
            f"run.dir={tmp_path / 'run'}",
            "run.save_every=0",
            "run.tensorboard=false",
            *overrides,
        ],
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, recipe


def _train(tmp_path: Path, tiny, nprocs: int, *overrides: str, env: dict | None = None) -> list[dict]:
    path, recipe = _recipe(tmp_path, tiny, *overrides)
    command = srpo_train_command(str(path), ["train.steps=2"])  # one override on the command line too
    check(run_torchrun(command, nprocs, TIMEOUT_S, env=env, recipe=recipe))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/skipped_steps"] == 0.0
        assert r["logprob/gap_max"] < 1e-4, "the engine must serve the trainer's weights"
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_torchrun"), num_prompts=8)


def _syncs(calls: list[tuple[str, dict]]) -> list[list[str]]:
    """The server's calls cut into weight syncs: each sync's calls from its first update to the next
    ``/generate`` (the trailing part after the last generate is the last sync's)."""
    syncs, current = [], None
    for path, _ in calls:
        if path == "/update_weights_from_distributed" and current is None:
            current = []
            syncs.append(current)
        if path == "/generate":
            current = None
        elif current is not None:
            current.append(path)
    return syncs


def test_separate_placement_pp2_under_torchrun_broadcasts_into_the_server_and_flushes_once(tmp_path, tiny):
    """The stage senders' weight-sync groups rendezvous with the server inside torchrun workers (a
    client-only store there never listens: the run hangs until it is killed), every sync fills the
    server (zeroed first: the rollouts' log-probs match the trainer's only with the broadcast weights),
    and every sync ends with exactly one ``/flush_cache``, after its last bucket."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]), tp_size=2)
    with torch.no_grad():
        for p in server.model.parameters():
            p.zero_()
    try:
        rows = _train(
            tmp_path,
            tiny,
            2,
            "parallel.pp=2",
            "rollout.engine=sglang",
            "rollout.placement=separate",
            "rollout.engine_nodes=1",
            f"rollout.sglang={{model_path: {tiny[1]}, weight_sync: distributed, bucket_bytes: 1048576}}",
            env={"SRPO_ENGINE_URLS": server.url},
        )
    finally:
        server.close()
    assert all(r["rollout/engines"] == 1.0 for r in rows)
    buckets = [b for p, b in server.bodies if p == "/update_weights_from_distributed"]
    assert {b["group_name"] for b in buckets} == {"srpo-pp0-g0", "srpo-pp1-g0"}, "both stages broadcast"
    assert not any(b["flush_cache"] for b in buckets), "no bucket flushes: one stage's last is not the sync's"
    syncs = _syncs(server.bodies)
    versions = {b["weight_version"] for b in buckets}
    assert len(syncs) == len(versions) >= 2, syncs
    for sync in syncs:
        updates = [i for i, p in enumerate(sync) if p == "/update_weights_from_distributed"]
        assert sync.count("/flush_cache") == 1 and sync.index("/flush_cache") > updates[-1], sync


def test_colocated_two_engines_at_world_4_under_torchrun(tmp_path, tiny):
    rows = _train(tmp_path, tiny, 4, "parallel.tp=2", "rollout.gpus_per_engine=2")
    for r in rows:
        assert r["rollout/engines"] == 2.0 and r["engine/restarts"] == 0.0
        assert r["rollout/samples_per_engine_min"] == r["rollout/samples_per_engine_max"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_torchrun_moe"), num_prompts=8, moe=True)


def test_moe_at_ep2_under_torchrun(tmp_path, tiny_moe):
    rows = _train(tmp_path, tiny_moe, 2, "parallel.ep=2")
    for r in rows:
        assert 1.0 <= r["moe/expert_load_max_over_mean"] <= 2.0, "4 experts, top-2"
        assert r["moe/router_disagreement_share"] < 0.01, "engine and trainer route alike"


def test_moe_replay_with_full_recompute_at_pp2_ep2_under_torchrun(tmp_path, tiny_moe):
    """World 4: PP2 (1F1B, stage 0 runs micro-batch k+1's forward before k's backward) x EP2, full
    recompute, routing replay: the recompute replays each micro-batch's experts (compat/router_replay.py)."""
    overrides = [
        "parallel.pp=2",
        "parallel.ep=2",
        "performance.recompute=full",
        "rollout.routing_replay=true",
    ]
    rows = _train(tmp_path, tiny_moe, 4, *overrides)
    for r in rows:
        assert r["moe/topk_mismatch_share"] == 0.0, "the engine's experts on every response token and layer"
