"""`srpo plan`: parameter/optimizer bytes against megatron models, activations against autograd, anchors.

References are independent of the planner's arithmetic: megatron-core builds each layout's pipeline
stages on the ``meta`` device (its own shapes, expert flags and tied-embedding flags), and autograd's
saved-tensor hooks report what a real forward keeps for backward.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from srpo_megatron.cli import main
from srpo_megatron.config import ConfigError
from srpo_megatron.config.loading import merge
from srpo_megatron.planner.command import HF_CONFIG_DIR, plan_recipe
from srpo_megatron.planner.memory import GiB, PlanSettings, activation_bytes, plan_layout
from srpo_megatron.planner.model import (
    Layout,
    ModelShape,
    PlanError,
    buffer_numel,
    optimizer_shard_numel,
    param_tensors,
    stage_layers,
)
from tests.helpers.planner_meta import meta_stage_params

REPO = Path(__file__).resolve().parents[2]
H100 = int(79.6 * GiB)


def hf(name: str) -> dict:
    return json.loads((HF_CONFIG_DIR / f"{name}.json").read_text())


# ---- exact parameter and optimizer bytes ----------------------------------------------------------------

LAYOUTS = [
    ("Qwen3-8B", Layout(tp=1, pp=1, dp=8)),
    ("Qwen3-8B", Layout(tp=4, pp=3, dp=2)),
    ("Qwen3-14B", Layout(tp=8, pp=5, cp=2, dp=1)),
    ("Qwen3-32B", Layout(tp=8, pp=4, dp=2)),
    ("Qwen3-32B", Layout(tp=2, pp=3, dp=4)),  # uneven: 21 / 22 / 21 layers
    ("Qwen3-30B-A3B", Layout(tp=4, pp=1, dp=2, ep=8)),
    ("Qwen3-30B-A3B", Layout(tp=2, pp=4, dp=4, ep=4, etp=2)),
    ("Qwen3-235B-A22B", Layout(tp=2, pp=8, cp=2, dp=4, ep=16)),  # uneven: 11 / 12 x 6 / 11 layers
    # dense first layers, shared experts, q/k/v bias (+ QK-norm on GLM-4.5), the expert-bias buffer
    ("GLM-4.5-Air", Layout(tp=4, pp=2, dp=2, ep=8)),
    ("GLM-4.5-Air", Layout(tp=2, pp=1, dp=4, ep=4, etp=2)),
    ("GLM-4.5", Layout(tp=8, pp=4, dp=2, ep=16)),
    # attention sinks, biases on q/k/v/o, the router and the experts
    ("gpt-oss-20b", Layout(tp=4, pp=2, dp=2, ep=8)),
    ("gpt-oss-120b", Layout(tp=8, pp=3, dp=2, ep=16)),
]  # DeepSeek-V3 (MLA's CPU spec differs from the GPU plan): test_planner_families.py


@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=[f"{n}-{lay.label()}" for n, lay in LAYOUTS])
def test_param_and_optimizer_bytes_equal_megatron_meta_model(name, layout):
    shape = ModelShape.from_hf(hf(name))
    layout.check(shape)
    settings = PlanSettings(layout=layout, gpu_bytes=H100, params_bytes=2, distributed_optimizer=True)
    plan_stages = {m.stage: m for m in [_stage(shape, settings, s) for s in range(layout.pp)]}
    for stage in sorted({0, layout.pp // 2, layout.pp - 1}):
        ref = [p for _, p in meta_stage_params(hf(name), layout, stage)]
        mine = param_tensors(shape, layout, stage)
        # Same tensors in megatron's order (which decides DDP buckets), same expert and tied flags.
        assert [(t.numel, t.expert, t.shared) for t in mine] == [(t.numel, t.expert, t.shared) for t in ref]
        # Bytes from megatron's tensors through megatron's buffer rule vs the planner's components.
        dense = [t for t in ref if not t.expert]
        expert = [t for t in ref if t.expert]
        buf = buffer_numel(dense, layout.dp * layout.cp, True)
        ebuf = buffer_numel(expert, layout.expert_dp, True) if expert else 0
        opt = optimizer_shard_numel(dense, layout.dp * layout.cp, True)
        opt = 12 * (opt + (optimizer_shard_numel(expert, layout.expert_dp, True) if expert else 0))
        train = plan_stages[stage].train
        assert train["policy params"] == 2 * (buf + ebuf)
        assert train["gradient buffers"] == 4 * (buf + ebuf)
        assert train["optimizer (fp32 main + Adam)"] == opt
        assert train["teacher fp32 copy"] == 4 * (buf + ebuf)


def _stage(shape, settings, stage):
    from srpo_megatron.planner.memory import _stage_memory

    return _stage_memory(shape, settings, stage, tokens=1024, micro_batches=1)


def test_policy_params_are_the_published_sizes():
    published = {  # unsharded HF parameter counts (embeddings untied except 4B)
        "Qwen3-4B": 4_022_468_096,
        "Qwen3-8B": 8_190_735_360,
        "Qwen3-14B": 14_768_307_200,
        "Qwen3-32B": 32_762_123_264,
        "Qwen3-30B-A3B": 30_532_122_624,
        "Qwen3-235B-A22B": 235_093_634_560,
    }
    for name, count in published.items():
        s = PlanSettings(layout=Layout(), gpu_bytes=H100)
        assert plan_layout(ModelShape.from_hf(hf(name)), s).policy_params == count, name


@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=[f"{n}-{lay.label()}" for n, lay in LAYOUTS])
def test_fast_stage_counts_equal_the_tensor_lists(name, layout):
    from srpo_megatron.planner.model import stage_param_counts

    shape = ModelShape.from_hf(hf(name))
    for stage in range(layout.pp):
        tensors = param_tensors(shape, layout, stage)
        dense = sum(t.numel for t in tensors if not t.expert)
        assert stage_param_counts(shape, layout, stage) == (dense, sum(t.numel for t in tensors) - dense)


def test_stage_split_and_bad_layouts():
    assert stage_layers(94, 8) == [11, 12, 12, 12, 12, 12, 12, 11]
    assert stage_layers(36, 4) == [9] * 4
    assert sum(stage_layers(64, 3)) == 64
    with pytest.raises(PlanError, match="num_key_value_heads=8"):
        Layout(tp=16).check(ModelShape.from_hf(hf("Qwen3-8B")))
    with pytest.raises(PlanError, match="num_experts=128"):
        Layout(tp=1, dp=3, ep=3).check(ModelShape.from_hf(hf("Qwen3-30B-A3B")))


def test_buffer_padding_rule():
    from srpo_megatron.planner.model import ParamTensor

    ts = [ParamTensor(100), ParamTensor(30)]
    assert buffer_numel(ts, 4, False) == 130
    assert buffer_numel(ts, 4, True) == 256  # 30 -> 64, then 164 -> lcm(4, 128) multiple
    assert buffer_numel(ts, 3, True) == 384  # lcm(3, 128) = 384
    # Two buckets when the first (reverse order) reaches bucket_size: 64 | 100 -> 128 + 128.
    assert buffer_numel(ts, 4, True, bucket_size=30) == 256
    assert buffer_numel([*ts, ParamTensor(10, shared=True)], 4, True) == 128 + 256


# ---- activations against autograd's saved tensors -------------------------------------------------------

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
TINY_MOE = dict(TINY, model_type="qwen3_moe", moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
# GLM-4.5's MoE: a dense first layer, shared experts beside the routed ones, q/k/v bias, QK-norm.
TINY_GLM = dict(
    TINY,
    model_type="glm4_moe",
    moe_intermediate_size=48,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=4,  # wide enough that leaving its activations out is seen
    first_k_dense_replace=1,
    attention_bias=True,
    use_qk_norm=True,
)
# DeepSeek-V3's MLA (q and kv latents, RoPE on part of each head, v heads narrower than q/k) and its MoE.
TINY_DS = dict(
    TINY,
    model_type="deepseek_v3",
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=48,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
)


def _saved_bytes(cfg: dict, recompute: str, b: int, s: int) -> int:
    """Bytes of the distinct storages autograd saves in one forward of the megatron policy (not params)."""
    from megatron.core.models.gpt import GPTModel

    from srpo_megatron.config import MoEConfig
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import decoder_spec, transformer_config_from_hf
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1)
    arch = Architecture.from_hf(cfg)
    extra = {}
    if recompute == "full":
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = transformer_config_from_hf(
        arch, moe=MoEConfig(dispatcher="allgather", grouped_gemm=False), **extra
    )
    spec = decoder_spec(arch, config, use_te=False)  # the trainer's local spec: SDPA core attention
    torch.manual_seed(0)
    model = GPTModel(config, spec, vocab_size=512, max_sequence_length=1024, position_embedding_type="rope")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(s).unsqueeze(0), None)
    return sum(seen.values())


@pytest.fixture
def moe_router_on_cpu(monkeypatch):
    # megatron-core 0.16.1's moe_utils leaves ``te_general_gemm`` undefined when Transformer Engine does not
    # import; None is the value megatron itself uses for "no TE", so the router's torch path runs.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize(
    "cfg",
    [dict(TINY, model_type="qwen3"), TINY_MOE, TINY_GLM, TINY_DS],
    ids=["dense", "moe", "glm-moe", "deepseek-mla"],
)
def test_activation_estimate_within_15_percent_of_autograd(cfg, recompute, moe_router_on_cpu):
    b, s = 2, 128
    measured = _saved_bytes(cfg, recompute, b, s)
    shape = ModelShape.from_hf(cfg)
    settings = PlanSettings(layout=Layout(), gpu_bytes=H100, params_bytes=4, recompute=recompute)
    estimate = activation_bytes(shape, Layout(), 0, b * s, settings, 1, backward_working_set=False)
    assert abs(estimate / measured - 1) < 0.15, (estimate, measured)


def test_activation_scaling_with_parallelism():
    shape = ModelShape.from_hf(hf("Qwen3-8B"))
    s = PlanSettings(layout=Layout(), gpu_bytes=H100)
    one = activation_bytes(shape, Layout(tp=1), 0, 4096, s, 1)
    tp4 = activation_bytes(shape, Layout(tp=4), 0, 4096, s, 1)
    tp4_sp = activation_bytes(shape, Layout(tp=4), 0, 4096, dataclasses.replace(s, sequence_parallel=True), 1)
    assert one > tp4 > tp4_sp > one / 4 * 0.99
    full = activation_bytes(shape, Layout(tp=4), 0, 4096, dataclasses.replace(s, recompute="full"), 1)
    assert full < tp4 / 5


# ---- anchors -----------------------------------------------------------------------------------------------


def _recipe(tmp_path: Path, model: str, **sections) -> Path:
    base = yaml.safe_load((REPO / "examples" / "qwen3_8b_srpo.yaml").read_text())
    base["model"]["hf_dir"] = f"/cluster/models/{model}"
    base = merge(base, sections)  # nested sections merge key by key, as base: does
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def test_anchor_qwen3_235b_tp2_pp8_cp2_ep16_on_16_nodes_fits(tmp_path):
    # slime's published Qwen3-235B-A22B layout: full recompute, SP, trainer state off the GPU during rollouts,
    # engines of 16 GPUs at mem_fraction_static 0.7.
    recipe = _recipe(
        tmp_path,
        "Qwen3-235B-A22B",
        parallel=dict(tp=2, pp=8, cp=2, ep=16, offload_during_rollout=True),
        performance=dict(recompute="full"),
        train=dict(max_tokens_per_micro_batch=4096),  # the trainer needs packing for CP (not planned)
        rollout=dict(sglang=dict(engine_kwargs=dict(tp_size=16, mem_fraction_static=0.7))),
    )
    plan, _, source = plan_recipe(recipe, [], 128, 8, H100)
    assert "packaged Qwen3-235B-A22B" in source
    assert plan.layout == Layout(tp=2, pp=8, cp=2, dp=4, ep=16)
    assert plan.fits, plan.problems
    assert plan.stage.kv_tokens >= 10240
    # Without offloading during rollouts the KV cache is squeezed out: refused, naming why.
    plan, _, _ = plan_recipe(recipe, ["parallel.offload_during_rollout=false"], 128, 8, H100)
    assert not plan.fits and "KV cache" in " ".join(plan.problems)


def test_planner_refuses_what_the_trainer_refuses(tmp_path, capsys):
    """The planner once modelled parallel.optimizer_offload (and teacher_fp32: none), which `srpo train`
    refuses: it loads the recipe as the trainer does, so such a recipe is refused, not planned."""
    recipe = _recipe(tmp_path, "Qwen3-30B-A3B", parallel=dict(tp=4, ep=8, optimizer_offload=True))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['optimizer_offload'\]"):
        plan_recipe(recipe, [], 8, 8, H100)
    recipe = _recipe(tmp_path, "Qwen3-30B-A3B", parallel=dict(tp=4, ep=8, teacher_fp32="none"))
    with pytest.raises(ConfigError, match=r"parallel.teacher_fp32: 'none' is not valid"):
        plan_recipe(recipe, [], 8, 8, H100)


def test_anchor_qwen3_8b_tp1_without_distributed_optimizer_is_refused(tmp_path, capsys):
    recipe = _recipe(
        tmp_path,
        "Qwen3-8B",
        parallel=dict(tp=1, distributed_optimizer=False, sequence_parallel=None),
        rollout=dict(prompts_per_step=1),
    )
    recipe_text = yaml.safe_load(recipe.read_text())
    recipe_text["rollout"]["sglang"]["engine_kwargs"]["tp_size"] = 1
    recipe.write_text(yaml.safe_dump(recipe_text))
    plan, ranked, _ = plan_recipe(recipe, [], 1, 1, H100)
    assert not plan.fits
    assert plan.overflow == "optimizer (fp32 main + Adam)"
    assert ranked == []  # no layout of one GPU holds an 8B SRPO run
    cluster = tmp_path / "one.yaml"
    cluster.write_text(
        "name: one\nexecutor: slurm\naccount: a\ncontainer_image: i.sqsh\n"
        "gpus_per_node: 1\ngpu_memory_gib: 79.6\n"
    )
    assert main(["plan", str(recipe), "--cluster", str(cluster), "--nodes", "1"]) == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "overflows at: optimizer (fp32 main + Adam)" in out


# ---- the command line ---------------------------------------------------------------------------------


def test_plan_json_for_the_8b_recipe(capsys):
    rc = main(["plan", "examples/qwen3_8b_srpo.yaml", "--cluster", "h100", "--nodes", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    assert out["policy_params"] == 8_190_735_360
    assert out["gpu_bytes"] == H100 and 0 < out["peak_bytes"] <= out["gpu_bytes"]
    assert set(out["components"]) == {"train", "rollout"}
    assert out["components"]["train"]["teacher fp32 copy"] > 0
    assert out["fitting_layouts"][0]["layout"].startswith("TP")


# Qwen3-8B at TP4 (examples/qwen3_8b_srpo.yaml): H 4096, the vocabulary padded to 152,064 -> 38,016 rows per
# rank, a micro-batch of 10,240 tokens, bf16. Materialised: four [T, V/TP] bf16 tensors + three 128 MiB
# fp32 work buffers. Fused (ops/fused_output.py's backward): the fp32 weight-grad accumulator [V/TP, H],
# the hidden-state grad [T, H] bf16, and the chunk loop's buffers: 882 rows (128 MiB / (4 * 38,016)) in
# three fp32 work buffers + the bf16 GEMM block + its fp32 dL/dlogits + that rounded to bf16 (more than the
# accumulator's bf16 rounding, 2 * 38,016 * 4096, after the loop).
MATERIALISED_8B_TP4 = 4 * 10240 * 38016 * 2 + 3 * 128 * 2**20
FUSED_8B_TP4 = 38016 * 4096 * 4 + 10240 * 4096 * 2 + (3 * 4 + 2 * 2 + 4) * 882 * 38016


def test_plan_drops_the_logits_with_the_fused_output_layer(capsys):
    """performance.fused_output (auto = on): the last stage's loss working set is the fused layer's, and the
    table says by how much it dropped."""
    rc = main(["plan", "examples/qwen3_8b_srpo.yaml", "--cluster", "h100", "--nodes", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["components"]["train"]["loss logits + chunks"] == FUSED_8B_TP4
    assert out["fused_output_loss_logits"] == {
        "materialised_bytes": MATERIALISED_8B_TP4,
        "fused_bytes": FUSED_8B_TP4,
    }
    main(["plan", "examples/qwen3_8b_srpo.yaml", "--cluster", "h100", "--nodes", "4"])
    before, after = MATERIALISED_8B_TP4 / GiB, FUSED_8B_TP4 / GiB
    line = f"fused output layer: loss logits {before:.2f} GiB -> {after:.2f} GiB"
    assert line == "fused output layer: loss logits 3.28 GiB -> 1.28 GiB"
    assert line in capsys.readouterr().out


def test_plan_with_fused_output_off_keeps_the_materialised_logits(capsys):
    args = ["plan", "examples/qwen3_8b_srpo.yaml", "--cluster", "h100", "--nodes", "4"]
    args += ["-o", "performance.fused_output=off"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["components"]["train"]["loss logits + chunks"] == MATERIALISED_8B_TP4
    assert out["fused_output_loss_logits"] is None
    main(args)
    assert "fused output layer" not in capsys.readouterr().out


def test_plan_rejects_a_layout_that_does_not_divide_the_gpus(capsys):
    rc = main(
        ["plan", "examples/qwen3_8b_srpo.yaml", "--cluster", "h100", "--nodes", "1", "-o", "parallel.tp=3"]
    )
    assert rc == 2 and "does not divide" in capsys.readouterr().err


@pytest.fixture
def stdin_devnull(monkeypatch):
    # nemo-run's git packager runs through `invoke`, which mirrors stdin; pytest's captured stdin raises.
    import os
    import sys

    with open(os.devnull) as f:
        monkeypatch.setattr(sys, "stdin", f)
        yield


def test_launch_refuses_what_does_not_fit_unless_forced(tmp_path, capsys, stdin_devnull):
    from srpo_megatron.launch import commands

    base = ["launch", "examples/qwen3_8b_srpo.yaml", "--cluster", "h100", "--nodes", "1", "--dryrun"]
    base += ["--home", str(tmp_path), "-o", "parallel.tp=1", "-o", "parallel.distributed_optimizer=false"]
    base += ["-o", "parallel.sequence_parallel=null"]  # the trainer refuses SP at TP1, so the planner does
    assert commands.main(base) == 2
    err = capsys.readouterr().err
    assert "DOES NOT FIT" in err and "--force" in err and "optimizer (fp32 main + Adam)" in err
    assert commands.main([*base, "--force"]) == 0
    captured = capsys.readouterr()
    assert "#SBATCH" in captured.out and "--force: launching" in captured.err


@pytest.mark.parametrize(
    "name", ["qwen3_14b_srpo", "qwen3_32b_srpo", "qwen3_32b_lora_srpo", "qwen3_235b_a22b_lora_srpo"]
)
def test_big_recipes_fit_pass_dryrun_and_state_the_planned_peak(name, tmp_path, capsys, stdin_devnull):
    from srpo_megatron.launch import commands

    path = REPO / "examples" / f"{name}.yaml"
    text = path.read_text()
    m = re.search(r"srpo launch examples/\S+ --cluster cluster/h100.yaml --nodes (\d+)", text)
    nodes = int(m.group(1))
    stated = float(re.search(r"planner peak: ([\d.]+) GiB per GPU", text).group(1))
    plan, _, _ = plan_recipe(path, [], nodes * 8, 8, H100)
    assert plan.fits, plan.problems
    assert abs(plan.peak_bytes / GiB - stated) < 0.05, "update the recipe's 'planner peak' comment"
    tracked = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"HEAD:examples/{name}.yaml"])
    if tracked.returncode != 0:
        pytest.skip("recipe not committed yet (the h100 cluster ships `git archive HEAD`)")
    args = ["launch", f"examples/{name}.yaml", "--cluster", "h100", "--nodes", str(nodes), "--dryrun"]
    rc = commands.main([*args, "--home", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
