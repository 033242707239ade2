"""Engine placement over the trainer ranks (pure): balanced prompt split, hosts, who feeds an engine."""

from __future__ import annotations

import pytest

from srpo_megatron.config import ConfigError, RolloutConfig, SGLangEngineConfig
from srpo_megatron.rollout.placement import EngineLayout, split_prompts
from srpo_megatron.weights.engine_sync import engine_feeds
from srpo_megatron.weights.p2p import WeightSyncError


def test_split_is_balanced_contiguous_and_covers_every_prompt():
    for n, k in [(32, 8), (4, 2), (7, 3), (2, 4)]:
        parts = split_prompts(n, k)
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
        assert [i for p in parts for i in p] == list(range(n))


def test_layout_hosts_and_engine_count():
    layout = EngineLayout(32, 4)
    assert layout.num_engines == 8 and layout.hosts == [0, 4, 8, 12, 16, 20, 24, 28]
    assert layout.engine_of(13) == 3 and layout.ranks_of(3) == [12, 13, 14, 15]
    with pytest.raises(ValueError, match="gpus_per_engine=3"):
        EngineLayout(8, 3)


def test_rollout_config_engine_size_defaults_to_engine_tp():
    cfg = RolloutConfig(
        engine="sglang", sglang=SGLangEngineConfig(model_path="/m", engine_kwargs={"tp_size": 4})
    )
    assert cfg.engine_size() == 4 and cfg.num_engines(32) == 8
    assert RolloutConfig(gpus_per_engine=2).num_engines(4) == 2
    with pytest.raises(ConfigError, match="does not divide"):
        RolloutConfig(gpus_per_engine=3).num_engines(4)


def _coords(tp, dp, pp):
    """megatron's default rank order: TP fastest, then DP, then PP."""
    return [(r // tp % dp, r // (tp * dp), r % tp) for r in range(tp * dp * pp)]


def test_each_engine_is_fed_by_its_own_replica():
    # world 4, TP2, DP2, PP1, two engines: each engine's ranks are exactly one replica
    feeds = engine_feeds(EngineLayout(4, 2), _coords(2, 2, 1), [0, 1])
    assert feeds == {0: [0], 1: [2]}
    # TP2 x PP2 (DP1), two engines: both fed stage by stage by the replica's stage senders 0 and 2
    assert engine_feeds(EngineLayout(4, 2), _coords(2, 1, 2), [0, 1]) == {0: [0, 2], 1: [0, 2]}
    # TP2 x DP2 x PP2 on 8 ranks, engines of 4: engine 1 is hosted on rank 4 (stage 1 of replica 0)
    assert engine_feeds(EngineLayout(8, 4), _coords(2, 2, 2), [0, 1]) == {0: [0, 4], 1: [0, 4]}


def test_an_engine_hosted_off_tp_rank_0_is_refused():
    with pytest.raises(WeightSyncError, match=r"multiple of parallel\.tp"):
        engine_feeds(EngineLayout(4, 1), _coords(2, 2, 1), [1])


# ---- separate placement: the job's servers, as `srpo train` and the server step see them ---------------


def _separate(**sglang):
    sg = SGLangEngineConfig(**{"model_path": "/m", "weight_sync": "distributed", **sglang})
    return RolloutConfig(engine="sglang", placement="separate", engine_nodes=1, sglang=sg)


def test_engine_urls_come_from_the_job_and_must_match_its_engine_nodes(monkeypatch):
    from srpo_megatron.rollout.placement import engine_urls, separate_layout
    from srpo_megatron.rollout.sglang.servers import engines_per_node, server_urls

    monkeypatch.delenv("SRPO_ENGINE_URLS", raising=False)
    monkeypatch.delenv("SRPO_ENGINE_NODES", raising=False)
    with pytest.raises(ConfigError, match="no engine servers are known"):
        engine_urls(_separate())
    assert engine_urls(_separate(url="http://a:1, http://b:2")) == ["http://a:1", "http://b:2"]
    job = server_urls(["n3"], engines_per_node(8, 2))  # what the sbatch lines export
    assert job == [f"http://n3:{30000 + i}" for i in range(4)]
    monkeypatch.setenv("SRPO_ENGINE_URLS", ",".join(job))
    monkeypatch.setenv("SRPO_ENGINE_NODES", "1")
    assert engine_urls(_separate(url="http://ignored:1")) == job
    monkeypatch.setenv("SRPO_ENGINE_NODES", "2")
    with pytest.raises(ConfigError, match="launched with 2 engine node"):
        engine_urls(_separate())
    layout = separate_layout(8, 4)
    assert layout.hosts == [0, 2, 4, 6]  # one client per server, spread over the trainer ranks
    with pytest.raises(ConfigError, match="must divide the trainer ranks"):
        separate_layout(4, 8)
    with pytest.raises(ConfigError, match="does not divide the 8 GPUs"):
        engines_per_node(8, 3)


def test_server_argv_places_each_server_on_its_gpus_and_port():
    from srpo_megatron.rollout.sglang.servers import server_argv

    cfg = _separate(engine_kwargs={"tp_size": 2, "mem_fraction_static": 0.85, "enable_dp_attention": True})
    argv = server_argv(cfg.sglang, 3, python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    flags = " ".join(argv)
    assert "--port 30003 --base-gpu-id 6" in flags and "--tp-size 2" in flags
    assert "--mem-fraction-static 0.85" in flags and "--enable-dp-attention" in flags
    assert "--enable-memory-saver" not in flags and "--enable-deterministic-inference" not in flags


def test_separate_placement_refuses_cuda_ipc_sync():
    with pytest.raises(ConfigError, match="cannot use rollout.sglang.weight_sync=tensor".replace(".", r"\.")):
        _separate(weight_sync="tensor")
