"""``rollout.routing_replay`` starts SGLang able to report routed experts: SGLang answers
``return_routed_experts`` only when launched with ``enable_return_routed_experts`` (``--enable-return-
routed-experts``). Both launch paths are checked through the code the product runs: the colocated
offline engine (``factory.build_engine`` -> ``SGLangEngine`` -> its child's ``sglang.Engine`` kwargs) and
the separate-placement servers (``servers.main``'s commands from a recipe and ``--override``s)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import ClassVar

import pytest

from srpo_megatron.config import ConfigError, RolloutConfig, SGLangEngineConfig
from srpo_megatron.rollout.sglang import engine as engine_module
from srpo_megatron.rollout.sglang.engine import offline_engine_kwargs
from srpo_megatron.rollout.sglang.servers import recipe_rollout_config, server_argv, server_commands

REPO = Path(__file__).resolve().parents[2]
MOE_RECIPE = REPO / "examples" / "qwen3_30b_a3b_srpo.yaml"  # placement: separate, 1 engine of TP 8
FLAG = "--enable-return-routed-experts"


class RecordedChild:
    """Stands in for ``ChildEngineTransport`` (which would start ``sglang.Engine(**kwargs)`` in a child
    process, impossible without a GPU): records the kwargs the engine would be started with."""

    started: ClassVar[list[dict]] = []

    def __init__(self, engine_kwargs, startup_timeout_s, timeout_s):
        RecordedChild.started.append(dict(engine_kwargs))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.mark.parametrize("replay", [True, False])
def test_colocated_engine_starts_with_routed_experts_when_replaying(tiny_moe, monkeypatch, replay):
    from srpo_megatron.rollout.factory import build_engine

    monkeypatch.setattr(engine_module, "ChildEngineTransport", RecordedChild)
    RecordedChild.started = []
    rollout = RolloutConfig(
        engine="sglang", routing_replay=replay, sglang=SGLangEngineConfig(model_path=str(tiny_moe))
    )
    build_engine(rollout, str(tiny_moe), base_gpu_id=2)
    (kwargs,) = RecordedChild.started
    assert kwargs.get("enable_return_routed_experts", False) is replay
    assert kwargs["base_gpu_id"] == 2 and kwargs["enable_memory_saver"] is True


@pytest.mark.parametrize("replay", [True, False])
def test_engine_node_servers_start_with_routed_experts_when_replaying(replay):
    rollout = recipe_rollout_config(str(MOE_RECIPE), [f"rollout.routing_replay={str(replay).lower()}"])
    (argv,) = server_commands(rollout, gpus=8)
    assert (FLAG in argv) is replay
    assert argv.count(FLAG) <= 1


def test_an_explicit_flag_is_not_doubled_and_a_contradiction_is_refused():
    cfg = SGLangEngineConfig(model_path="/m", engine_kwargs={"enable_return_routed_experts": True})
    assert server_argv(cfg, 0, routed_experts=True).count(FLAG) == 1
    assert offline_engine_kwargs(cfg, colocated=True, routed_experts=True)["enable_return_routed_experts"]
    off = SGLangEngineConfig(model_path="/m", engine_kwargs={"enable_return_routed_experts": False})
    with pytest.raises(ConfigError, match=r"routing_replay=true needs .*enable_return_routed_experts=False"):
        RolloutConfig(engine="sglang", routing_replay=True, sglang=off)
    RolloutConfig(engine="sglang", routing_replay=False, sglang=off)  # fine without replay


def test_sglang_server_args_parse_the_replaying_server_argv():
    """Where sglang imports, its own ``ServerArgs`` parses the command and sees the flag."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    rollout = recipe_rollout_config(str(MOE_RECIPE), ["rollout.routing_replay=true"])
    (argv,) = server_commands(rollout, gpus=8)
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[3:])  # after "python -m sglang.launch_server"
    assert ns.enable_return_routed_experts is True and ns.tp_size == 8
