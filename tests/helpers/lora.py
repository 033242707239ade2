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
