"""MoE routing metrics for the training log: expert load, router entropy, trainer-vs-engine top-k mismatch.

``RouterRecorder`` hooks every megatron router of a policy stage (``mlp.router``) for the forwards run
inside its ``with`` block and keeps per-layer statistics (no tensors are retained beyond one layer):

- expert load: tokens routed to each expert, summed over the layer's forwards; reported as
  ``max / mean`` (1.0 = perfectly balanced, E/k = every token on the same k experts);
- router entropy: mean over tokens of the entropy of the full softmax over experts (nats), computed from
  the router logits in their (fp32/fp64) router dtype.

``topk_mismatch_share`` compares the trainer's top-k expert sets with those an engine reported (the rollout
routing replay check). Counts are summed over the group passed in (the ranks that see different tokens:
the data-parallel group; with TP under sequence parallelism also TP), so every rank logs the same figure.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def expert_load_imbalance(tokens_per_expert: torch.Tensor) -> float:
    """``max / mean`` of a ``[E]`` count vector (1.0 when balanced; 0 tokens -> 1.0)."""
    mean = tokens_per_expert.double().mean()
    return 1.0 if mean == 0 else float(tokens_per_expert.double().max() / mean)


def router_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (nats) of ``softmax(logits)``. logits ``[T, E]`` -> ``[T]``."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def topk_mismatch_share(trainer_topk: torch.Tensor, engine_topk: torch.Tensor) -> float:
    """Share of tokens whose SET of top-k experts differs. Both ``[T, k]`` int (order within k ignored)."""
    if trainer_topk.shape != engine_topk.shape:
        raise ValueError(
            f"top-k shapes differ: trainer {tuple(trainer_topk.shape)}, engine {tuple(engine_topk.shape)}"
        )
    if trainer_topk.numel() == 0:
        return 0.0
    same = (trainer_topk.sort(-1).values == engine_topk.sort(-1).values).all(-1)
    return float(1.0 - same.double().mean())


class RouterRecorder(contextlib.AbstractContextManager):
    """Accumulate expert load and router entropy of every router in ``model`` while the block runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.router")]
        self.tokens: dict[str, torch.Tensor] = {}  # router name -> [E] tokens routed (float64)
        self.entropy_sum: dict[str, float] = {}  # router name -> summed per-token entropy
        self.token_count: dict[str, int] = {}  # router name -> tokens seen

    def __enter__(self) -> RouterRecorder:
        # megatron's TopKRouter.forward is ``logits = self.gating(x)`` then ``self.routing(logits, ...)``:
        # an instance-level wrapper of ``routing`` sees logits and routing map without touching the maths.
        for name, router in self._routers:
            router.routing = self._wrap(name, router.routing)
        return self

    def __exit__(self, *exc) -> None:
        for _, router in self._routers:
            router.__dict__.pop("routing", None)

    def _wrap(self, name: str, routing):
        def recorded(logits, *args, **kwargs):
            probs, routing_map = routing(logits, *args, **kwargs)
            with torch.no_grad():
                counts = routing_map.reshape(-1, routing_map.shape[-1]).sum(0).double()
                self.tokens[name] = self.tokens.get(name, 0) + counts
                ent = router_entropy(logits.detach().reshape(-1, logits.shape[-1]))
                self.entropy_sum[name] = self.entropy_sum.get(name, 0.0) + float(ent.sum())
                self.token_count[name] = self.token_count.get(name, 0) + ent.numel()
            return probs, routing_map

        return recorded

    def summary(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """``moe/expert_load_max_over_mean`` (worst layer) and ``moe/router_entropy`` (token mean), summed
        over ``group`` first (collective over it when given)."""
        if not self.tokens:
            return {}
        names = sorted(self.tokens)
        loads = torch.stack([self.tokens[n] for n in names])  # [layers, E]
        ent = torch.tensor([[self.entropy_sum[n], self.token_count[n]] for n in names], dtype=torch.float64)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)
            dist.all_reduce(ent, group=group)
        return {
            "moe/expert_load_max_over_mean": max(expert_load_imbalance(row) for row in loads),
            "moe/router_entropy": float(ent[:, 0].sum() / ent[:, 1].sum().clamp_min(1)),
        }
