"""Benchmark: the bytes each trainer rank receives to get one step's rollout batch, before and after.

Setup: the MoE EP2 test's run (``tests/integration/test_train_moe.py``): a tiny random Qwen3-MoE (4 experts,
top-2, real Qwen vocabulary) on ``--world`` gloo ranks (2: EP2 = DP2; 4 with ``--tp 2``: TP2×EP2 = DP2), one
CPU engine per rank reporting its routed experts, ``examples/tiny_cpu_test.yaml``'s step of 4 prompts × 4.
The same ``RolloutService`` collects the same step twice in one run, through:

  before: the earlier path, reimplemented here as the baseline: every engine's completions, routed experts
          included, all-gathered to every rank; rank 0 routes; the batch broadcast to every rank without
          the experts, then the experts scattered to their DP share (``batch_shipping.ship_batch`` at
          3ce3955), and each rank takes its share;
  after:  ``RolloutService.collect``: completions gathered to rank 0 only, the failure list broadcast, each
          rank sent its DP share once (``batch_shipping.ship_shares``).

Bytes are counted at torch's tensor collectives that the object collectives run on (``all_gather``,
``gather``, ``broadcast``, ``scatter`` in ``torch.distributed.distributed_c10d``): what lands on this rank
from other ranks, padding and size headers included, for the whole ``collect`` (the version check too).
Both paths must give every rank the same samples (checked). Rank 0 receives the other engines' completions
on both paths (it routes them); the ratio the issue asks for is over the other ranks. Last line: one JSON
object with ``bytes_before``/``bytes_after`` per rank, ``ratio_other_ranks_max``, ``dp`` and ``inverse_dp``.

Measured (CPU, gloo): EP2 (world 2, DP2) rank 1 34706 -> 14056 B (0.405); TP2×EP2 (world 4, DP2) ranks 1-3
65550 -> 14172 B (0.216); rank 0 15422 / 46266 B on both paths. Both ≤ 1/DP = 0.5.

    .venv/bin/python tools/bench_batch_shipping.py [--world 2 --tp 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.local_ranks import run_distributed

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


class ReceivedBytes:
    """Counts the tensor bytes other ranks send to this rank through the object collectives."""

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.c10d, self.rank, self.total = c10d, dist.get_rank(), 0
        self.real = {n: getattr(c10d, n) for n in ("all_gather", "gather", "broadcast", "scatter")}

    @staticmethod
    def _root(kwargs: dict, args: tuple, name: str, pos: int) -> int:
        for key in (f"group_{name}", name):
            if kwargs.get(key) is not None:
                return kwargs[key]
        return args[pos]

    def __enter__(self) -> ReceivedBytes:
        c10d, real, me = self.c10d, self.real, self.rank

        def all_gather(out, tensor, *args, **kw):
            self.total += (
                sum(t.numel() * t.element_size() for t in out) - tensor.numel() * tensor.element_size()
            )
            return real["all_gather"](out, tensor, *args, **kw)

        def gather(tensor, gather_list=None, *args, **kw):
            if self._root(kw, args, "dst", 0) == me and gather_list:
                self.total += (
                    sum(t.numel() * t.element_size() for t in gather_list)
                    - tensor.numel() * tensor.element_size()
                )
            return real["gather"](tensor, gather_list, *args, **kw)

        def broadcast(tensor, *args, **kw):
            if self._root(kw, args, "src", 0) != me:
                self.total += tensor.numel() * tensor.element_size()
            return real["broadcast"](tensor, *args, **kw)

        def scatter(tensor, scatter_list=None, *args, **kw):
            if self._root(kw, args, "src", 0) != me:
                self.total += tensor.numel() * tensor.element_size()
            return real["scatter"](tensor, scatter_list, *args, **kw)

        for name, fn in dict(
            all_gather=all_gather, gather=gather, broadcast=broadcast, scatter=scatter
        ).items():
            setattr(c10d, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.real.items():
            setattr(self.c10d, name, fn)


def collect_before(service, prompts, step):
    """The earlier collect: all-gather of every share, rank-0 routing, broadcast + expert scatter."""
    import torch.distributed as dist

    from srpo_megatron.trainer.collect.rollout_service import engine_metrics
    from srpo_megatron.trainer.collect.sample_routing import check_group_sizes, reward_groups, route_groups
    from srpo_megatron.trainer.microbatches.batches import rank_share
    from srpo_megatron.trainer.step_types import RolloutBatch, merge_metrics

    service._check_versions()
    share = service._generate(prompts, step, set(range(service.layout.num_engines)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, share, group=service.host_group)
    shares = {s.engine: s for s in everyone if s is not None}
    g, cfg = service.groups, service.cfg
    box = [None]
    routed: list = []
    if service.rank0:
        completions = [c for k in sorted(shares) for c in shares[k].completions]
        check_group_sizes([len(c) for c in completions], cfg.rollout.group_size)
        scores = reward_groups(service.tokenizer, prompts, completions, service.rewards)
        batch = route_groups(
            service.tokenizer, prompts, completions, scores.texts, scores.rewards, cfg.loss, cfg.teacher
        )
        times = {"time/generate_s": max(s.seconds for s in shares.values()), "time/reward_s": scores.seconds}
        batch.metrics = merge_metrics(batch.metrics, times, scores.result.metrics())
        batch.metrics.update(engine_metrics(list(shares.values()), service.last_sync_s))
        routed = [s.routed_experts for s in batch.samples]
        plain = [dataclasses.replace(s, routed_experts=None) for s in batch.samples]
        box = [(RolloutBatch(plain, batch.metrics), any(r is not None for r in routed))]
    dist.broadcast_object_list(box, src=0, group=service.host_group)
    whole, _ = box[0]
    dp_of_rank = [None] * dist.get_world_size()
    dist.all_gather_object(dp_of_rank, g.dp_rank, group=service.host_group)
    payloads = None
    if service.rank0:
        idx = list(range(len(whole.samples)))
        parts = [rank_share(idx, cfg.train.mini_batches, g.dp_size, d) for d in range(g.dp_size)]
        payloads = [{i: routed[i] for i in parts[d] if routed[i] is not None} for d in dp_of_rank]
    mine = [None]
    dist.scatter_object_list(mine, payloads, src=0, group=service.host_group)
    samples = [dataclasses.replace(s, routed_experts=mine[0].get(i)) for i, s in enumerate(whole.samples)]
    return RolloutBatch(rank_share(samples, cfg.train.mini_batches, g.dp_size, g.dp_rank), whole.metrics)


def _rank(rank, world, tp, root, hf, data):
    import torch

    from srpo_megatron.config import load_recipe
    from srpo_megatron.data.dataset import build_datasets
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rewards import register_reward
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.collect.rollout_service import RolloutService

    ov = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={root}/run", "parallel.ep=2"]
    ov += [f"parallel.tp={tp}", "parallel.sequence_parallel=true"] if tp > 1 else []
    cfg = load_recipe(str(RECIPE), ov)
    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    groups = initialize_model_parallel(tp, 1, seed=1, ep=2)
    tokenizer = load_tokenizer(hf)
    prompts = list(build_datasets(cfg.data, tokenizer)[0])[: cfg.rollout.prompts_per_step]
    service = RolloutService(cfg, tokenizer, None, groups)  # no weight sync: the engines keep version 0
    with ReceivedBytes() as before:
        old = collect_before(service, prompts, 0)
    if service.engine is not None:
        service.engine.resume_memory()  # colocated engines release after generating; a sync resumes them
    with ReceivedBytes() as after:
        new = service.collect(prompts, 0)
    service.close()

    def key(b):
        return [
            (s.group, s.member, s.response_ids, s.reward, s.advantage, s.teacher_prompt_ids)
            for s in b.samples
        ]

    same = key(old) == key(new) and all(
        (a.routed_experts is None and b.routed_experts is None)
        or torch.equal(a.routed_experts, b.routed_experts)
        for a, b in zip(old.samples, new.samples, strict=True)
    )
    experts = sum(s.routed_experts.numel() for s in new.samples if s.routed_experts is not None)
    return {
        "before": before.total,
        "after": after.total,
        "same": same,
        "dp": groups.dp_size,
        "samples": len(new.samples),
        "expert_ids": experts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    from srpo_megatron.testing.tiny import write_tiny_run

    with tempfile.TemporaryDirectory() as root:
        _, hf, data = write_tiny_run(root, num_prompts=16, moe=True)
        out = run_distributed(_rank, args.world, args.tp, root, str(hf), str(data), timeout=900)
    dp = out[0]["dp"]
    for r, o in enumerate(out):
        print(
            f"rank {r}: before {o['before']:>9} B  after {o['after']:>9} B"
            f"  ratio {o['after'] / o['before']:.3f}"
            f"  ({o['samples']} samples, {o['expert_ids']} expert ids; same samples: {o['same']})"
        )
    others = [o["after"] / o["before"] for o in out[1:]]
    summary = {
        "bench": "batch_shipping",
        "world": args.world,
        "tp": args.tp,
        "dp": dp,
        "bytes_before": [o["before"] for o in out],
        "bytes_after": [o["after"] for o in out],
        "ratio_other_ranks_max": round(max(others), 4),
        "ratio_rank0": round(out[0]["after"] / out[0]["before"], 4),
        "inverse_dp": round(1 / dp, 4),
        "same_samples": all(o["same"] for o in out),
    }
    print(json.dumps(summary))
    if not summary["same_samples"]:
        sys.exit("the two paths gave a rank different samples")


if __name__ == "__main__":
    main()
