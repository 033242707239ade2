"""MoE routing metrics for the training log: expert load, router entropy, trainer-vs-engine top-k mismatch.

``RouterRecorder`` hooks every megatron router of a policy stage (``mlp.router``) for the forwards run
inside its ``with`` block and accumulates, per global layer, on the model's device (no host syncs):

- expert load: tokens routed to each expert; reported as the worst layer's ``max / mean`` (1.0 = perfectly
  balanced, E/k = every token on the same k experts);
- router entropy: entropy of the full softmax over experts (nats) per token, from the router logits in
  their (fp32/fp64) router dtype; reported as the token mean over all layers;
- top-k mismatch: on response tokens for which the engine reported its experts, the share of
  (token, layer) pairs whose SET of k experts the trainer used differs from the engine's
  (``moe/topk_mismatch_share``; 0 under rollout routing replay), and the share whose trainer-chosen
  top-k (the trainer's own router's choice, whatever replay then used: ``router_own_topk``) differs
  (``moe/router_disagreement_share``: what replay corrects).

Before each micro-batch's forward the caller states which of the router's tokens are real (not padding),
which are response tokens, and the engine's experts per token (``set_micro_batch``); the token order is
the router's own: megatron's ``[s, b]`` flattened, this rank's sequence-parallel chunk.

Reduction: every rank of a pipeline stage routes different tokens (data parallel ranks, expert parallel
ranks, which are data-parallel ranks for attention and the router, and TP ranks under sequence
parallelism, which MoE at TP > 1 requires), and pipeline stages hold different layers (zero rows
elsewhere). ``summary`` therefore sums the per-layer counts over the DP, TP and PP groups it is given,
then forms the ratios; every rank returns the same figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

# Per-layer accumulator columns after the E expert counts.
_ENT, _TOK, _MISMATCH, _DISAGREE, _COMPARED = range(5)


def expert_load_imbalance(tokens_per_expert: torch.Tensor) -> float:
    """``max / mean`` of a ``[E]`` count vector (1.0 when balanced; 0 tokens -> 1.0)."""
    mean = tokens_per_expert.double().mean()
    return 1.0 if mean == 0 else float(tokens_per_expert.double().max() / mean)


def router_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (nats) of ``softmax(logits)``. logits ``[T, E]`` -> ``[T]``."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def topk_differs(trainer_topk: torch.Tensor, engine_topk: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: the SET of top-k experts differs. Both ``[T, k]`` int (order within k ignored)."""
    if trainer_topk.shape != engine_topk.shape:
        raise ValueError(
            f"top-k shapes differ: trainer {tuple(trainer_topk.shape)}, engine {tuple(engine_topk.shape)}"
        )
    return ~(trainer_topk.sort(-1).values == engine_topk.to(trainer_topk.dtype).sort(-1).values).all(-1)


def topk_mismatch_share(trainer_topk: torch.Tensor, engine_topk: torch.Tensor) -> float:
    """Share of tokens whose set of top-k experts differs. Both ``[T, k]`` int."""
    if trainer_topk.numel() == 0:
        return 0.0
    return float(topk_differs(trainer_topk, engine_topk).double().mean())


def routing_map_topk(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, E]`` bool routing map (k True per row) -> ``[T, k]`` expert ids, ascending."""
    return routing_map.nonzero()[:, 1].reshape(-1, k)


def router_own_topk(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``[T, k]`` experts megatron's ``router`` itself picks for its ``[T, E]`` logits, replay or not:
    the top-k of the logits for softmax routers; for the sigmoid routers (GLM-4.5, DeepSeek-V3) megatron's
    own rule, i.e. the top-k of ``sigmoid(logits) + expert_bias`` within the chosen groups."""
    cfg, k = router.config, router.topk
    if cfg.moe_router_score_function == "softmax":
        return logits.topk(k, dim=-1).indices
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    _, routing_map = topk_routing_with_score_function(
        logits,
        k,
        num_groups=cfg.moe_router_num_groups,
        group_topk=cfg.moe_router_group_topk,
        score_function=cfg.moe_router_score_function,
        expert_bias=router.expert_bias,
    )
    return routing_map_topk(routing_map, k)


