"""LoRA test helpers: transformers + ``peft`` as the independent reference of the megatron adapters, and
the name map between PEFT's adapter tensors and the megatron policy's (``models/lora.py``)."""

from __future__ import annotations

import re

import torch

from tests.helpers.megatron import hf_reference

RANK, ALPHA = 4, 8.0
_LINEAR = {
    "q_proj": "self_attention.linear_qkv",
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1",
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
}
_PEFT = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.(lora_[AB])\.default\.weight"
)


def megatron_name(peft_name: str) -> str:
    """``base_model.model.model.layers.3.self_attn.k_proj.lora_A.default.weight`` ->
    ``decoder.layers.3.self_attention.linear_qkv.lora.k_proj.lora_A``."""
    m = _PEFT.fullmatch(peft_name)
    assert m, peft_name
    layer, proj, ab = m.groups()
    return f"decoder.layers.{layer}.{_LINEAR[proj]}.lora.{proj}.{ab}"


def peft_model(hf, targets: list[str]):
    """``peft.get_peft_model`` on ``hf`` with this module's rank/alpha and no dropout."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))


def load_peft_adapters(model, adapters: dict[str, torch.Tensor]) -> None:
    """Set every adapter tensor of a peft ``model`` from ``adapters`` (megatron names, HF shapes)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(adapters[megatron_name(name)].to(p.dtype))


def peft_reference(hf, targets: list[str], seed: int, batches):
    """HF + peft with non-zero B: (logits, adapter grads, adapter tensors), both by megatron name."""
    model = peft_model(hf, targets)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    adapters = {megatron_name(n): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    logits, grads = hf_reference(model, batches)
    assert all("lora_" in n for n in grads), "peft trained a base weight"
    return logits, {megatron_name(n): g for n, g in grads.items()}, adapters


# Qwen3-MoE experts: transformers fuses every expert of a layer into ``mlp.experts.gate_up_proj`` [E, 2F, H]
# and ``down_proj`` [E, H, F], which peft adapts with ``target_parameters`` (a ``ParamWrapper``: A
# [rank·E, in] with expert e's rows at e·rank..(e+1)·rank, B [out, rank·E] with expert e's column j at
# j·E + e; peft/tuners/lora/layer.py ``ParamWrapper.get_delta_weight``). Our separate gate and up adapters of
# rank r are exactly a gate_up adapter of rank 2r with A = [A_gate; A_up] and B block-diagonal, scaled
# (2·alpha)/(2r) = alpha/r.
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_LAYER = re.compile(r"layers\.(\d+)\.")


def _expert_wrappers(model):
    """``(layer, parameter name, ParamWrapper)`` of every adapted expert parameter of a peft model."""
    for name, m in model.named_modules():
        if type(m).__name__ == "ParamWrapper":
            yield int(_LAYER.search(name).group(1)), m.parameter_name, m


def _expert_pieces(r: int, experts: int, kind: str, a: torch.Tensor, b: torch.Tensor):
    """``(megatron suffix, A_e, B_e)`` views of a peft expert adapter (A, B tensors or their grads)."""
    for e in range(experts):
        if kind == "down_proj":
            yield e, "linear_fc2.lora.down_proj", a[e * r : (e + 1) * r], b[:, e::experts]
            continue
        f = b.shape[0] // 2
        cols = b[:, e::experts]  # [2F, 2r]: column j of expert e
        yield e, "linear_fc1.lora.gate_proj", a[e * 2 * r : e * 2 * r + r], cols[:f, :r]
        yield e, "linear_fc1.lora.up_proj", a[e * 2 * r + r : (e + 1) * 2 * r], cols[f:, r:]


def _expert_named(model, r: int, experts: int, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for layer, kind, m in _expert_wrappers(model):
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        a, b = (a.grad, b.grad) if grads else (a, b)
        for e, suffix, pa, pb in _expert_pieces(r, experts, kind, a, b):
            base = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{suffix}"
            out[f"{base}.lora_A"], out[f"{base}.lora_B"] = pa.detach().clone(), pb.detach().clone()
    return out


def peft_moe_reference(hf, attention: list[str], seed: int, batches):
    """As :func:`peft_reference` for Qwen3-MoE with per-expert gate/up/down adapters as well."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=attention,
        target_parameters=EXPERT_PARAMS,
        rank_pattern={"gate_up_proj": 2 * RANK},
        alpha_pattern={"gate_up_proj": 2 * ALPHA},
        lora_dropout=0.0,
    )
    model = get_peft_model(hf, config)
    experts = hf.config.num_experts
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and ".experts." not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for _, kind, m in _expert_wrappers(model):
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
            rank = 2 * RANK if kind == "gate_up_proj" else RANK
            assert a.shape[0] == rank * experts, f"peft's rank_pattern missed {kind}: A {tuple(a.shape)}"
            b.zero_()  # off-diagonal blocks stay zero: gate and up adapters are separate
            for _, _, _, pb in _expert_pieces(RANK, experts, kind, a, b):
                pb.copy_(torch.randn(pb.shape, generator=gen) * 0.2)
    adapters = {megatron_name(n): p.detach().clone() for n, p in model.named_parameters() if _is_attn(n)}
    adapters.update(_expert_named(model, RANK, experts, grads=False))
    logits, grads = hf_reference(model, batches)
    named = {megatron_name(n): g for n, g in grads.items() if _is_attn(n)}
    named.update(_expert_named(model, RANK, experts, grads=True))
    return logits, named, adapters


def _is_attn(name: str) -> bool:
    return "lora_" in name and ".experts." not in name
