"""LoRA adapters on the megatron policy equal ``peft``'s on the HF model: logits and every adapter gradient
(fp32, <= 1e-5) at TP1, TP2 (with and without sequence parallelism), PP2 and, for Qwen3-MoE, TP2 x EP2
(attention adapters, and per-expert adapters against peft's ``target_parameters`` on transformers' fused
experts); the base weights get no gradient, the distributed optimizer holds state for the adapters only and
the adapters' dist-checkpoint entries have the full HF shapes.

The reference is independent: transformers' Qwen3 / Qwen3-MoE with ``peft.get_peft_model`` (one adapter per
HF projection, ``lora_dropout=0``), B drawn non-zero from a fixed seed, and the same A/B tensors loaded into
the megatron adapters (``models/lora.load_lora``) by name. Megatron runs its real schedules (1F1B under PP)
on gloo ranks with megatron DDP + ``finalize_model_grads``; the adapter gradients are gathered over TP on
each parameter's TP axis. The test ``test_planted_bugs_fail`` shows that a shared A across q/k/v, a missing
TP reduction of A's gradient under SP, and a wrong fused-QKV placement each break the comparison (a
swapped expert gate/up placement was planted by hand and failed the expert case by 0.25 in the logits).
"""

from __future__ import annotations

import re

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import TINY_MOE_EXPERTS as MOE_EXPERTS
from srpo_megatron.testing.tiny import TINY_VOCAB, tiny_hf_model, tiny_moe_model
from tests.helpers.lora import ALPHA, RANK, peft_moe_reference, peft_reference
from tests.helpers.megatron import merge_rank_results
from tests.helpers.moe import batches_for

DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # transformers' fused experts are no nn.Linear


def lora_worker(
    rank, world, layout, sp, hf_config, hf_state, targets, adapters, batches, plant=None, experts=False
):
    """On this rank: the policy with adapters loaded; logits, full adapter grads (global names), the base
    parameters that got a gradient, and the optimizer's holdings after one distributed-optimizer step."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from srpo_megatron.config import MoEConfig
    from srpo_megatron.config.lora import LoraConfig
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights, stage_expert_offset, stage_layer_offset
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.lora import attach_lora, global_lora_name, load_lora, lora_parameters
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from tests.helpers.megatron import run_schedule

    tp, pp, ep = layout
    initialize_model_parallel(tp, pp, ep=ep)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    extra = {"moe": MoEConfig()} if arch.is_moe else {"sequence_parallel": sp}
    model = build_policy(arch, parallel_output=False, **extra)
    load_hf_weights(model, table, hf_state.__getitem__)
    offset, eoff = stage_layer_offset(model), stage_expert_offset(table)
    attach_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets, experts=experts))
    if plant is not None:
        plant(model)
    load_lora(model, adapters.__getitem__, offset, eoff)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    ddp, logits = run_schedule(model, batches, arch.vocab_size, ddp_config=ddp_config)
    grads = {
        global_lora_name(n, offset, eoff): _full(ddp.module, n, p.main_grad)
        for n, p in lora_parameters(ddp.module).items()
    }
    base_with_grad = [
        n
        for n, p in ddp.module.named_parameters()
        if ".lora." not in n
        and (p.requires_grad or p.grad is not None or getattr(p, "main_grad", None) is not None)
    ]
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, use_distributed_optimizer=True, params_dtype=torch.float32
        ),
        [ddp],
    )
    opt.step()
    held, state = _optimizer_holdings(opt, lora_parameters(ddp.module))
    sharded = ddp.module.sharded_state_dict(prefix="model.")
    ckpt = {t.key: tuple(t.global_shape) for t in sharded.values() if ".lora." in getattr(t, "key", "")}
    shows = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return (logits if shows else None), {
        "grads": grads,
        "base": base_with_grad,
        "held": held,
        "state": state,
        "ckpt": ckpt,
    }


def _full(module, name: str, grad: torch.Tensor) -> torch.Tensor:
    """The full adapter gradient: TP shards gathered on the parameter's TP axis."""
    import torch.distributed as dist

    p = module.get_parameter(name)
    plan = module.get_submodule(name.rsplit(".lora.", 1)[0])._lora_plan
    if p.lora_tp_axis is None:
        return grad.clone()
    shards = [torch.empty_like(grad) for _ in range(plan.tp)]
    dist.all_gather(shards, grad.contiguous(), group=plan.tp_group)
    return torch.cat(shards, dim=p.lora_tp_axis)


