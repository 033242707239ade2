"""The GPU-default choosers (models/performance.py) on CPU: what they pick here, what they pick given a
simulated GPU machine, that megatron-core accepts every choice, and that bad recipes name the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from srpo_megatron.config import ConfigError, OptimConfig, PerformanceConfig, TrainConfig, load_config
from srpo_megatron.models import performance as perf
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.models.performance import Accelerators
from srpo_megatron.models.policy import transformer_config_from_hf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CPU = Accelerators.none()
GPU_TE_APEX = Accelerators(
    cuda=True, transformer_engine=True, apex_grad_accum=True, te_rope=True, torch_compile=True
)
GPU_STOCK = Accelerators(
    cuda=True, transformer_engine=False, apex_grad_accum=False, te_rope=False, torch_compile=True
)
ARCH = Architecture.from_hf(
    dict(
        model_type="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
)
FUSIONS = (
    "gradient_accumulation_fusion",
    "apply_rope_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
)


def test_detect_on_this_cpu_machine_finds_nothing():
    assert Accelerators.detect() == CPU


def test_cpu_choices_reproduce_the_previous_config_exactly():
    """On CPU every choice is off, so the TransformerConfig equals the one built before the choosers
    existed (same fields, same values): CPU numerics cannot change."""
    overrides = perf.transformer_overrides(PerformanceConfig(), sequence_parallel=False, acc=CPU)
    assert all(overrides[k] is False for k in FUSIONS) and overrides["sequence_parallel"] is False
    assert "recompute_granularity" not in overrides
    before = transformer_config_from_hf(ARCH, params_dtype=torch.float32)
    after = transformer_config_from_hf(ARCH, params_dtype=perf.params_dtype("auto", CPU), **overrides)
    diff = {
        f.name
        for f in dataclasses.fields(before)
        if not f.name.endswith("init_method")  # fresh closures per config; same init functions
        if getattr(before, f.name) != getattr(after, f.name)
    }
    assert diff == set()
    assert not perf.use_transformer_engine(PerformanceConfig(), CPU)
    ddp = perf.ddp_config(PerformanceConfig(), distributed_optimizer=True, acc=CPU)
    assert ddp.grad_reduce_in_fp32 and not ddp.overlap_grad_reduce and not ddp.overlap_param_gather
    opt = perf.optimizer_config(OptimConfig(), dtype=torch.float32, ddp=ddp)
    assert not opt.bf16 and opt.params_dtype == torch.float32
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    o = OptimConfig()  # what PolicyRuntime built before the choosers
    assert ddp == DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    assert opt == OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=False,
        params_dtype=torch.float32,
        use_distributed_optimizer=True,
    )


def test_simulated_gpu_with_te_and_apex_turns_everything_on():
    cfg = PerformanceConfig()
    assert perf.params_dtype("auto", GPU_TE_APEX) == torch.bfloat16
    assert perf.use_transformer_engine(cfg, GPU_TE_APEX)
    sp = perf.sequence_parallel(None, 2, GPU_TE_APEX)
    overrides = perf.transformer_overrides(cfg, sequence_parallel=sp, acc=GPU_TE_APEX)
    assert sp and overrides["sequence_parallel"] and all(overrides[k] for k in FUSIONS)
    ddp = perf.ddp_config(cfg, distributed_optimizer=True, acc=GPU_TE_APEX)
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather and ddp.grad_reduce_in_fp32
    opt = perf.optimizer_config(OptimConfig(), dtype=torch.bfloat16, ddp=ddp)
    # megatron's mixed-precision path: bf16 model params, fp32 main params and main grads
    assert opt.bf16 and opt.params_dtype == torch.bfloat16
    assert opt.main_params_dtype == torch.float32 and opt.main_grads_dtype == torch.float32
    assert (
        opt.use_distributed_optimizer and opt.overlap_param_gather and not opt.use_precision_aware_optimizer
    )


def test_stock_gpu_without_te_or_apex_fuses_only_what_torch_compile_provides():
    overrides = perf.transformer_overrides(PerformanceConfig(), sequence_parallel=False, acc=GPU_STOCK)
    assert not overrides["gradient_accumulation_fusion"] and not overrides["apply_rope_fusion"]
    assert overrides["bias_activation_fusion"] and overrides["bias_dropout_fusion"]
    assert not perf.use_transformer_engine(PerformanceConfig(), GPU_STOCK)
    # SwiGLU without biases passes megatron's bias_activation_fusion checks (no TE or apex needed)
    config = transformer_config_from_hf(ARCH, params_dtype=torch.bfloat16, **overrides)
    assert config.bias_activation_fusion and config.bf16


def test_fusions_off_and_overlap_off_are_respected_on_a_gpu():
    cfg = PerformanceConfig(fusions="off", overlap_comm="off")
    overrides = perf.transformer_overrides(cfg, sequence_parallel=False, acc=GPU_TE_APEX)
    assert not any(overrides[k] for k in FUSIONS)
    assert not perf.overlap_enabled(cfg, distributed_optimizer=True, acc=GPU_TE_APEX)
    assert not perf.overlap_enabled(PerformanceConfig(), distributed_optimizer=False, acc=GPU_TE_APEX)


def test_sequence_parallel_auto_and_explicit():
    assert perf.sequence_parallel(None, 1, GPU_TE_APEX) is False
    assert perf.sequence_parallel(None, 4, GPU_TE_APEX) is True
    assert perf.sequence_parallel(None, 4, CPU) is False
    assert perf.sequence_parallel(True, 2, GPU_STOCK) is True  # local spec with SP-aware norms
    with pytest.raises(ConfigError, match=r"trains only on CUDA.*set it to false for CPU runs"):
        perf.sequence_parallel(True, 2, CPU)
    assert perf.sequence_parallel(False, 4, GPU_TE_APEX) is False
    with pytest.raises(ConfigError, match=r"needs parallel\.tp > 1"):
        perf.sequence_parallel(True, 1, CPU)


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (
            PerformanceConfig(recompute="selective"),
            dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
        ),
        (
            PerformanceConfig(recompute="full", recompute_method="block", recompute_num_layers=2),
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        ),
        (
            PerformanceConfig(recompute="full"),
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        ),
    ],
)
def test_recompute_keys_reach_a_valid_transformer_config(cfg, expected):
    overrides = perf.transformer_overrides(cfg, sequence_parallel=False, acc=CPU)
    assert {k: overrides[k] for k in expected} == expected
    config = transformer_config_from_hf(ARCH, **overrides)  # megatron validates the combination
    for k, v in expected.items():
        assert getattr(config, k) == v


def test_bad_choices_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"layer_spec=te.*transformer_engine does not import"):
        perf.use_transformer_engine(PerformanceConfig(layer_spec="te"), GPU_STOCK)
    with pytest.raises(ConfigError, match=r"overlap_comm=on needs parallel\.distributed_optimizer"):
        perf.overlap_enabled(PerformanceConfig(overlap_comm="on"), distributed_optimizer=False, acc=CPU)
    with pytest.raises(ConfigError, match="recompute_num_layers=0"):
        PerformanceConfig(recompute="full", recompute_num_layers=0)
    with pytest.raises(ConfigError, match=r"recompute_modules.*core_attn"):
        PerformanceConfig(recompute="selective", recompute_modules=["attention"])
    p = tmp_path / "r.yaml"
    p.write_text("model: {hf_dir: x}\ndata: {train_files: [a.jsonl]}\nperformance: {recompute: everything}\n")
    with pytest.raises(ConfigError, match=r"performance.recompute: 'everything' is not valid.*selective"):
        load_config(TrainConfig, p)


RECIPE = "model: {hf_dir: x}\ndata: {train_files: [a.jsonl]}\n"


@pytest.mark.parametrize("spelling", ["off", "no", "false"])
def test_bare_off_in_a_recipe_and_an_override_means_off(tmp_path, spelling):
    """YAML reads a bare ``off`` as false: the enum keys take it as the "off" their docs name."""
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE + f"performance: {{fusions: {spelling}, overlap_comm: {spelling}}}\n")
    cfg = load_config(TrainConfig, p).performance
    assert (cfg.fusions, cfg.overlap_comm) == ("off", "off")
    p.write_text(RECIPE)
    ov = [f"performance.fusions={spelling}", f"performance.overlap_comm={spelling}"]
    cfg = load_config(TrainConfig, p, ov).performance
    assert (cfg.fusions, cfg.overlap_comm) == ("off", "off")
    overrides = perf.transformer_overrides(cfg, sequence_parallel=False, acc=GPU_TE_APEX)
    assert not any(overrides[k] for k in FUSIONS)  # off even where every fusion is available
    assert load_config(TrainConfig, p, ["performance.fusions='off'"]).performance.fusions == "off"


def test_bare_on_means_on_only_where_on_is_a_choice(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE + "performance: {overlap_comm: on}\n")
    assert load_config(TrainConfig, p).performance.overlap_comm == "on"
    assert load_config(TrainConfig, p, ["performance.overlap_comm=yes"]).performance.overlap_comm == "on"
    with pytest.raises(ConfigError) as err:  # fusions has no "on": say what YAML did, list the choices
        load_config(TrainConfig, p, ["performance.fusions=on"])
    msg = str(err.value)
    assert "performance.fusions: true (YAML reads a bare on/off" in msg and "['auto', 'off']" in msg
    with pytest.raises(ConfigError, match=r"performance.recompute: false .* choose one of \['none'"):
        load_config(TrainConfig, p, ["performance.recompute=off"])  # no "off" among its choices either


@pytest.mark.parametrize(
    "name", ["qwen3_4b_srpo.yaml", "qwen3_8b_srpo.yaml", "qwen3_8b_grpo.yaml", "qwen3_8b_sdpo.yaml"]
)
def test_gpu_recipes_use_every_gpu_default(name):
    cfg = load_config(TrainConfig, EXAMPLES / name)
    acc = GPU_TE_APEX
    assert cfg.parallel.tp > 1 and cfg.parallel.distributed_optimizer
    assert perf.params_dtype(cfg.model.params_dtype, acc) == torch.bfloat16
    sp = perf.sequence_parallel(cfg.parallel.sequence_parallel, cfg.parallel.tp, acc)
    overrides = perf.transformer_overrides(cfg.performance, sequence_parallel=sp, acc=acc)
    assert sp and all(overrides[k] for k in FUSIONS)
    assert cfg.performance.recompute != "none"
    assert overrides["recompute_granularity"] == cfg.performance.recompute
    assert perf.use_transformer_engine(cfg.performance, acc)
    assert perf.overlap_enabled(cfg.performance, distributed_optimizer=True, acc=acc)
