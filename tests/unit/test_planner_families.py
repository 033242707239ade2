"""The planner on DeepSeek-V3, Kimi-K2, GLM-4.5(-Air) and gpt-oss: exact parameter counts of the packaged
hub configs against HF's own model built on the meta device, per-rank shards by hand, and the rollout KV
cache by SGLang's pools (MLA's one latent per token and layer; gpt-oss's hybrid sliding-window pool).

Like with like: transformers builds ``num_hidden_layers`` decoder layers and no MTP layer (its DeepSeek-V3
and GLM-4.5 classes drop ``model.layers.{L}.*`` on load), and the planner leaves the MTP layers out of the
policy too; ``from_config`` does not quantize, so the hub's fp8 / MXFP4 ``quantization_config`` changes no
shape (and the planner plans bf16). The expert-bias buffers are compared with HF's ``model.buffers()``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from srpo_megatron.planner.command import HF_CONFIG_DIR
from srpo_megatron.planner.memory import (
    GiB,
    PlanSettings,
    engine_weight_bytes,
    kv_bytes_per_token,
    plan_layout,
)
from srpo_megatron.planner.model import (
    Layout,
    ModelShape,
    PlanError,
    active_params,
    attention_numels,
    mlp_numels,
    param_tensors,
    router_buffer_elements,
    shared_expert_numels,
    stage_param_counts,
    total_params,
)

FAMILIES = ["DeepSeek-V3", "GLM-4.5", "GLM-4.5-Air", "gpt-oss-120b", "gpt-oss-20b", "Kimi-K2-Instruct"]
# Published sizes (model cards; without MTP) and active counts with the convention each card uses:
# (total, active, count the input embedding, count the output layer).
PUBLISHED = {
    "DeepSeek-V3": (671e9, 37e9, True, True),
    "GLM-4.5": (355e9, 32e9, False, False),
    "GLM-4.5-Air": (106e9, 12e9, False, False),
    "gpt-oss-120b": (116.8e9, 5.1e9, False, True),
    "gpt-oss-20b": (20.9e9, 3.6e9, False, True),
    "Kimi-K2-Instruct": (1.0e12, 32e9, True, True),  # the card rounds: 1.03T total, 32.9B active
}
# How far the card's rounding may be from the exact count (default 1% total, 2% active).
PUBLISHED_TOLERANCE = {"Kimi-K2-Instruct": (0.03, 0.03)}
# Hub model types transformers knows under another name (Kimi-K2's remote code is DeepSeek-V3's).
HF_MODEL_TYPE = {"kimi_k2": "deepseek_v3"}


def hf(name: str) -> dict:
    return json.loads((HF_CONFIG_DIR / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def hf_models():
    """name -> transformers' CausalLM of the packaged config, on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for name in FAMILIES:
        cfg = hf(name)
        cfg.pop("auto_map", None)  # the hub's remote-code pointers; transformers has the classes
        model_type = cfg.pop("model_type")
        config = AutoConfig.for_model(HF_MODEL_TYPE.get(model_type, model_type), **cfg)
        with torch.device("meta"):
            out[name] = AutoModelForCausalLM.from_config(config)
    return out


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", FAMILIES)
def test_parameter_counts_equal_the_hf_model_on_meta(name, hf_models):
    model, shape = hf_models[name], ModelShape.from_hf(hf(name))
    assert len(model.model.layers) == shape.num_layers == hf(name)["num_hidden_layers"]  # no MTP layer
    assert total_params(shape) == _numel(model)
    s = PlanSettings(layout=Layout(), gpu_bytes=int(80 * GiB), engine="none")
    assert plan_layout(shape, s).policy_params == _numel(model)  # what `srpo plan` prints
    # Layer by layer (a wrong count names its part): attention + input norm, MLP + its norm.
    for i in sorted({0, shape.num_layers - 1}):
        layer = model.model.layers[i]
        assert sum(attention_numels(shape, 1)) == _numel(layer.self_attn) + _numel(layer.input_layernorm)
        dense, expert = mlp_numels(shape, Layout(), shape.is_moe_layer(i))
        mine = sum(dense) + (shape.num_experts * sum(expert) + sum(shared_expert_numels(shape, 1)))
        mine = mine if shape.is_moe_layer(i) else sum(dense)
        assert mine == _numel(layer.mlp) + _numel(layer.post_attention_layernorm), (name, i)
    hf_bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert router_buffer_elements(shape) == hf_bias  # buffers, in neither count of parameters
    # Active: HF's experts modules hold all E experts of a layer; a token uses k of them.
    idle = sum(
        _numel(layer.mlp.experts) * (shape.num_experts - shape.moe_topk) // shape.num_experts
        for layer in model.model.layers
        if hasattr(layer.mlp, "experts")
    )
    assert active_params(shape) == _numel(model) - idle
    total, active, emb_in, emb_out = PUBLISHED[name]
    tol_total, tol_active = PUBLISHED_TOLERANCE.get(name, (0.01, 0.02))
    assert abs(total_params(shape) / total - 1) < tol_total
    assert abs(active_params(shape, emb_in, emb_out) / active - 1) < tol_active


