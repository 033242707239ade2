"""Each token's routed experts as a rollout engine reports them (rollout routing replay, "R3").

Both engines give one int array per sequence, ``[P + R - 1, layers, top_k]`` global expert ids, one row per
position the engine forwarded (the P prompt tokens and every response token but the last, which is sampled
and never fed back):

- SGLang (``--enable-return-routed-experts``, ``return_routed_experts`` per request) puts it in
  ``meta_info["routed_experts"]`` as base64 of int32: :func:`decode_sglang_routed_experts` (flat; the
  trainer reshapes with the model's layers and top-k, :func:`as_token_layer_topk`).
- The transformers engine (``rollout/hf_engine.py``) records the experts its HF model's routers choose
  (the router's own choice: top-k of the logits for softmax routers; for GLM-4.5 / DeepSeek-V3 the top-k
  of the sigmoid scores plus ``e_score_correction_bias`` within the chosen groups) at every prefill and
  decode forward it runs. Layers without a router (dense first layers) report zeros, as SGLang does: its
  capture buffer is zero-filled and only MoE layers write to it.

The trainer replays these through megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``) in the
policy's scoring and training passes (``trainer/microbatches/moe_replay.py``); the EMA teacher is not replayed
(its context differs from the rollout's).
"""

from __future__ import annotations

import base64

import numpy as np
import torch


def compact_ids(ids: torch.Tensor) -> torch.Tensor:
    """Expert ids in the smallest integer dtype that holds them (uint8 below 256 experts, else int16/int32):
    they travel to the trainer ranks of their DP share with the rollout batch."""
    top = int(ids.max()) if ids.numel() else 0
    dtype = torch.uint8 if top < 256 else torch.int16 if top < 32768 else torch.int32
    return ids.to(dtype)


def decode_sglang_routed_experts(payload: str) -> torch.Tensor:
    """SGLang's base64 int32 ``routed_experts`` -> flat int32 ``[tokens * layers * top_k]``."""
    raw = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    return torch.from_numpy(raw.copy())


def as_token_layer_topk(
    ids: torch.Tensor, num_layers: int, top_k: int, tokens: int, fused_shared: int = 0
) -> torch.Tensor:
    """An engine's ids (flat or shaped) -> ``[tokens, layers, top_k]`` int64, checked against the model.

    ``fused_shared``: the model's shared experts (GLM-4.5, DeepSeek-V3). SGLang may fuse them into its
    routed-expert kernel (shared-experts fusion, on by default where supported), and then reports
    ``top_k + fused_shared`` ids per (token, layer): the routed ones first, then the shared expert's id
    (or -1). Such a report is accepted and its routed columns are kept."""
    if fused_shared and ids.numel() == tokens * num_layers * (top_k + fused_shared):
        return ids.reshape(tokens, num_layers, top_k + fused_shared)[..., :top_k].long()
    per_token = num_layers * top_k
    if ids.numel() != tokens * per_token:
        raise ValueError(
            f"the engine reported {ids.numel()} routed expert ids for a sequence of {tokens + 1} tokens; "
            f"expected (tokens - 1) * layers * top_k = {tokens} * {num_layers} * {top_k}. Check that the "
            "engine serves the same model (num_hidden_layers, num_experts_per_tok)"
        )
    return ids.reshape(tokens, num_layers, top_k).long()


def router_layers(model: torch.nn.Module) -> tuple[int, list[tuple[int, torch.nn.Module]]]:
    """(decoder layers, ``[(layer index, router)]``) of an HF MoE model: every ``model.layers.{i}.mlp.gate``
    (Qwen3-MoE, GLM-4.5, DeepSeek-V3) or ``mlp.router`` (gpt-oss). GLM-4.5 and DeepSeek-V3 have dense first
    layers (``first_k_dense_replace``), which have no router."""
    routers = []
    for name, module in model.named_modules():
        parts = name.split(".")
        is_router = parts[-1] in ("gate", "router") and len(parts) >= 4 and parts[-2] == "mlp"
        if is_router and parts[-4] == "layers" and parts[-3].isdigit():
            routers.append((int(parts[-3]), module))
    layers = int(getattr(model.config, "num_hidden_layers", 0) or (max(i for i, _ in routers) + 1))
    return layers, sorted(routers, key=lambda r: r[0])


def router_choice(output, top_k: int) -> torch.Tensor:
    """The experts an HF router chose, from its forward output ``[tokens, top_k]``: transformers >= 5
    routers return ``(logits, weights, indices)``, ``indices`` being their own choice (biased and
    group-limited for the sigmoid routers); older ones are a ``Linear`` whose logits' top-k is it."""
    return output[2] if isinstance(output, tuple) else output.topk(top_k, dim=-1).indices


@torch.no_grad()
def hf_routed_experts(model: torch.nn.Module, input_ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """Experts each token of ``input_ids`` ``[1, S]`` is routed to by an HF MoE model: ``[S, layers, top_k]``
    (ascending expert id within k, so two reports compare as sets; zeros in layers without a router)."""
    layers, routers = router_layers(model)
    seen: dict[int, torch.Tensor] = {}

    def hook(i):
        return lambda module, args, output: seen.__setitem__(i, router_choice(output, top_k))

    hooks = [router.register_forward_hook(hook(i)) for i, router in routers]
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    s = input_ids.shape[1]
    zeros = torch.zeros(s, top_k, dtype=torch.long, device=input_ids.device)
    per_layer = [seen[i].reshape(s, top_k).sort(-1).values if i in seen else zeros for i in range(layers)]
    return torch.stack(per_layer, dim=1)