def _optimizer_holdings(opt, adapters: dict) -> tuple[bool, tuple[int, int]]:
    """(the optimizer's buffers hold exactly the adapters, (Adam state elements, 2 x this rank's share of
    the adapter elements)), the pair summed over all ranks."""
    import torch.distributed as dist

    chained = list(getattr(opt, "chained_optimizers", [opt]))
    params = {id(p): p for o in chained for b in o.buffers for p in b.param_index_map}
    held = set(params) == {id(p) for p in adapters.values()}
    state = sum(
        t.numel()
        for o in chained
        for st in o.optimizer.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    share = sum(
        2 * p.numel() / dist.get_world_size(b.data_parallel_group)
        for o in chained
        for b in o.buffers
        for p in b.param_index_map
    )
    both = torch.tensor([float(state), share])
    dist.all_reduce(both)
    return held, (int(both[0]), round(both[1].item()))


def run_layout(layout, sp, case, plant=None, experts=False):
    tp, pp, ep = layout
    world = max(tp, ep) * pp
    results = run_distributed(
        lora_worker, world, layout, sp, *case, plant=plant, experts=experts, timeout=600
    )
    ((logits, out),) = merge_rank_results([[(r[0], r[1]["grads"])] for r in results])
    return logits, out, [r[1] for r in results]


def dense_case(seed: int = 0):
    hf = tiny_hf_model("qwen3", seed=seed)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    batches = batches_for(20 + seed)
    ref = peft_reference(hf, DENSE_TARGETS, seed, batches)
    return (hf.config.to_dict(), state, DENSE_TARGETS, ref[2], batches), ref


def _ckpt_key(name: str) -> str:
    """The dist-checkpoint key of a global adapter name: layers (and experts) become tensor axes."""
    rest = name.split(".", 3)[3]
    return "model.decoder.layers." + re.sub(
        r"mlp\.experts\.local_experts\.\d+\.", "mlp.experts.experts.", rest
    )


def _ckpt_shape(name: str, g: torch.Tensor, layers: int) -> tuple[int, ...]:
    return (layers, MOE_EXPERTS, *g.shape) if ".local_experts." in name else (layers, *g.shape)


def compare(tag, logits, grads, ref, ranks):
    ref_logits, ref_grads, _ = ref
    for got, want in zip(logits, ref_logits, strict=True):
        diff = (got[..., :TINY_VOCAB] - want).abs().max().item()
        assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
    assert sorted(grads) == sorted(ref_grads), f"{tag}: adapter names {set(grads) ^ set(ref_grads)}"
    for name, want in ref_grads.items():
        diff = (grads[name] - want).abs().max().item()
        assert diff <= 1e-5, f"{tag}: grad {name} differs by {diff} (max {want.abs().max().item():.3g})"
    layers = 1 + max(int(n.split(".")[2]) for n in ref_grads)
    want_ckpt = {_ckpt_key(n): _ckpt_shape(n, g, layers) for n, g in ref_grads.items()}
    got_ckpt = {k: v for r in ranks for k, v in r["ckpt"].items()}
    assert got_ckpt == want_ckpt, f"{tag}: dist-checkpoint adapter keys/shapes {got_ckpt} != {want_ckpt}"
    for r in ranks:
        assert r["base"] == [], f"{tag}: base parameters with a gradient: {r['base'][:4]}"
        assert r["held"], f"{tag}: the optimizer holds parameters other than the adapters"
        assert r["state"][0] == r["state"][1], (
            f"{tag}: Adam state {r['state'][0]} != 2 x adapters {r['state'][1]}"
        )


# (tp, pp, ep), sequence parallel
DENSE_LAYOUTS = [((1, 1, 1), False), ((2, 1, 1), True), ((2, 1, 1), False), ((1, 2, 1), False)]


@pytest.mark.parametrize("layout,sp", DENSE_LAYOUTS, ids=["tp1", "tp2-sp", "tp2", "pp2"])
def test_dense_lora_matches_peft(layout, sp):
    case, ref = dense_case()
    logits, grads, ranks = run_layout(layout, sp, case)
    compare(f"qwen3 {layout} sp={sp}", logits, grads, ref, ranks)


@pytest.mark.moe
def test_moe_lora_matches_peft_tp2_ep2():
    hf = tiny_moe_model(seed=3)
    from tests.helpers.moe import hf_file_state

    state = hf_file_state(hf)
    batches = batches_for(33)
    ref = peft_reference(hf, MOE_TARGETS, 3, batches)
    logits, grads, ranks = run_layout(
        (2, 1, 2), True, (hf.config.to_dict(), state, MOE_TARGETS, ref[2], batches)
    )
    compare("qwen3-moe TP2xEP2 (SP)", logits, grads, ref, ranks)


# Planted bugs (applied on every rank after the adapters are attached): each must break the comparison.
def plant_shared_qkv_a(model):
    """One A shared by q, k and v (a fused-QKV adapter with a single down-projection, not PEFT's)."""
    for name, module in model.named_modules():
        if name.endswith("linear_qkv"):
            module.lora["k_proj"].lora_A = module.lora["v_proj"].lora_A = module.lora["q_proj"].lora_A


def plant_no_sp_reduce(model):
    """A's gradient under SP left per sequence slice (no TP all-reduce in finalize_model_grads)."""
    for name, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) and ".lora." in name:
            p.sequence_parallel = False


