"""The planner's LoRA figures (``planner/lora.py``), exact for a tiny Qwen3: adapter values per GPU follow
the base linear's TP split (column: B split, A replicated; row: A split, B replicated) and the PP stage's
layers; gradients, Adam state (/DP with the distributed optimizer) and the EMA teacher's fp32 adapters;
and ``srpo plan`` prints them for a LoRA recipe."""

from __future__ import annotations

import dataclasses

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.planner.lora import lora_plan
from tests.helpers.conversion import arch

# BASE (tests/helpers/conversion.py) with head_dim 4: H 8, F 6, 2 layers, 4 query heads and 2 KV heads of 4
A = arch("qwen3", head_dim=4)
LORA = LoraConfig(rank=3)


def test_tiny_qwen3_lora_figures_are_exact():
    whole = lora_plan(A, LORA)
    # per layer: q 3*8 + 16*3, k and v 3*8 + 8*3, o 3*16 + 8*3, gate and up 3*8 + 6*3, down 3*6 + 8*3
    assert whole.adapter_params == whole.adapter_params_per_gpu == 2 * 366
    # TP2: q 24 + 48/2, k/v 24 + 24/2, o 48/2 + 24, gate/up 24 + 18/2, down 18/2 + 24 -> 267 per layer
    # PP2: one layer per stage
    p = lora_plan(A, LORA, tp=2, pp=2, dp=2, stage_params=1000)
    assert p.adapter_params == 732 and p.adapter_params_per_gpu == 267
    assert p.grad_bytes == 4 * 267
    assert p.optimizer_bytes == 12 * 267 // 2  # fp32 main + two moments, sharded over DP 2
    assert p.teacher_bytes == 4 * 267  # the EMA teacher: one fp32 adapter
    assert p.teacher_full_bytes == 6 * 1000 and p.teacher_saving == 6000 - 4 * 267
    plain = lora_plan(A, LORA, tp=2, dp=2, distributed_optimizer=False, ema_teacher=False)
    assert plain.adapter_params_per_gpu == 2 * 267 and plain.optimizer_bytes == 12 * 534
    assert plain.teacher_bytes == plain.teacher_full_bytes == 0


def test_srpo_plan_prints_the_lora_figures(capsys):
    import argparse
    import json

    from srpo_megatron.planner.command import add_plan_args, plan_main

    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    base = [
        "examples/qwen3_8b_srpo.yaml",
        "--cluster",
        "h100",
        "-o",
        "lora.rank=16",
        "-o",
        "lora.sync=merged",
    ]
    plan_main(parser.parse_args([*base, "--json"]))
    lora = json.loads(capsys.readouterr().out)["lora"]
    # Qwen3-8B, all seven projections at r=16: 36 x 16 x (7H + 2 n_q d + 2 n_kv d + 3F) (weights/lora_sync.py)
    assert lora["adapter_params"] == 36 * 16 * (7 * 4096 + 2 * 32 * 128 + 2 * 8 * 128 + 3 * 12288)
    assert lora["teacher_bytes"] == 4 * lora["adapter_params_per_gpu"] < lora["teacher_full_bytes"]
    plan_main(parser.parse_args(base))
    assert "LoRA: 43.65 M adapter params" in capsys.readouterr().out
    plan_main(parser.parse_args([*base[:-4], "--json"]))
    assert "lora" not in json.loads(capsys.readouterr().out)  # rank 0: no LoRA figures


def test_the_memory_plan_freezes_the_base_with_lora():
    """``plan_layout`` with ``PlanSettings.lora``: the base is bf16 only (no grads, main copy or Adam state);
    the adapters train (fp32 grads, 12 B/value of optimizer state over DP 2) and the teacher is one fp32
    adapter (plus the student's bf16 adapters it swaps out during its forward, train phase only)."""
    from srpo_megatron.planner.memory import PlanSettings, plan_layout
    from srpo_megatron.planner.model import Layout, ModelShape
    from tests.helpers.conversion import BASE

    shape = ModelShape.from_hf({**BASE, "model_type": "qwen3", "head_dim": 4})
    s = PlanSettings(layout=Layout(tp=2, pp=2, dp=2), gpu_bytes=2**40, engine="none", lora=(A, LORA))
    plan = plan_layout(shape, s)
    # base per layer at TP2: QKV (16+8+8)·8/2 + q/k norms 2·4 + proj 8·16/2 + 2 norms 2·8 + fc1 2·6·8/2 +
    # fc2 8·6/2 = 288; stage 1 adds the final norm 8 and the output layer's 256/2 padded rows · 8 = 1024
    base, n = 288 + 8 + 1024, 267  # adapters: test_tiny_qwen3_lora_figures_are_exact
    t, r = plan.stage.train, plan.stage.rollout
    assert plan.stage.stage == 1
    assert t["policy params"] == 2 * (base + n)
    assert t["gradient buffers"] == 4 * n
    assert t["optimizer (fp32 main + Adam)"] == 12 * 134  # ceil(267 / DP 2) values of fp32 main + moments
    assert t["teacher bf16 copy"] == 2 * n and r["teacher bf16 copy"] == 0
    assert t["teacher fp32 copy"] == 4 * n == r["teacher fp32 copy"]
    full = plan_layout(shape, dataclasses.replace(s, lora=None)).stage.train
    assert full["gradient buffers"] >= 4 * base and full["teacher bf16 copy"] >= 2 * base


def test_lora_recipes_fit_where_full_fine_tuning_does_not():
    """The LoRA recipes fit on one node; the same recipes with ``lora.rank=0`` do not (full fine-tuning)."""
    from srpo_megatron.planner.command import plan_recipe
    from srpo_megatron.planner.memory import GiB

    h100 = int(79.6 * GiB)
    for name in ("qwen3_32b_lora_srpo", "qwen3_235b_a22b_lora_srpo"):
        assert plan_recipe(f"examples/{name}.yaml", [], 8, 8, h100)[0].fits
        assert not plan_recipe(f"examples/{name}.yaml", ["lora.rank=0"], 8, 8, h100)[0].fits
