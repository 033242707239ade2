"""Shared by the LoRA export tests: the contract's adapter names written out by hand (not from
``LoraTable``), random adapters for every targeted ``nn.Linear`` of an HF model, and the float64 reference
``W + (alpha/r) B A``."""

from __future__ import annotations

import copy

import torch

from srpo_megatron.config.lora import LoraConfig

# The contract's megatron names, written out here by hand (not from LoraTable): HF module -> megatron stem.
_ATTN = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj"}
_MLP = {"gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def contract_name(i: int, target: str, factor: str, expert: int | None = None) -> str:
    if target in _ATTN:
        return f"decoder.layers.{i}.self_attention.{_ATTN[target]}.lora.{target}.{factor}"
    if expert is not None:
        return f"decoder.layers.{i}.mlp.experts.local_experts.{expert}.{_MLP[target]}.lora.{target}.{factor}"
    return f"decoder.layers.{i}.mlp.{_MLP[target]}.lora.{target}.{factor}"


def random_adapters(model, lora: LoraConfig, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random A [r, in] and B [out, r] (B nonzero, unlike PEFT's init) for every targeted nn.Linear."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in model.named_modules():
        target = name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and target in lora.target_modules and ".layers." in name:
            i = int(name.split(".layers.")[1].split(".")[0])
            a, b = (lora.rank, mod.in_features), (mod.out_features, lora.rank)
            out[contract_name(i, target, "lora_A")] = torch.randn(a, generator=g) * 0.3
            out[contract_name(i, target, "lora_B")] = torch.randn(b, generator=g) * 0.3
    return out


def reference_logits(base, adapters: dict[str, torch.Tensor], lora: LoraConfig, ids) -> torch.Tensor:
    """float64 model with W + (alpha/r) B A on every targeted linear (and, with ``lora.experts``, on every
    routed expert), from the contract names alone."""
    ref = copy.deepcopy(base).double()
    if getattr(ref.config, "num_experts", None):
        ref.set_experts_implementation("eager")  # the grouped-GEMM default takes no float64
    with torch.no_grad():
        for name, mod in ref.named_modules():
            target = name.rsplit(".", 1)[-1]
            if isinstance(mod, torch.nn.Linear) and target in lora.target_modules and ".layers." in name:
                i = int(name.split(".layers.")[1].split(".")[0])
                a = adapters[contract_name(i, target, "lora_A")].double()
                b = adapters[contract_name(i, target, "lora_B")].double()
                mod.weight += (lora.alpha / lora.rank) * (b @ a)
        if lora.experts:
            add_expert_deltas(ref, adapters, lora)
        return ref(ids).logits


def random_expert_adapters(model, lora: LoraConfig, seed: int = 2) -> dict[str, torch.Tensor]:
    """Random per-expert gate/up/down adapters (contract names) for a transformers-5 Qwen3-MoE."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, layer in enumerate(model.model.layers):
        e_count, two_f, h = layer.mlp.experts.gate_up_proj.shape
        for e in range(e_count):
            for target, (o, n) in (("gate_proj", (two_f // 2, h)), ("up_proj", (two_f // 2, h)),
                                   ("down_proj", (h, two_f // 2))):  # fmt: skip
                out[contract_name(i, target, "lora_A", e)] = torch.randn(lora.rank, n, generator=g) * 0.3
                out[contract_name(i, target, "lora_B", e)] = torch.randn(o, lora.rank, generator=g) * 0.3
    return out


def add_expert_deltas(ref, adapters: dict[str, torch.Tensor], lora: LoraConfig) -> None:
    """In place on a float64 transformers-5 Qwen3-MoE: expert e's gate rows, up rows and down weight of the
    fused ``gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]`` get their (alpha/r) B A."""
    s = lora.alpha / lora.rank
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            ex = layer.mlp.experts
            f = ex.gate_up_proj.shape[1] // 2
            for e in range(ex.gate_up_proj.shape[0]):
                d = {t: s * adapters[contract_name(i, t, "lora_B", e)].double()
                     @ adapters[contract_name(i, t, "lora_A", e)].double()
                     for t in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
                ex.gate_up_proj[e, :f] += d["gate_proj"]
                ex.gate_up_proj[e, f:] += d["up_proj"]
                ex.down_proj[e] += d["down_proj"]
