"""Separate placement: the SGLang servers of one engine node, started and kept alive by the job itself.

`srpo launch` (``launch/engine_nodes.py``) runs ``python -m srpo_megatron.rollout.sglang.servers RECIPE
--override ...`` once on each of the job's ``rollout.engine_nodes`` last nodes. This process starts one
``sglang.launch_server`` per ``tp_size`` GPUs of its node (``--base-gpu-id`` = its first GPU, port
``BASE_PORT + i``) and restarts a server that exits, so a crashed engine comes back at the same address and
the trainer only has to wait for it and resync it. The trainer finds the servers through
``SRPO_ENGINE_URLS`` (written by the job from the allocated host names with :func:`server_urls`, the same
numbering as here).

An engine larger than a node (``tp_size`` > the node's GPUs, e.g. bf16 DeepSeek-V3 at TP32 on 8-GPU nodes)
takes ``tp_size / gpus_per_node`` whole consecutive engine nodes: SGLang's ``--nnodes``, ``--node-rank``
(this node's rank within its engine) and ``--dist-init-addr`` (the engine's first node, port
``DIST_INIT_PORT``). Only node rank 0 serves HTTP (SGLang's ``http_server`` returns on the others after
their scheduler workers exit), so ``SRPO_ENGINE_URLS`` lists each engine's first node only. This node's
place comes from ``SRPO_ENGINE_HOSTS`` (the job's engine host names, exported by the sbatch lines) and
``SLURM_PROCID`` (the engine step runs one task per node, so the task rank is the node's index).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from srpo_megatron.config import ConfigError, RolloutConfig, SGLangEngineConfig, load_recipe
from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.rollout.sglang.lora_requests import lora_server_args

BASE_PORT = 30000  # engine i of a node listens on BASE_PORT + i
DIST_INIT_PORT = 20000  # an engine over several nodes: SGLang's rendezvous on its first node (+ a few ports)
MAX_RESTARTS = 3  # a server that exits more often than this stops the node (and so the job's engines)


def engines_per_node(gpus_per_node: int, tp_size: int) -> int:
    """SGLang servers on one engine node: its GPUs ÷ the engine's TP size (must divide)."""
    if tp_size < 1 or gpus_per_node < tp_size or gpus_per_node % tp_size:
        raise ConfigError(
            f"rollout.sglang.engine_kwargs.tp_size={tp_size} does not divide the {gpus_per_node} GPUs of an "
            "engine node; pick a divisor so every server owns whole GPUs"
        )
    return gpus_per_node // tp_size


def nodes_per_engine(gpus_per_node: int, tp_size: int, engine_nodes: int | None = None) -> int:
    """Engine nodes one SGLang engine spans: 1 when ``tp_size`` fits a node (it must divide the node's
    GPUs), else ``tp_size / gpus_per_node`` whole nodes (``tp_size`` must be a multiple of the node's GPUs,
    and ``engine_nodes``, when given, a multiple of the span, so every engine owns whole nodes)."""
    if tp_size <= gpus_per_node:
        engines_per_node(gpus_per_node, tp_size)  # refuses a tp_size that does not divide the node
        return 1
    if tp_size % gpus_per_node:
        raise ConfigError(
            f"rollout.sglang.engine_kwargs.tp_size={tp_size} spans several engine nodes but is not a "
            f"multiple of their {gpus_per_node} GPUs; pick a multiple of {gpus_per_node} (the engine then "
            f"takes whole nodes) or a divisor of {gpus_per_node}"
        )
    span = tp_size // gpus_per_node
    if engine_nodes is not None and engine_nodes % span:
        raise ConfigError(
            f"rollout.engine_nodes={engine_nodes} is not a multiple of the {span} nodes one engine of "
            f"rollout.sglang.engine_kwargs.tp_size={tp_size} spans ({gpus_per_node} GPUs per node); set "
            f"rollout.engine_nodes to a multiple of {span} (e.g. {span * max(1, engine_nodes // span)})"
        )
    return span


def server_urls(hosts: list[str], per_node: int, span: int = 1) -> list[str]:
    """Base URL of every server, host by host, in engine order (engine ``n * per_node + i``). An engine over
    ``span`` nodes serves HTTP on its first node only: one URL per engine, every ``span``-th host."""
    return [f"http://{h}:{BASE_PORT + i}" for h in hosts[::span] for i in range(per_node)]


@dataclass(frozen=True)
class NodePart:
    """This node's part of an engine spanning ``nnodes`` nodes (SGLang's ``--nnodes`` ...)."""

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""  # "HOST:PORT" of the engine's first node ("" on one node)

    def argv(self) -> list[str]:
        if self.nnodes == 1:
            return []
        rank = ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank)]
        return [*rank, "--dist-init-addr", self.dist_init_addr]


def node_part(hosts: list[str], index: int, span: int) -> NodePart:
    """Engine node ``index`` (of ``hosts``, the job's engine nodes in order) in an engine of ``span``
    nodes: engine ``index // span``, node rank ``index % span``, rendezvous on the engine's first node."""
    if not 0 <= index < len(hosts):
        raise ConfigError(
            f"engine node index {index} is outside the {len(hosts)} engine hosts {hosts} "
            "(SRPO_ENGINE_HOSTS); run the servers step with one task per engine node "
            "(srun --ntasks-per-node=1)"
        )
    if span == 1:
        return NodePart()
    first = hosts[index - index % span]
    return NodePart(span, index % span, f"{first}:{DIST_INIT_PORT}")


