"""Separate placement: the SGLang servers of one engine node, started and kept alive by the job itself.

`srpo launch` (``launch/engine_nodes.py``) runs ``python -m srpo_megatron.rollout.sglang.servers RECIPE
--override ...`` once on each of the job's ``rollout.engine_nodes`` last nodes. This process starts one
``sglang.launch_server`` per ``tp_size`` GPUs of its node (``--base-gpu-id`` = its first GPU, port
``BASE_PORT + i``) and restarts a server that exits, so a crashed engine comes back at the same address and
the trainer only has to wait for it and resync it. The trainer finds the servers through
``SRPO_ENGINE_URLS`` (written by the job from the allocated host names with :func:`server_urls`, the same
numbering as here).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from srpo_megatron.config import ConfigError, RolloutConfig, SGLangEngineConfig, load_recipe

BASE_PORT = 30000  # engine i of a node listens on BASE_PORT + i
MAX_RESTARTS = 3  # a server that exits more often than this stops the node (and so the job's engines)


def engines_per_node(gpus_per_node: int, tp_size: int) -> int:
    """SGLang servers on one engine node: its GPUs ÷ the engine's TP size (must divide)."""
    if tp_size < 1 or gpus_per_node < tp_size or gpus_per_node % tp_size:
        raise ConfigError(
            f"rollout.sglang.engine_kwargs.tp_size={tp_size} does not divide the {gpus_per_node} GPUs of an "
            "engine node; pick a divisor so every server owns whole GPUs"
        )
    return gpus_per_node // tp_size


def server_urls(hosts: list[str], per_node: int) -> list[str]:
    """Base URL of every server, host by host, in engine order (engine ``n * per_node + i``)."""
    return [f"http://{h}:{BASE_PORT + i}" for h in hosts for i in range(per_node)]


def _flag(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    return [flag, str(value)]


def server_argv(
    cfg: SGLangEngineConfig, index: int, python: str = sys.executable, routed_experts: bool = False
) -> list[str]:
    """``sglang.launch_server`` command of server ``index`` on this node. Separate placement: no memory
    saver (nothing else uses these GPUs), deterministic inference only when asked, routed experts
    reported when ``routed_experts`` (``rollout.routing_replay``); the recipe's ``engine_kwargs`` become
    the matching ``--flags``."""
    tp = cfg.tp_size
    argv = [python, "-m", "sglang.launch_server", "--model-path", cfg.model_path]
    argv += ["--host", "0.0.0.0", "--port", str(BASE_PORT + index), "--base-gpu-id", str(index * tp)]
    argv += ["--skip-tokenizer-init"]  # the trainer sends token ids and reads token ids
    if cfg.deterministic:
        argv += ["--enable-deterministic-inference"]
    if cfg.memory_saver:
        argv += ["--enable-memory-saver"]
    if routed_experts and "enable_return_routed_experts" not in cfg.engine_kwargs:
        argv += ["--enable-return-routed-experts"]
    for key, value in cfg.engine_kwargs.items():
        argv += _flag(key, value)
    return argv


def server_commands(rollout: RolloutConfig, gpus: int) -> list[list[str]]:
    """The ``sglang.launch_server`` commands of one engine node with ``gpus`` GPUs, in engine order."""
    if rollout.sglang is None:
        raise ConfigError("rollout.sglang is missing; separate placement runs SGLang servers")
    per_node = engines_per_node(gpus, rollout.sglang.tp_size)
    return [server_argv(rollout.sglang, i, routed_experts=rollout.routing_replay) for i in range(per_node)]


def recipe_rollout_config(recipe: str, overrides: list[str]) -> RolloutConfig:
    """The recipe's ``rollout`` section with ``--override`` items applied: the whole recipe loads as the
    trainer loads it (``load_recipe``), so servers never start for a recipe `srpo train` refuses."""
    return load_recipe(recipe, overrides).rollout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of this node (default: all visible)")
    args = parser.parse_args(argv)
    rollout = recipe_rollout_config(args.recipe, args.override)
    if rollout.sglang is None:
        raise ConfigError(f"{args.recipe}: rollout.sglang is missing; separate placement runs SGLang servers")
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    cmds = server_commands(rollout, args.gpus)
    procs = [subprocess.Popen(c) for c in cmds]
    restarts = [0] * len(cmds)
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    host = os.uname().nodename
    try:
        while not stop:
            for i, p in enumerate(procs):
                code = p.poll()
                if code is None:
                    continue
                if restarts[i] >= MAX_RESTARTS:
                    print(
                        f"[srpo] SGLang server {i} on {host} exited ({code}) {restarts[i] + 1} times; "
                        "giving up"
                    )
                    return 1
                restarts[i] += 1
                print(f"[srpo] SGLang server {i} on {host} exited ({code}); restarting it", flush=True)
                procs[i] = subprocess.Popen(cmds[i])
            time.sleep(2.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
