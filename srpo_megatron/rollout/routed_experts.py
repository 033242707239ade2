"""Each response token's routed experts as a rollout engine reports them (rollout routing replay, "R3").

Both engines give one int array ``[tokens, layers, top_k]`` per sequence (global expert ids):

- SGLang (``--enable-return-routed-experts``, ``return_routed_experts`` per request) puts it in
  ``meta_info["routed_experts"]`` as base64 of int32: :func:`decode_sglang_routed_experts`.
- The transformers engine has no such output; :func:`hf_routed_experts` recomputes it from the HF model's
  router logits (``output_router_logits=True``) with the model's own rule: top-k of the softmax, which
  equals the top-k of the logits.

The trainer replays these through megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``) in the
policy's scoring and training passes; the EMA teacher is not replayed (its context differs from the
rollout's). Only the engine-side pieces live here.
"""

from __future__ import annotations

import base64

import numpy as np
import torch


def decode_sglang_routed_experts(payload: str, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's base64 int32 ``routed_experts`` -> ``[tokens, layers, top_k]`` int64."""
    raw = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    per_token = num_layers * top_k
    if raw.size % per_token:
        raise ValueError(
            f"routed_experts holds {raw.size} ids, not a multiple of layers*top_k = {num_layers}*{top_k}; "
            "check that the server runs the same model (num_hidden_layers, num_experts_per_tok)"
        )
    return torch.from_numpy(raw.astype(np.int64)).reshape(-1, num_layers, top_k)


@torch.no_grad()
def hf_routed_experts(model: torch.nn.Module, input_ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """Experts each token of ``input_ids`` ``[1, S]`` is routed to by an HF MoE model: ``[S, layers, top_k]``
    (ascending expert id within k, so two reports compare as sets)."""
    out = model(input_ids, output_router_logits=True)
    per_layer = [logits.topk(top_k, dim=-1).indices.sort(-1).values for logits in out.router_logits]
    return torch.stack(per_layer, dim=1)
