"""Rollouts data-parallel over every rank group (CPU, gloo, world 4, TP2, ``rollout.gpus_per_engine=2``).

Two transformers engines (the CPU stand-in for two SGLang engines) are hosted on ranks 0 and 2, each fed
by its own TP group. Checked against a one-engine run of the same job (``gpus_per_engine=4``): the
prompts split evenly, both engines serve the same version after every sync, rollouts are token-identical,
and an engine that dies is restarted alone (the other engine object survives) and the job continues.
Two SRPO steps of ``srpo train`` report ``rollout/engines`` in metrics.jsonl; the same run with engine 1
killed during step 2's rollouts restarts it alone, resynced to the current version, and then matches the
fault-free run token for token and metric for metric; a second failure stops the job naming the engine.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import RankFailed, run_distributed
from tests.helpers.recipe import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_engines"), num_prompts=8)


def _cfg(tiny, run_dir, extra=()):
    return tiny_config(tiny, run_dir, ["parallel.tp=2", *extra])


def _engines(rank, world, tiny, run_dir):
    import torch.distributed as dist

    from srpo_megatron.data.dataset import build_datasets
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rewards import register_reward
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.collect.rollout_service import RolloutService

    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    groups = initialize_model_parallel(2, 1, seed=1)
    two = _cfg(tiny, run_dir, ["rollout.gpus_per_engine=2"])
    one = _cfg(tiny, run_dir, ["rollout.gpus_per_engine=4"])
    tokenizer = load_tokenizer(two.model.hf_dir)
    prompts = list(build_datasets(two.data, tokenizer)[0])[:4]
    policy = Policy(two, groups)
    out = {}
    single = RolloutService(one, tokenizer, policy, groups)
    single.sync(1)
    ref = single.collect(prompts, step=0)
    single.close()
    service = RolloutService(two, tokenizer, policy, groups)
    out["hosts"] = service.engine is not None
    service.sync(1)
    out["versions_1"] = service.engine_versions()
    first = service.collect(prompts, step=0)
    out["metrics"] = {k: v for k, v in first.metrics.items() if k.startswith("rollout/")}
    tokens = lambda b: [s.response_ids for s in b.samples]  # noqa: E731
    out["identical"] = tokens(first) == tokens(ref)
    out["logp_close"] = all(
        abs(a - b) < 1e-5
        for s, r in zip(first.samples, ref.samples, strict=True)
        for a, b in zip(s.rollout_logp, r.rollout_logp, strict=True)
    )
    service.sync(2)
    out["versions_2"] = service.engine_versions()
    kept = service.engine
    if rank == 2:
        service.engine.shutdown()  # engine 1 dies between steps: it refuses to generate from now on
    again = service.collect(prompts, step=1)
    out["restarts"] = service.restarts
    out["engine_kept"] = service.engine is kept  # only engine 1's host rebuilt its engine
    out["versions_after_restart"] = service.engine_versions()
    service.sync(3)  # training continues: the next sync reaches both engines
    third = service.collect(prompts, step=2)
    out["versions_3"] = service.engine_versions()
    out["samples_after"] = (len(again.samples), len(third.samples))
    service.close()
    dist.barrier()
    return out


@pytest.mark.engine_faults  # restarts an engine on purpose
def test_two_engines_serve_split_prompts_same_version_same_tokens_and_restart_alone(tiny, tmp_path):
    res = run_distributed(_engines, 4, tiny, str(tmp_path), timeout=900)
    assert [r["hosts"] for r in res] == [True, False, True, False], "engines on the first rank of each pair"
    m = res[0]["metrics"]
    assert m["rollout/engines"] == 2.0
    assert (
        m["rollout/samples_per_engine_min"] == m["rollout/samples_per_engine_max"] == 8.0
    )  # 2 prompts × G=4
    for r in res:
        assert r["versions_1"] == [1, 1] and r["versions_2"] == [2, 2] and r["versions_3"] == [3, 3]
        assert r["versions_after_restart"] == [2, 2], (
            "the restarted engine is resynced to the current version"
        )
        assert r["restarts"] == 1
    assert res[0]["identical"] and res[0]["logp_close"], "2 engines must reproduce the 1-engine rollouts"
    assert res[0]["engine_kept"] and not res[2]["engine_kept"], "only the failed engine is rebuilt"
    assert res[0]["samples_after"] == (8, 8)  # rank 0's DP share (TP2 x DP2) of 4 prompts x G=4


_GENERATED: list[dict] = []  # this rank process's generate calls: engine, build, version served, tokens


def _record_engines(fault: str) -> Counter:
    """Wrap ``build_engine`` in this rank process: every engine records what it generates, and with
    ``fault`` engine 1 dies the way a crashed engine process does (shut down: it refuses to generate, the
    call raises ``EngineError``) — ``"once"``: its first build at its second call (step 2's rollouts);
    ``"always"``: every build at its first call. Returns the builds per engine index (filled as they come)."""
    from srpo_megatron.rollout import factory

    real, builds = factory.build_engine, Counter()

    def build(rollout, model_path, *, engine_index=0, **kw):
        engine = real(rollout, model_path, engine_index=engine_index, **kw)
        builds[engine_index] += 1
        nth, calls, generate = builds[engine_index], [0], engine.generate

        def recorded(prompts, params):
            calls[0] += 1
            dies = fault == "always" or (fault == "once" and nth == 1 and calls[0] == 2)
            if engine_index == 1 and dies:
                engine.shutdown()
            out = generate(prompts, params)
            tokens = [[c.token_ids for c in g] for g in out]
            _GENERATED.append(
                {"engine": engine_index, "build": nth, "version": engine.weight_version, "tokens": tokens}
            )
            return out

        engine.generate = recorded
        return engine

    factory.build_engine = build  # RolloutService._build imports it at call time
    return builds


def _train_rank(rank, world, tiny, run_dir, fault=""):
    import contextlib
    import io

    from srpo_megatron.train import train

    builds, log = _record_engines(fault), io.StringIO()
    cfg = _cfg(tiny, run_dir, ["rollout.gpus_per_engine=2", "train.steps=2", "run.save_every=0"])
    with contextlib.redirect_stdout(log):  # the rank's [srpo] lines: the restart must be logged
        train(cfg)
    return {"builds": dict(builds), "generated": list(_GENERATED), "log": log.getvalue()}


@pytest.fixture(scope="module")
def clean_run(tiny, tmp_path_factory):
    """Two SRPO steps of ``srpo train`` on two engines, no fault: the reference for the restart test."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    res = run_distributed(_train_rank, 4, tiny, str(run_dir), timeout=1200)
    return res, [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_srpo_train_two_steps_on_two_engines(clean_run):
    res, rows = clean_run
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/engines"] == 2.0 and row["engine/restarts"] == 0.0
        assert row["rollout/samples_per_engine_min"] == row["rollout/samples_per_engine_max"]
        assert row["rollout/engine_seconds_max"] > 0 and row["rollout/sync_s"] > 0
    assert [r["builds"] for r in res] == [{0: 1}, {}, {1: 1}, {}]


# Timings differ between runs; everything else in a step's metrics is a function of the rollouts and weights.
_TIMED = (
    "time/",
    "perf/",
    "rollout/engine_seconds_max",
    "rollout/sync_s",
    "engine/restarts",
    "async/engine_idle",
    "async/trainer_idle",
)


@pytest.mark.engine_faults  # restarts an engine on purpose
def test_srpo_train_restarts_an_engine_killed_mid_rollout_alone_and_continues(tiny, tmp_path, clean_run):
    """Engine 1 (ranks 2-3) dies during step 2's rollouts: it alone is rebuilt, resynced to v2 and its
    prompts retried; the run then matches the fault-free run token for token and metric for metric, and
    metrics.jsonl / the log show the restart."""
    res = run_distributed(_train_rank, 4, tiny, str(tmp_path / "run"), "once", timeout=1200)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ref, ref_rows = clean_run
    assert [r["builds"] for r in res] == [{0: 1}, {}, {1: 2}, {}], "only the failed engine is rebuilt"
    assert [(g["build"], g["version"]) for g in res[2]["generated"]] == [(1, 1), (2, 2)], (
        "the restarted engine serves the current version"
    )
    retry, reference = res[2]["generated"][1], ref[2]["generated"][1]
    assert retry["tokens"] == reference["tokens"], "the retried prompts give the fault-free rollouts"
    assert res[0]["generated"] == ref[0]["generated"], "engine 0 is untouched"
    assert [r["engine/restarts"] for r in rows] == [0.0, 1.0]
    assert len(rows) == 2 and all(
        r[k] == c[k] for r, c in zip(rows, ref_rows, strict=True) for k in c if not k.startswith(_TIMED)
    ), "training continues exactly as without the fault"
    log = res[0]["log"]
    assert "[srpo] engine 1 (trainer ranks / GPUs 2-3, weights v2) failed at step 2" in log
    assert "restarting it alone and resyncing" in log


@pytest.mark.engine_faults  # restarts an engine on purpose
def test_srpo_train_stops_on_a_second_engine_failure_naming_engine_gpus_and_version(tiny, tmp_path):
    """Engine 1 dies again after its restart (step 1's rollouts): the job stops, naming it."""
    with pytest.raises(RankFailed) as err:
        run_distributed(_train_rank, 4, tiny, str(tmp_path / "run"), "always", timeout=1200)
    msg = str(err.value)
    assert "EngineError: engine 1 (trainer ranks / GPUs 2-3, weights v1) failed at step 1" in msg
    assert "again after a restart; giving up" in msg


def _separate(rank, world, tiny, run_dir, urls, pp=1, sync="distributed"):
    import os

    from srpo_megatron.data.dataset import build_datasets
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rewards import register_reward
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.collect.rollout_service import RolloutService
    from srpo_megatron.weights.export import iter_stage_hf_tensors

    os.environ["SRPO_ENGINE_URLS"], os.environ["SRPO_SYNC_HOST"] = ",".join(urls), "127.0.0.1"
    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    groups = initialize_model_parallel(1, pp, seed=1)
    _, hf, _ = tiny
    cfg = _cfg(
        tiny,
        run_dir,
        [
            "parallel.tp=1",
            f"parallel.pp={pp}",
            "rollout.engine=sglang",
            "rollout.placement=separate",
            "rollout.engine_nodes=1",
            f"rollout.sglang={{model_path: {hf}, weight_sync: {sync}, bucket_bytes: 1048576, "
            f"disk_sync_dir: {run_dir}/sync}}",
        ],
    )
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    prompts = list(build_datasets(cfg.data, tokenizer)[0])[:2]
    policy = Policy(cfg, groups)
    service = RolloutService(cfg, tokenizer, policy, groups)
    service.sync(1)
    batch = service.collect(prompts, step=0)
    sent = {n: t.clone() for n, t in iter_stage_hf_tensors(policy.model, policy.table, groups)}
    out = {"versions": service.engine_versions(), "metrics": batch.metrics, "samples": len(batch.samples)}
    out["sent"] = sent
    service.close()
    return out


def test_separate_placement_syncs_by_broadcast_and_serves_rollouts_from_the_servers(tiny, tmp_path):
    """`srpo train`'s rollout side with placement=separate at world 1: the engine URL comes from
    SRPO_ENGINE_URLS, weights go by broadcast (gloo) into the stand-in SGLang server, rollouts come back
    over HTTP stamped with the synced version."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    with torch.no_grad():
        for p in server.model.parameters():
            p.zero_()  # only the broadcast can give the server the policy's weights
    try:
        (res,) = run_distributed(_separate, 1, tiny, str(tmp_path), [server.url], timeout=600)
        assert res["versions"] == [1] and server.version == "1"
        assert res["metrics"]["rollout/engines"] == 1.0 and res["samples"] == 8  # 2 prompts x G=4
        got = dict(server.model.state_dict())
        assert all(torch.equal(got[n], t) for n, t in res["sent"].items()), "the server holds the policy"
        paths = [p for p, _ in server.bodies]
        assert "/init_weights_update_group" in paths and "/update_weights_from_distributed" in paths
        last_bucket = max(i for i, p in enumerate(paths) if p == "/update_weights_from_distributed")
        assert paths.count("/flush_cache") == 1 and paths.index("/flush_cache") > last_bucket, (
            "one sync: one cache flush, after its last bucket"
        )
    finally:
        server.close()


def test_separate_placement_pp2_both_stage_senders_broadcast_into_the_server(tiny, tmp_path):
    """The same at world 2, PP2, into a TP2 stand-in server: each stage's sender builds its own group
    (``srpo-pp0-g0``, ``srpo-pp1-g0``, world 1 + 2) and broadcasts its stage; the server ends holding the
    whole policy (zeroed before: a stage that did not send leaves zeros) at v1 and serves the rollouts."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]), tp_size=2)
    with torch.no_grad():
        for p in server.model.parameters():
            p.zero_()
    try:
        res = run_distributed(_separate, 2, tiny, str(tmp_path), [server.url], 2, timeout=600)
        assert [r["versions"] for r in res] == [[1], [1]] and server.version == "1"
        assert res[0]["metrics"]["rollout/engines"] == 1.0 and res[0]["samples"] == res[1]["samples"] == 8
        stage0, stage1 = res[0]["sent"], res[1]["sent"]
        assert stage0 and stage1 and not set(stage0) & set(stage1), "each stage sends its own tensors"
        got = dict(server.model.named_parameters())
        sent = {**stage0, **stage1}
        assert set(got) <= set(sent) | {"lm_head.weight"}, "the server got every tensor of the policy"
        assert all(torch.equal(got[n], t) for n, t in sent.items() if n in got), "the server holds the policy"
        groups = {b["group_name"] for p, b in server.bodies if p == "/update_weights_from_distributed"}
        inits = [b for p, b in server.bodies if p == "/init_weights_update_group"]
        assert groups == {"srpo-pp0-g0", "srpo-pp1-g0"} and {b["world_size"] for b in inits} == {3}
        assert [p for p, _ in server.bodies].count("/flush_cache") == 1, "two stages, one sync: one flush"
    finally:
        server.close()


def test_separate_placement_with_disk_sync_writes_one_folder_per_server_and_serves_it(tiny, tmp_path):
    """weight_sync=disk through `srpo train`'s rollout side (the ``DiskSync`` strategy): the engine's
    host writes the policy into ``<disk_sync_dir>/engine0`` with the model's config, the server loads
    that folder (``/update_weights_from_disk``, version stamped), its cache is flushed once, and the
    rollouts come from the synced weights."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    with torch.no_grad():
        for p in server.model.parameters():
            p.zero_()  # only the folder can give the server the policy's weights
    try:
        (res,) = run_distributed(_separate, 1, tiny, str(tmp_path), [server.url], 1, "disk", timeout=600)
        assert res["versions"] == [1] and server.version == "1"
        assert res["samples"] == 8
        got = dict(server.model.state_dict())
        assert all(torch.equal(got[n], t) for n, t in res["sent"].items()), "the server holds the policy"
        paths = [p for p, _ in server.bodies]
        loads = [b for p, b in server.bodies if p == "/update_weights_from_disk"]
        assert [b["model_path"] for b in loads] == [str(tmp_path / "sync" / "engine0")]
        assert "/update_weights_from_tensor" not in paths and "/init_weights_update_group" not in paths
        assert paths.count("/flush_cache") == 1 and paths.index("/flush_cache") > paths.index(
            "/update_weights_from_disk"
        )
        folder = tmp_path / "sync" / "engine0"
        assert (folder / "config.json").exists() and list(folder.glob("*.safetensors"))
    finally:
        server.close()


def _incomplete_broadcast(rank, world, tiny, run_dir, urls, plant):
    """TP2 at world 2 (rank 1 joins its stage's gathers but sends nothing) against a manifest with one
    tensor the policy lacks: every rank must see the sync fail alike."""
    import os

    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rollout.base import EngineError
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.collect.rollout_service import RolloutService
    from srpo_megatron.weights.export import is_stage_sender
    from srpo_megatron.weights.sync_common import served_manifest

    os.environ["SRPO_ENGINE_URLS"], os.environ["SRPO_SYNC_HOST"] = ",".join(urls), "127.0.0.1"
    groups = initialize_model_parallel(2, 1, seed=1)
    _, hf, _ = tiny
    sglang = f"{{model_path: {hf}, weight_sync: distributed, bucket_bytes: 1048576}}"
    overrides = ["rollout.engine=sglang", "rollout.placement=separate", "rollout.engine_nodes=1"]
    cfg = _cfg(tiny, run_dir, [*overrides, f"rollout.sglang={sglang}"])
    policy = Policy(cfg, groups)
    service = RolloutService(cfg, load_tokenizer(cfg.model.hf_dir), policy, groups)
    manifest, aliases = served_manifest(cfg)
    extra = ({**manifest, "model.extra.weight": (2,)}, aliases)
    # planted: the old service knew the manifest on the stage senders only ({} elsewhere)
    service.weight_sync._manifest = extra if not plant or is_stage_sender(groups) else ({}, aliases)
    try:
        service.sync(1)
        return "synced"
    except EngineError as e:
        return str(e)
    finally:
        service.close()


def test_an_incomplete_broadcast_fails_on_every_rank_alike(tiny, tmp_path):
    """A broadcast that misses a tensor of the served manifest fails the sync on every rank (restart,
    retry, then the job stops naming the engine), the stage sender and the TP rank that only joined the
    gathers alike, and flushes nothing. With the manifest known on the senders only (the old
    RolloutService; ``plant=True``) the other rank found nothing missing and waited in the flush's
    broadcast for rank 0, which had returned: the ranks' collectives no longer matched."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    try:
        res = run_distributed(_incomplete_broadcast, 2, tiny, str(tmp_path), [server.url], False, timeout=600)
        assert all("failed the weight sync again after a restart" in r for r in res), res
        assert "/flush_cache" not in [p for p, _ in server.bodies], "an incomplete sync flushes nothing"
    finally:
        server.close()
