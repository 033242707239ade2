"""LoRA adapters on the CPU engine's transformers model, through ``peft`` (``lora.sync: adapter``).

The engine's model is wrapped once, at the first adapter sync, by ``peft.inject_adapter_in_model`` with the
recipe's rank, alpha and target modules and ``lora_dropout`` 0 (inference): every targeted ``nn.Linear``
becomes a ``peft.tuners.lora.Linear`` holding the same base weight object plus ``lora_A.default`` /
``lora_B.default``, so the engine's base-weight names and tensors do not move and its forward is
``W x + (alpha/r) B A x`` (PEFT's own). Each sync then copies the trainer's adapters, named as in PEFT's
``adapter_model.safetensors`` (``base_model.model.<module>.lora_{A,B}.weight``, ``conversion/lora_table.py``),
into ``<module>.lora_{A,B}.default.weight``.
"""

from __future__ import annotations

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


def inject_lora(model: torch.nn.Module, config: dict) -> dict[str, torch.Tensor]:
    """Wrap ``model``'s targeted linears with PEFT LoRA layers (in place; the base weights stay the same
    tensors); returns the adapter parameters by their PEFT file name. ``config``: ``adapter_config.json``'s
    dict (``conversion.lora_export.peft_adapter_config``)."""
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(
        r=config["r"],
        lora_alpha=config["lora_alpha"],
        target_modules=list(config["target_modules"]),
        lora_dropout=0.0,
        bias="none",
    )
    inject_adapter_in_model(cfg, model, adapter_name=ADAPTER)
    out = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            p.requires_grad_(False)
            out[PEFT_PREFIX + name.replace(f".{ADAPTER}.weight", ".weight")] = p
    return out