def _flag(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, list | tuple):  # nargs="+" flags (e.g. --lora-target-modules q_proj v_proj)
        return [flag, *(str(v) for v in value)]
    return [flag, str(value)]


def server_argv(
    cfg: SGLangEngineConfig,
    index: int,
    python: str = sys.executable,
    routed_experts: bool = False,
    part: NodePart | None = None,
) -> list[str]:
    """``sglang.launch_server`` command of server ``index`` on this node. Separate placement: no memory
    saver (nothing else uses these GPUs), deterministic inference only when asked, routed experts
    reported when ``routed_experts`` (``rollout.routing_replay``); the recipe's ``engine_kwargs`` become
    the matching ``--flags``; ``part``: this node's share of an engine over several nodes."""
    tp = cfg.tp_size
    argv = [python, "-m", "sglang.launch_server", "--model-path", cfg.model_path]
    argv += ["--host", "0.0.0.0", "--port", str(BASE_PORT + index), "--base-gpu-id", str(index * tp)]
    argv += (part or NodePart()).argv()
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


def server_commands(
    rollout: RolloutConfig, gpus: int, hosts: list[str] | None = None, index: int = 0
) -> list[list[str]]:
    """The ``sglang.launch_server`` commands of engine node ``index`` (of the job's engine ``hosts``) with
    ``gpus`` GPUs, in engine order: one per ``tp_size`` GPUs, or this node's part of a larger engine."""
    if rollout.sglang is None:
        raise ConfigError("rollout.sglang is missing; separate placement runs SGLang servers")
    tp = rollout.sglang.tp_size
    span = nodes_per_engine(gpus, tp, rollout.engine_nodes if rollout.placement == "separate" else None)
    if span == 1:
        replay = rollout.routing_replay
        return [
            server_argv(rollout.sglang, i, routed_experts=replay) for i in range(engines_per_node(gpus, tp))
        ]
    if hosts is None:
        raise ConfigError(
            f"rollout.sglang.engine_kwargs.tp_size={tp} spans {span} engine nodes: the servers need the "
            "job's engine host names (SRPO_ENGINE_HOSTS, exported by `srpo launch`'s sbatch script)"
        )
    if len(hosts) != rollout.engine_nodes:
        raise ConfigError(
            f"SRPO_ENGINE_HOSTS lists {len(hosts)} hosts but rollout.engine_nodes={rollout.engine_nodes}; "
            "launch with `srpo launch` (it exports the engine nodes' host names) and the recipe's value"
        )
    part = node_part(hosts, index, span)
    return [server_argv(rollout.sglang, 0, routed_experts=rollout.routing_replay, part=part)]


def recipe_rollout_config(recipe: str, overrides: list[str]) -> RolloutConfig:
    """The recipe's ``rollout`` section with ``--override`` items applied: the whole recipe loads as the
    trainer loads it (``load_recipe``), so servers never start for a recipe `srpo train` refuses; with
    ``lora.sync: adapter`` its SGLang ``engine_kwargs`` gain the LoRA flags (``with_lora_flags``)."""
    cfg = load_recipe(recipe, overrides)
    return with_lora_flags(cfg.rollout, cfg.lora)


def with_lora_flags(rollout: RolloutConfig, lora: LoraConfig) -> RolloutConfig:
    """``rollout`` whose SGLang ``engine_kwargs`` carry what an adapter sync needs (``--enable-lora``,
    ``--max-lora-rank``, ``--lora-target-modules``, ``--max-loras-per-batch``, ``--max-loaded-loras``:
    ``lora_requests.lora_server_args``) when ``lora.sync`` is ``adapter``; the recipe's own
    ``engine_kwargs`` win. Unchanged otherwise (merged syncs send plain weights)."""
    if rollout.sglang is None or not lora.enabled or lora.sync != "adapter":
        return rollout
    flags = lora_server_args(lora, lora.target_modules)
    sglang = dataclasses.replace(rollout.sglang, engine_kwargs={**flags, **rollout.sglang.engine_kwargs})
    return dataclasses.replace(rollout, sglang=sglang)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of this node (default: all visible)")
    parser.add_argument(
        "--hosts",
        default=os.environ.get("SRPO_ENGINE_HOSTS", ""),
        help="the job's engine host names, comma-separated (default: $SRPO_ENGINE_HOSTS)",
    )
    parser.add_argument(
        "--node-index",
        type=int,
        default=int(os.environ.get("SLURM_PROCID", "0")),
        help="this node's index among the engine hosts (default: $SLURM_PROCID, one task per node)",
    )
    parser.add_argument("--print", action="store_true", help="print this node's server commands; start none")
    args = parser.parse_args(argv)
    rollout = recipe_rollout_config(args.recipe, args.override)
    if rollout.sglang is None:
        raise ConfigError(f"{args.recipe}: rollout.sglang is missing; separate placement runs SGLang servers")
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    hosts = [h for h in args.hosts.split(",") if h] or None
    cmds = server_commands(rollout, args.gpus, hosts, args.node_index)
    if args.print:
        for c in cmds:
            print(" ".join(c))
        return 0
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