def test_mla_shards_by_hand():
    """DeepSeek-V3 at TP8: the down projections and the latent norms are whole on every rank; the up
    projections and the output projection are split by heads (128 / 8 = 16 heads per rank)."""
    shape = ModelShape.from_hf(hf("DeepSeek-V3"))
    assert attention_numels(shape, 8) == [
        7168,  # input norm
        7168 * 16 * 128,  # linear_proj [H, 16 heads * v 128]
        1536 * 7168,  # linear_q_down_proj, replicated
        1536,  # q_layernorm, replicated
        16 * 192 * 1536,  # linear_q_up_proj [16 heads * (128 + 64), r_q]
        576 * 7168,  # linear_kv_down_proj [r_kv 512 + rope 64, H], replicated
        512,  # kv_layernorm, replicated
        16 * 256 * 512,  # linear_kv_up_proj [16 heads * (k_nope 128 + v 128), r_kv]
    ]
    replicated = 1536 * 7168 + 1536 + 576 * 7168 + 512 + 7168
    assert 8 * sum(attention_numels(shape, 8)) - 7 * replicated == sum(attention_numels(shape, 1))
    # MoE layer at TP8 / EP64: 4 local experts; the shared expert split by TP, the router whole.
    dense, expert = mlp_numels(shape, Layout(tp=8, dp=64, ep=64), True)
    assert dense == [7168, 256 * 7168] and expert == [2 * 2048 * 7168, 7168 * 2048]
    assert shared_expert_numels(shape, 8) == [2 * 256 * 7168, 7168 * 256]
    lay = Layout(tp=8, pp=1, dp=64, ep=64)
    d, e = stage_param_counts(shape, lay, 0)
    assert e == 58 * 4 * 3 * 7168 * 2048
    tensors = param_tensors(shape, lay, 0)
    assert sum(t.numel for t in tensors if not t.expert) == d
    assert sum(t.numel for t in tensors if t.expert) == e


@pytest.mark.parametrize("stage", [0, 15])
def test_deepseek_v3_tensors_equal_the_policy_on_meta(stage):
    """The project's DeepSeek-V3 policy built by megatron on the meta device (CPU local spec) at TP4 PP16
    EP16: stage 0 (embedding, 2 of the 3 dense layers), stage 15 (3 MoE layers, final norm, output), same
    tensors in the same order, same expert flags. The CPU spec splits the MLA down projections by TP, which
    Transformer Engine keeps whole: ``local_spec=True`` compares like with like."""
    from tests.helpers.planner_meta import meta_stage_params

    layout = Layout(tp=4, pp=16, dp=4, ep=16)
    ref = [(t.numel, t.expert, t.shared) for _, t in meta_stage_params(hf("DeepSeek-V3"), layout, stage)]
    mine = param_tensors(ModelShape.from_hf(hf("DeepSeek-V3")), layout, stage, local_spec=True)
    assert [(t.numel, t.expert, t.shared) for t in mine] == ref


