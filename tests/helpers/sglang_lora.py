"""The adapter-sync flow of ``SGLangEngine.update_lora`` against the SGLang stand-in server, shared by
tests/unit/test_sglang_lora_standin.py (module docstring there) and the sglang_real tier, which runs it with
each wheel's request classes reading every body."""

from __future__ import annotations

import copy

import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_export import peft_adapter_config
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.hf_lora import inject_lora
from srpo_megatron.rollout.sglang import lora_requests
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.rollout.sglang.lora_requests import LOAD_FROM_TENSORS
from srpo_megatron.testing.sglang_standin import SGLangStandInServer

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
CONFIG = peft_adapter_config(LORA, LORA.target_modules, None)
PROMPTS = [[11, 12, 13], [21, 22]]
PARAMS = SamplingParams(n=2, max_new_tokens=4, seed=5)


def _adapters(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.3 * torch.randn(s, generator=g) for n, s in shapes.items()}  # B != 0: the adapter bites


def _reference(base: torch.nn.Module, adapters: dict[str, torch.Tensor] | None):
    """float64 copy of ``base`` with ``adapters`` through peft (None: the base alone)."""
    ref = copy.deepcopy(base).double()
    if adapters is not None:
        params = inject_lora(ref, CONFIG)
        with torch.no_grad():
            for n, t in adapters.items():
                params[n].copy_(t.double())
    return ref


def _gap(ref: torch.nn.Module, prompts, completions) -> float:
    """max |engine log p - reference log p| over every sampled token (temperature 1)."""
    gap = 0.0
    for prompt, group in zip(prompts, completions, strict=True):
        for c in group:
            ids = torch.tensor([list(prompt) + list(c.token_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(ref(ids).logits[0].double(), -1)
            want = logp[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None])[:, 0]
            gap = max(gap, (torch.tensor(c.logprobs, dtype=torch.float64) - want).abs().max().item())
    return gap


def run_versions(server: SGLangStandInServer, base: torch.nn.Module, versions=(1, 2, 3)) -> list[float]:
    """Sync ``versions`` one after another into ``server`` and check each (module docstring); returns the
    engine-vs-reference gap of each version."""
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path="unused")
    engine = SGLangEngine(cfg, manifest={})
    shapes = {n: p.shape for n, p in inject_lora(copy.deepcopy(base), CONFIG).items()}
    gaps, names = [], []
    for v in versions:
        adapters = _adapters(shapes, seed=v)
        n_calls = len(server.bodies)
        engine.update_lora(adapters.items(), v, CONFIG)
        sync = [route for route, _ in server.bodies[n_calls:]]
        name = lora_requests.adapter_name(v)
        assert name not in names, f"v{v} reuses the adapter name {name}: no adapter while it reloads"
        names.append(name)
        assert set(server.loras) == {name}, f"after the v{v} sync the server holds {sorted(server.loras)}"
        assert sync.index(LOAD_FROM_TENSORS) < sync.index("/update_weight_version")
        assert server.version == str(v)
        n_calls = len(server.bodies)
        completions = engine.generate(PROMPTS, PARAMS)
        gaps.append(_gap(_reference(base, adapters), PROMPTS, completions))
        assert gaps[-1] < 1e-5, (v, gaps[-1])
        generates = [b for route, b in server.bodies[n_calls:] if route == "/generate"]
        assert len(generates) == 4 and all(b.get("lora_path") == name for b in generates), generates
        assert all(c.weight_version == v for group in completions for c in group)
    return gaps
