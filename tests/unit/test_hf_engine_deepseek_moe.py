"""The CPU transformers engine serves GLM-4.5 and DeepSeek-V3 (transformers 5 fuses their experts in memory):

- ``update_weights`` takes the hub FILE names (per-expert ``gate_proj``/``up_proj``/``down_proj``, the
  routers' ``e_score_correction_bias``, shared experts, dense first layers) that the conversion table and
  weight sync produce, and afterwards the engine computes what the sender's model computes;
- its ``routed_experts`` are its routers' OWN choice (top-k of the biased sigmoid scores within the chosen
  groups, not the top-k of the logits), with zeros in the dense first layer as SGLang reports.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.hf_engine import HFEngine
from srpo_megatron.rollout.routed_experts import hf_routed_experts
from srpo_megatron.testing.tiny import TINY_GLM_TOP_K, tiny_glm_moe_model
from tests.helpers.moe import hf_file_state

pytestmark = pytest.mark.moe


def tiny_deepseek_v3(seed: int):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_engine_takes_the_file_names_and_serves_the_senders_model(family):
    make = (
        tiny_deepseek_v3 if family == "deepseek_v3" else (lambda s: tiny_glm_moe_model(seed=s, grouped=True))
    )
    served, sender = make(0), make(1)
    engine = HFEngine(served, max_batch_size=4, eos_token_ids=[299])
    state = hf_file_state(sender)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in state
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in state
    assert "model.layers.0.mlp.gate_proj.weight" in state
    engine.update_weights(state.items(), version=1)
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, sender(ids).logits)
    bias = dict(engine.model.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(
        bias, state["model.layers.1.mlp.gate.e_score_correction_bias"]
    )


def test_engine_reports_its_routers_own_choice_for_the_sigmoid_group_router():
    model = tiny_glm_moe_model(seed=3, grouped=True)
    engine = HFEngine(model, max_batch_size=4, eos_token_ids=[299])
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11, 12]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=11, return_routed_experts=True))
    differs_from_logits = 0
    for i, group in enumerate(out):
        for c in group:
            ids = prompts[i] + c.token_ids
            got = c.routed_experts.long().sort(-1).values
            assert got.shape == (len(ids) - 1, 3, TINY_GLM_TOP_K)
            want = hf_routed_experts(model, torch.tensor([ids[:-1]]), TINY_GLM_TOP_K)
            assert torch.equal(got, want), f"prompt {i}"
            assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0])), "dense layer 0 reports zeros"
            groups = got[:, 1:] // 4  # n_group=2, topk_group=1: both experts of a token in one group
            assert torch.equal(groups[..., 0], groups[..., 1])
            with torch.no_grad():
                logits = model(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
            by_logits = torch.stack([lg.topk(TINY_GLM_TOP_K).indices.sort(-1).values for lg in logits], 1)
            differs_from_logits += int((by_logits != got[:, 1:]).any(-1).sum())
    assert differs_from_logits > 0, "the bias and groups must change some choices, or this test is blind"
