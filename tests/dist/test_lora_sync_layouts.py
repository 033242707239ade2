"""The LoRA weight-sync streams at TP1, TP2 (with SP) and PP2 against a float64 reference.

``lora.sync: merged`` (``weights.export.iter_stage_params``): each HF weight equals the float64
``W + (alpha/r) B A`` of the full HF base and full adapters (``conversion.lora_export.merge_lora``) within
fp32 rounding (<= 1e-6), unadapted tensors bit for bit; the fold happens on each rank's shard before the
base gather, so this checks the fused-QKV interleave and gate/up stacking of ``models.lora.lora_weight_delta``
under TP. ``lora.sync: adapter`` (``weights.lora_stream.iter_stage_adapters``): the PEFT-named adapters,
gathered over TP, equal the ones loaded, bit for bit, and are all of the table's. A planted delta without
the per-group QKV interleave fails the merged check (at TP1: the tiny model's 2 query groups on one rank).
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_hf_model
from tests.helpers.lora import ALPHA, RANK, peft_reference
from tests.helpers.moe import batches_for

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYOUTS = [(1, 1, False), (2, 1, True), (1, 2, False)]


def sync_worker(rank, world, tp, pp, sp, hf_config, state, adapters, plant):
    from srpo_megatron.config.lora import LoraConfig
    from srpo_megatron.conversion.lora_table import LoraTable
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights, stage_layer_offset
    from srpo_megatron.models import lora as lora_model
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.weights.export import iter_stage_params
    from srpo_megatron.weights.lora_stream import iter_stage_adapters

    groups = initialize_model_parallel(tp, pp)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch, sequence_parallel=sp)
    load_hf_weights(model, table, state.__getitem__)
    cfg = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    lora_model.attach_lora(model, cfg)
    lora_model.load_lora(model, adapters.__getitem__, stage_layer_offset(model))
    if plant:
        delta = lora_model.lora_weight_delta

        def flat(module):  # gate/up and q/k/v stacked whole, not interleaved per query group
            plan = module._lora_plan
            g, plan.groups = plan.groups, 1
            try:
                return delta(module)
            finally:
                plan.groups = g

        lora_model.lora_weight_delta = flat
    merged = [t for p in iter_stage_params(model, table, groups) for t in p.fetch()]
    sent = [t for p in iter_stage_adapters(model, LoraTable(arch, cfg, table), groups) for t in p.fetch()]
    return dict(merged), dict(sent)


def _reference(state, adapters):
    from srpo_megatron.config.lora import LoraConfig
    from srpo_megatron.conversion.lora_export import merge_lora
    from srpo_megatron.conversion.lora_table import LoraTable
    from srpo_megatron.models.architecture import Architecture

    hf = tiny_hf_model("qwen3", seed=0)
    table = LoraTable(Architecture.from_hf(hf.config.to_dict()), LoraConfig(rank=RANK, alpha=ALPHA))
    peft = dict(table.to_peft(n, t.double()) for n, t in adapters.items())
    return merge_lora({k: v.double() for k, v in state.items()}, peft, ALPHA / RANK), table


def _run(tp, pp, sp, plant=False):
    hf = tiny_hf_model("qwen3", seed=0)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    adapters = peft_reference(hf, TARGETS, 0, batches_for(20))[2]  # B non-zero, fixed seed
    results = run_distributed(
        sync_worker, tp * pp, tp, pp, sp, hf.config.to_dict(), state, adapters, plant, timeout=600
    )
    merged, sent = {}, {}
    for m, s in results:
        merged.update(m)
        sent.update(s)
    return merged, sent, state, adapters


@pytest.mark.parametrize("tp,pp,sp", LAYOUTS, ids=["tp1", "tp2-sp", "pp2"])
def test_merged_and_adapter_streams_match_float64(tp, pp, sp):
    merged, sent, state, adapters = _run(tp, pp, sp)
    ref, table = _reference(state, adapters)
    adapted = {r.hf_module + ".weight" for r in table._rows.values()}
    assert adapted <= set(merged) <= set(state)
    for k, t in merged.items():
        if k in adapted:
            assert (t.double() - ref[k]).abs().max().item() <= 1e-6, k
            assert (t - state[k]).abs().max().item() > 1e-4, f"{k}: the adapter delta must be visible"
        else:
            assert torch.equal(t, state[k]), k
    assert set(sent) == set(table.peft_names())
    for name, t in adapters.items():
        peft, full = table.to_peft(name, t)
        assert torch.equal(sent[peft], full), peft


def test_planted_flat_qkv_delta_fails():
    """At TP1, where the tiny model's two query groups share a rank (at TP2 each rank holds one)."""
    merged, _, state, adapters = _run(1, 1, False, plant=True)
    ref, _ = _reference(state, adapters)
    worst = max((merged[k].double() - ref[k]).abs().max().item() for k in merged if "self_attn.k_proj" in k)
    assert worst > 1e-3
