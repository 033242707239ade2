"""Qwen3-MoE policies match the HF model (transformers' Qwen3MoeForCausalLM, fp32): logits and every gradient
at TP1, EP2, TP2xEP2, PP2xEP2 and ETP2, with the alltoall and the allgather token dispatchers.

Same harness as ``test_models_tp``: megatron's real schedules on gloo ranks, megatron DDP +
``finalize_model_grads``; gradients are gathered over TP/ETP and collected over EP into HF names through the
conversion table, so a wrong expert numbering (EP offset), a wrong ETP split or a wrong router mapping fails.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.tiny import TINY_MOE_EXPERTS, TINY_MOE_TOP_K, tiny_moe_model
from tests.helpers.megatron import hf_reference
from tests.helpers.moe import (
    VOCAB,
    batches_for,
    hf_file_state,
    run_moe_layout,
)

pytestmark = pytest.mark.moe

EXPERTS = TINY_MOE_EXPERTS
TOP_K = TINY_MOE_TOP_K
# (tp, pp, ep, etp); world = tp * pp * dp must also be a multiple of etp * ep * pp.
# (2, 1, 1, 1): experts replicated over TP at EP1 (models.moe.mark_tp_replicated_experts).
LAYOUTS = [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 2, 2, 1), (2, 1, 1, 2), (2, 1, 1, 1)]


def hf_in_file_names(grads: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """HF gradients of transformers' fused in-memory experts under the per-expert FILE names."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = g[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "tp{}pp{}ep{}etp{}".format(*lay))
def test_moe_logits_and_grads_match_hf(layout):
    variants = [("alltoall", True), ("allgather", True)]
    if layout == (1, 1, 1, 1):
        variants.append(("alltoall", False))  # no renormalisation of the top-k: megatron's pre-softmax path
    cases, refs = [], []
    for i, (dispatcher, norm) in enumerate(variants):
        hf = tiny_moe_model(seed=i, norm_topk_prob=norm)
        batches = batches_for(10 + i)
        logits, grads = hf_reference(hf, batches)
        refs.append((logits, hf_in_file_names(grads, hf)))
        cases.append((hf.config.to_dict(), dispatcher, batches, hf_file_state(hf), None))
    for (dispatcher, norm), (logits, grads), (ref_logits, ref_grads) in zip(
        variants, run_moe_layout(layout, cases), refs, strict=True
    ):
        tag = f"{layout} {dispatcher} norm_topk_prob={norm}"
        for got, want in zip(logits, ref_logits, strict=True):
            diff = (got[..., :VOCAB] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
        assert sorted(grads) == sorted(ref_grads), f"{tag}: gradient names {set(grads) ^ set(ref_grads)}"
        for name, want in ref_grads.items():
            diff = (grads[name] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: grad {name} differs by {diff}"
