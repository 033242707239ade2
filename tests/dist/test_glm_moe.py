"""GLM-4.5 policies (``glm4_moe``) match the HF model (transformers' Glm4MoeForCausalLM, fp32): logits and
every gradient at TP1, TP2, PP2, EP2, TP2xEP2 and PP2xEP2, and the group-limited variant at TP1 and EP2.

The tiny GLM switches every DeepSeek-style MoE feature on (``testing/tiny.py``): a dense first layer, a
shared expert, the sigmoid router with a nonzero ``e_score_correction_bias`` (selection only), the scaled
normalised top-k, and in the grouped variant ``n_group=2, topk_group=1``; attention has q/k/v bias,
QK-norm and partial RoPE. Same harness as ``test_moe``: megatron's real schedules on gloo ranks, megatron
DDP + ``finalize_model_grads``, gradients gathered over TP/ETP and EP into HF names through the
conversion table, so a wrong expert numbering, router mapping or layer kind (dense vs MoE) fails.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.tiny import TINY_GLM_TOP_K, tiny_glm_moe_model
from tests.helpers.megatron import hf_reference
from tests.helpers.moe import VOCAB, batches_for, hf_file_state, hf_grads_in_file_names, run_moe_layout

pytestmark = pytest.mark.moe

# (tp, pp, ep, etp)
# "TP2" is TP2 x ETP2 (megatron's default ETP = TP) and TP2 x ETP1 x EP1 (experts replicated over TP, whose
# gradients megatron alone leaves partial: models.moe.mark_tp_replicated_experts).
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 2), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (1, 2, 2, 1)]
GROUPED_AT = {(1, 1, 1, 1), (1, 1, 2, 1)}


def hf_choices(model, ids: torch.Tensor, *, use_bias: bool) -> list[torch.Tensor]:
    """Per MoE layer, the experts HF's router picks for ``ids`` (sorted), with or without the bias."""
    out = []
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    saved = [g.e_score_correction_bias.clone() for g in gates]
    try:
        if not use_bias:
            for g in gates:
                g.e_score_correction_bias.zero_()
        hooks = [g.register_forward_hook(lambda m, a, o: out.append(o[2].sort(-1).values)) for g in gates]
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
    finally:
        for g, b in zip(gates, saved, strict=True):
            g.e_score_correction_bias.copy_(b)
    return out


def test_tiny_glm_bias_changes_the_choice():
    """The parity tests can only catch a bias ignored in the selection if the bias changes it."""
    hf = tiny_glm_moe_model(seed=0)
    ids = torch.cat(batches_for(10))
    with_bias, without = hf_choices(hf, ids, use_bias=True), hf_choices(hf, ids, use_bias=False)
    changed = sum(int((a != b).any(-1).sum()) for a, b in zip(with_bias, without, strict=True))
    assert changed > 0, "the tiny GLM's e_score_correction_bias never changes the top-k"
    assert with_bias[0].shape[-1] == TINY_GLM_TOP_K


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "tp{}pp{}ep{}etp{}".format(*lay))
def test_glm_moe_logits_and_grads_match_hf(layout):
    variants = [False, True] if layout in GROUPED_AT else [False]
    cases, refs = [], []
    for i, grouped in enumerate(variants):
        hf = tiny_glm_moe_model(seed=i, grouped=grouped)
        batches = batches_for(20 + i)
        logits, grads = hf_reference(hf, batches)
        refs.append((logits, hf_grads_in_file_names(grads)))
        cases.append((hf.config.to_dict(), "alltoall", batches, hf_file_state(hf), None))
    for grouped, (logits, grads), (ref_logits, ref_grads) in zip(
        variants, run_moe_layout(layout, cases), refs, strict=True
    ):
        tag = f"{layout} grouped={grouped}"
        for got, want in zip(logits, ref_logits, strict=True):
            diff = (got[..., :VOCAB] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
        assert sorted(grads) == sorted(ref_grads), f"{tag}: gradient names {set(grads) ^ set(ref_grads)}"
        for name, want in ref_grads.items():
            diff = (grads[name] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: grad {name} differs by {diff}"


def test_moe_layout_refusal_at_ep1_with_etp_above_tp():
    """At EP1 megatron-core reduces expert gradients like dense ones (over DP only); ETP < TP is mended
    (the layouts above), ETP > TP is not verified and is refused by name."""
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import transformer_config_from_hf

    arch = Architecture.from_hf(tiny_glm_moe_model(seed=0).config.to_dict())
    with pytest.raises(ValueError, match="parallel.etp to at most parallel.tp"):
        transformer_config_from_hf(arch, tp=1, ep=1, etp=2)
    transformer_config_from_hf(arch, tp=2, ep=1, etp=2)
    transformer_config_from_hf(arch, tp=2, ep=1, etp=1)