def test_gpt_oss_and_glm_shards_by_hand():
    oss = ModelShape.from_hf(hf("gpt-oss-120b"))
    # input norm, sinks [64/4], o_proj [2880, 4096/4] + bias, fused QKV [(4096 + 2*512)/4, 2880] + bias
    assert attention_numels(oss, 4) == [2880, 16, 2880 * 1024, 2880, 1280 * 2880, 1280]
    dense, expert = mlp_numels(oss, Layout(tp=4, dp=8, ep=8), True)
    assert dense == [2880, 128 * 2880, 128]  # norm, router weight + bias
    assert expert == [2 * 2880 * 2880, 2 * 2880, 2880 * 2880, 2880]  # fc1 + bias, fc2 + bias
    with pytest.raises(PlanError, match="megatron-core supports biases in MoE experts only at expert tensor"):
        Layout(tp=4, dp=8, ep=8, etp=2).check(oss)  # megatron: "Bias in Moe is only supported when ETP==1"
    glm = ModelShape.from_hf(hf("GLM-4.5"))
    # no output bias; q/k/v bias; QK-norm [128] x 2
    assert attention_numels(glm, 8) == [5120, 5120 * 1536, 1792 * 5120, 1792, 128, 128]
    assert [glm.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    assert mlp_numels(glm, Layout(tp=8), False)[0] == [5120, 2 * 1536 * 5120, 5120 * 1536]  # F = 12288
    odd = dataclasses.replace(glm, shared_ffn_hidden_size=1537)
    with pytest.raises(PlanError, match="shared experts' width 1537"):
        Layout(tp=2, dp=4, ep=8).check(odd)


def test_rollout_kv_cache_by_sglangs_pools():
    ds = ModelShape.from_hf(hf("DeepSeek-V3"))
    # MLATokenToKVPool: one (512 + 64)-value bf16 latent per token and layer, whole on every TP rank.
    assert kv_bytes_per_token(ds, 1) == kv_bytes_per_token(ds, 8) == 61 * 576 * 2 == 70_272
    glm = ModelShape.from_hf(hf("GLM-4.5"))
    assert kv_bytes_per_token(glm, 8) == 92 * 2 * 1 * 128 * 2  # MHA pool: K and V of one KV head per GPU
    oss = ModelShape.from_hf(hf("gpt-oss-20b"))
    # 12 full + 12 sliding layers, 8 KV heads of 64: 2048 bytes per layer at TP1; the SWA pool holds 0.8 of
    # the full pool's tokens (SGLang's swa_full_tokens_ratio default).
    assert kv_bytes_per_token(oss, 1, 0.8) == 12 * 2048 + int(0.8 * 12 * 2048) == 44_236
    assert kv_bytes_per_token(oss, 1, None) == 24 * 2048  # disable_hybrid_swa_memory: one pool
    # SGLang replicates MLA's latent down projections (with their norms) and the routers on every TP rank.
    replicated = 61 * ((1536 + 512 + 64) * 7168 + 1536 + 512) + 58 * 256 * 7168
    assert engine_weight_bytes(ds, 32) == 2 * ((671_026_404_352 - replicated) // 32 + replicated)
    assert engine_weight_bytes(glm, 8) == 2 * ((total_params(glm) - 89 * 160 * 5120) // 8 + 89 * 160 * 5120)
    # The plan divides the KV pool's bytes by these: a colocated DeepSeek engine keeps tokens by the latent.
    s = PlanSettings(layout=Layout(tp=8, dp=32, ep=256), gpu_bytes=int(140 * GiB), engine_tp=8)
    plan = plan_layout(ds, s, exact=False)
    assert plan.stage.kv_tokens == plan.stage.rollout["engine KV cache"] // 70_272


# ---- the recipes ---------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
# (recipe, packaged config, training nodes, routing replay)
FAMILY_RECIPES = [
    ("deepseek_v3_srpo.yaml", "DeepSeek-V3", 32, True),
    ("glm45_air_srpo.yaml", "GLM-4.5-Air", 8, True),
    ("gpt_oss_20b_srpo.yaml", "gpt-oss-20b", 2, True),
    ("kimi_k2_srpo.yaml", "Kimi-K2-Instruct", 48, True),
]


@pytest.fixture
def stdin_devnull(monkeypatch):
    # nemo-run's `invoke` steps mirror stdin, which pytest's capture refuses (as in test_launch.py).
    with open(os.devnull) as f:
        monkeypatch.setattr(sys, "stdin", f)
        yield


@pytest.mark.parametrize(("recipe", "name", "nodes", "replay"), FAMILY_RECIPES, ids=lambda v: str(v))
def test_family_recipes_plan_exactly_and_dryrun(recipe, name, nodes, replay, hf_models, tmp_path, capsys):
    from srpo_megatron.cli import main
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.trainer.run.preflight import check_replay_config

    path = REPO / "examples" / recipe
    cfg = load_config(TrainConfig, path)
    dense = load_config(TrainConfig, REPO / "examples" / "qwen3_8b_srpo.yaml")  # the paper's SRPO settings
    assert (cfg.loss, cfg.optim, cfg.teacher, cfg.train) == (
        dense.loss,
        dense.optim,
        dense.teacher,
        dense.train,
    )
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (32, 8)
    assert cfg.rollout.routing_replay is replay
    check_replay_config(cfg, Architecture.from_hf(hf(name)))  # the trainer's refusals (replay vs recompute)
    rc = main(["plan", str(path), "--cluster", "h100", "--nodes", str(nodes), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"], out["problems"]
    assert f"packaged {name} config" in out["config_source"]
    assert out["policy_params"] == _numel(hf_models[name])  # `srpo plan` counts exactly HF's parameters
    shape = ModelShape.from_hf(hf(name))
    assert out["active_params"] == active_params(shape)
    no_mtp = ("gpt-oss-20b", "Kimi-K2-Instruct")
    assert (out["mtp_params_excluded"] > 0) == (name not in no_mtp)  # DeepSeek and GLM ship MTP layers
    assert out["router_buffer_elements"] == router_buffer_elements(shape)
    ids = out["replay_expert_ids"]  # routing replay's int64 expert ids, counted in the train phase
    assert (ids is not None) is replay
    if replay:
        terms = ids["router_tokens"] * ids["moe_layers"] * ids["top_k"] * ids["id_bytes"] * ids["in_flight"]
        assert ids["bytes"] == terms == out["components"]["train"]["replay expert ids"]
        assert ids["top_k"] == shape.moe_topk and ids["id_bytes"] == 8
    text = " ".join(line.lstrip("# ") for line in path.read_text().splitlines())
    stated = re.search(rf"--nodes {nodes}\): peak ([\d.]+) GiB per GPU", text)
    assert stated and abs(out["peak_bytes"] / GiB - float(stated.group(1))) < 0.005, "update the comment"


def test_deepseek_v3_engine_spans_four_nodes(tmp_path, capsys, stdin_devnull):
    """1.34 TB of bf16 weights do not fit one 8 x 80 GB node: the planner sizes the 4-node engine (TP32), and
    `srpo launch` starts it over its 4 engine nodes (tests/unit/test_launch_multinode_engines.py)."""
    from srpo_megatron.launch import commands

    base = ["launch", "examples/deepseek_v3_srpo.yaml", "--cluster", "h100", "--nodes", "32", "--dryrun"]
    assert commands.main([*base, "--home", str(tmp_path)]) == 0
    assert "# rollout: 1 engines of TP32 (32 GPUs each) on 4 engine node(s)" in capsys.readouterr().out
    # Routing replay's expert ids on the worst stage (1 of PP4: 16 MoE layers), 10240-token micro-batches
    # ÷ TP8 under sequence parallelism, 3 micro-batches in flight (PP4 - stage 1), int64: 3.75 MiB per GPU.
    from srpo_megatron.cli import main

    assert main(["plan", "examples/deepseek_v3_srpo.yaml", "--cluster", "h100", "--nodes", "32"]) == 0
    want = (
        "routing replay: 3.75 MiB of expert ids per GPU = 1280 router tokens x 16 MoE layers x top-8 x 8 B "
        "(int64) x 3 micro-batches in flight"
    )
    assert want in capsys.readouterr().out
    # On one node (tp_size 8) the planner refuses the engine, naming its weights per GPU.
    from srpo_megatron.planner.command import plan_recipe

    plan, _, _ = plan_recipe(
        REPO / "examples/deepseek_v3_srpo.yaml",
        ["rollout.sglang.engine_kwargs={tp_size: 8, ep_size: 8, mem_fraction_static: 0.88}"],
        256,
        8,
        int(79.6 * GiB),
    )
    assert not plan.fits and "holds 157.9 GiB of bf16 weights per GPU" in " ".join(plan.problems)