class RouterRecorder(contextlib.AbstractContextManager):
    """Accumulate expert load, router entropy and top-k mismatch of every router in ``model`` (one pipeline
    stage) while the block runs; ``num_layers`` is the model's total layer count (all stages).

    A stage that holds no router (a DeepSeek-V3 / GLM-4.5 first stage of only ``first_k_dense`` layers)
    records nothing and reports nothing on its own (:meth:`summary` without groups is ``{}``), but takes
    part in the cross-stage reduction with zeros of the same shape (``num_experts``: E, read from the model
    config when not given), so every stage then reports the MoE stages' figures."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int | None = None) -> None:
        self._routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
        config = self._routers[0].config if self._routers else getattr(model, "config", None)
        experts = num_experts or getattr(config, "num_moe_experts", None)
        if not experts:
            raise ValueError(
                "RouterRecorder: the model has no MoE router (mlp.router) and no num_moe_experts in its "
                "config; pass num_experts (the MoE stages' expert count) for a stage of only dense layers"
            )
        device = self._routers[0].weight.device if self._routers else next(model.parameters()).device
        # [num_layers, E + 5] float64 on the model's device: expert counts, then the _ENT.. columns.
        self._acc = torch.zeros(num_layers, experts + 5, dtype=torch.float64, device=device)
        self._real: torch.Tensor | None = None
        self._response: torch.Tensor | None = None
        self._engine: torch.Tensor | None = None

    def set_micro_batch(
        self,
        real: torch.Tensor | None = None,
        response: torch.Tensor | None = None,
        engine_topk: torch.Tensor | None = None,
    ) -> None:
        """The next forward's router tokens (megatron order, this rank's chunk): ``real`` [T] bool (None =
        all), ``response`` [T] bool response tokens with engine data, ``engine_topk`` [T, layers, k] int."""
        self._real, self._response, self._engine = real, response, engine_topk

    def __enter__(self) -> RouterRecorder:
        # megatron's TopKRouter.forward is ``logits = self.gating(x)`` then ``self.routing(logits, ...)``:
        # an instance-level wrapper of ``routing`` sees logits and routing map without touching the maths.
        for router in self._routers:
            router.routing = self._wrap(router, router.routing)
        return self

    def __exit__(self, *exc) -> None:
        for router in self._routers:
            router.__dict__.pop("routing", None)

    def _wrap(self, router: torch.nn.Module, routing):
        def recorded(logits, *args, **kwargs):
            probs, routing_map = routing(logits, *args, **kwargs)
            with torch.no_grad():
                self._record(router, logits.detach().reshape(-1, logits.shape[-1]), routing_map)
            return probs, routing_map

        return recorded

    def _record(self, router: torch.nn.Module, logits: torch.Tensor, routing_map: torch.Tensor) -> None:
        layer, k, experts = router.layer_number - 1, router.topk, logits.shape[-1]
        row = self._acc[layer]
        real = self._real
        used = routing_map if real is None else routing_map[real]
        row[:experts] += used.sum(0).double()
        ent = router_entropy(logits if real is None else logits[real])
        row[experts + _ENT] += ent.sum()
        row[experts + _TOK] += ent.numel()
        if self._engine is not None and self._response is not None:
            resp = self._response
            engine = self._engine[resp, layer]
            used_topk = routing_map_topk(routing_map[resp], k)
            own_topk = router_own_topk(router, logits[resp])
            row[experts + _MISMATCH] += topk_differs(used_topk, engine).sum()
            row[experts + _DISAGREE] += topk_differs(own_topk, engine).sum()
            row[experts + _COMPARED] += resp.sum()

    def loads(self) -> torch.Tensor:
        """``[num_layers, E]`` tokens this rank routed to each expert (zero rows: layers of other stages)."""
        return self._acc[:, : self._acc.shape[1] - 5].clone()

    def summary(self, groups: Sequence[dist.ProcessGroup | None] = ()) -> dict[str, float]:
        """The logged figures, summed over ``groups`` first (a collective over each group given; every rank
        of those groups must call it, also one whose stage recorded nothing)."""
        acc = self._acc.clone()
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(acc, group=group)
        experts = acc.shape[1] - 5
        loads, stats = acc[:, :experts], acc[:, experts:].sum(0)
        if stats[_TOK] == 0:  # no router forwarded a token here (a dense-only stage, not reduced)
            return {}
        out = {
            "moe/expert_load_max_over_mean": max(expert_load_imbalance(row) for row in loads),
            "moe/router_entropy": float(stats[_ENT] / stats[_TOK].clamp_min(1)),
        }
        if stats[_COMPARED] > 0:
            out["moe/topk_mismatch_share"] = float(stats[_MISMATCH] / stats[_COMPARED])
            out["moe/router_disagreement_share"] = float(stats[_DISAGREE] / stats[_COMPARED])
        return out