def plant_qkv_not_interleaved(model):
    """The QKV delta placed as [q; k; v] instead of interleaved per query group."""
    for name, module in model.named_modules():
        if name.endswith("linear_qkv"):
            plan = module._lora_plan
            plan.split, plan.groups = (
                [plan.split[0] * plan.groups, plan.split[1] * plan.groups, plan.split[2] * plan.groups][:3],
                1,
            )


PLANTS = [
    (plant_shared_qkv_a, (2, 1, 1), True),
    (plant_no_sp_reduce, (2, 1, 1), True),
    (plant_qkv_not_interleaved, (1, 1, 1), False),  # at TP2 each rank holds one query group: no interleave
]


@pytest.mark.parametrize("plant,layout,sp", PLANTS, ids=[p[0].__name__ for p in PLANTS])
def test_planted_bugs_fail(plant, layout, sp):
    case, ref = dense_case()
    try:
        logits, grads, ranks = run_layout(layout, sp, case, plant=plant)
    except Exception as e:
        return print(f"{plant.__name__}: the run fails: {type(e).__name__}")
    with pytest.raises(AssertionError) as caught:
        compare(plant.__name__, logits, grads, ref, ranks)
    print(f"{plant.__name__}: {str(caught.value).splitlines()[0]}")


@pytest.mark.moe
def test_moe_expert_lora_matches_peft_tp2_ep2():
    """Per-expert gate/up/down adapters (``lora.experts: true``) on Qwen3-MoE at TP2 x EP2 (SP) equal peft's
    ``target_parameters`` adapters of transformers' fused experts (tests/helpers/lora.py maps them)."""
    from tests.helpers.moe import hf_file_state

    hf = tiny_moe_model(seed=4)
    state = hf_file_state(hf)
    batches = batches_for(44)
    ref = peft_moe_reference(hf, MOE_TARGETS, 4, batches)
    targets = [*MOE_TARGETS, "gate_proj", "up_proj", "down_proj"]
    case = (hf.config.to_dict(), state, targets, ref[2], batches)
    logits, grads, ranks = run_layout((2, 1, 2), True, case, experts=True)
    compare("qwen3-moe experts TP2xEP2 (SP)", logits, grads, ref, ranks)


def init_worker(rank, world, tp, hf_config, hf_state):
    """PEFT-style init at TP ``tp``: the full adapters by global name, and the refusals' messages."""
    from srpo_megatron.config.lora import LoraConfig
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights, stage_layer_offset
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.lora import LoraError, attach_lora, global_lora_name, init_lora, lora_parameters
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(tp, 1)
    arch = Architecture.from_hf(hf_config)
    errors = []
    for bad in (["q_a_proj"], ["o_proj"]):
        model = build_policy(arch, parallel_output=False)
        if bad == ["o_proj"]:  # attention off: a model with nothing to adapt
            model.decoder.layers = model.decoder.layers[:0]
        try:
            attach_lora(model, LoraConfig(rank=RANK, target_modules=bad))
        except LoraError as e:
            errors.append(str(e))
    model = build_policy(arch, parallel_output=False)
    load_hf_weights(model, ConversionTable(arch), hf_state.__getitem__)
    attach_lora(model, LoraConfig(rank=RANK, alpha=ALPHA))
    init_lora(model, seed=7, layer_offset=stage_layer_offset(model))
    full = {global_lora_name(n, 0): _full(model, n, p.detach()) for n, p in lora_parameters(model).items()}
    frozen = [n for n, p in model.named_parameters() if p.requires_grad != (".lora." in n)]
    return {"full": full, "errors": errors, "frozen_wrong": frozen}


def test_init_is_pefts_and_layout_independent_and_bad_targets_are_refused():
    """A ~ U(±1/√in) (PEFT's kaiming-uniform with a=√5), B = 0, the same full adapters at TP1 and TP2 (drawn
    full-size per global name, then sharded), only the adapters train, and a target no linear answers to is
    refused in one line."""
    hf = tiny_hf_model("qwen3", seed=1)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    (one,) = run_distributed(init_worker, 1, 1, hf.config.to_dict(), state, timeout=600)
    two = run_distributed(init_worker, 2, 2, hf.config.to_dict(), state, timeout=600)
    assert sorted(one["full"]) == sorted(two[0]["full"])
    for name, t in one["full"].items():
        assert torch.equal(t, two[0]["full"][name]), f"{name} differs between TP1 and TP2"
        if name.endswith("lora_B"):
            assert not t.any(), f"{name} must start at zero"
        else:
            bound = 1.0 / t.shape[1] ** 0.5
            assert t.abs().max() <= bound and t.abs().max() > 0.9 * bound, f"{name}: not U(±1/√in)"
    assert len({t.sum().item() for n, t in one["full"].items() if n.endswith("lora_A")}) > 1
    assert one["frozen_wrong"] == [] and two[0]["frozen_wrong"] == []
    mla, nothing = one["errors"]
    assert "MLA" in mla and "q_a_proj" in mla, mla
    assert "matched no linear" in nothing, nothing
