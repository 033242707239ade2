"""The transformers engine serves gpt-oss: it receives the conversion table's names (each fused expert
tensor as ``x[e]`` slices, what the trainer's weight sync sends) into its fused in-memory experts, refuses
the qwen-style per-expert names, and reports each token's routed experts (``mlp.router``)."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.rollout.base import EngineError, SamplingParams
from srpo_megatron.rollout.hf_engine import HFEngine
from srpo_megatron.testing.tiny import TINY_MOE_TOP_K, tiny_gpt_oss_model

pytestmark = pytest.mark.moe


def _table_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """``model``'s tensors under the table's HF names (what ``weights.export`` streams)."""
    table = ConversionTable(Architecture.from_hf(model.config))
    state = model.state_dict()
    return [(h, table.hf_tensor(h, state.__getitem__).clone()) for h in table.hf_names()]


def test_update_installs_the_table_names_into_the_fused_experts():
    engine = HFEngine(tiny_gpt_oss_model(seed=0), eos_token_ids=[299])
    new = tiny_gpt_oss_model(seed=1)
    sent = _table_tensors(new)
    assert "model.layers.0.mlp.experts.gate_up_proj[3]" in dict(sent)
    engine.update_weights(sent, version=1)
    served = engine.model.state_dict()
    for name, want in new.state_dict().items():
        assert torch.equal(served[name], want), name
    ids = torch.tensor([[5, 17, 42, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, new(ids).logits)


def test_a_missing_expert_slice_or_qwen_names_are_refused():
    engine = HFEngine(tiny_gpt_oss_model(seed=0), eos_token_ids=[299])
    sent = [(n, t) for n, t in _table_tensors(tiny_gpt_oss_model(seed=1)) if not n.endswith("down_proj[2]")]
    with pytest.raises(EngineError, match=r"missing 2: .*down_proj\[2\]"):
        engine.update_weights(sent, version=1)
    qwen_style = [("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(48, 32))]
    with pytest.raises(EngineError, match="unexpected"):
        engine.update_weights(sent + qwen_style, version=1)
    assert engine.weight_version == 0


def test_routed_experts_are_the_routers_choices():
    from srpo_megatron.rollout.routed_experts import hf_routed_experts

    model = tiny_gpt_oss_model(seed=3)
    engine = HFEngine(model, max_batch_size=4, eos_token_ids=[299])
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11, 12]]
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=4, seed=2, return_routed_experts=True))
    for i, [c] in enumerate(out):
        ids = prompts[i] + c.token_ids
        assert c.routed_experts.shape == (len(ids) - 1, 2, TINY_MOE_TOP_K)
        want = hf_routed_experts(model, torch.tensor([ids[:-1]]), TINY_MOE_TOP_K)
        assert torch.equal(c.routed_experts.long().sort(-1).values, want), f"prompt {i}"
