"""``SGLangEngine.update_lora`` (``lora.sync: adapter``) against the named SGLang stand-in server
(``testing/sglang_standin.py``: SGLang's request classes and payload decode where the wheel imports,
``peft`` on its HF model), over HTTP, three adapter versions:

- each sync loads ``srpo-policy-v<v>`` (``/load_lora_adapter_from_tensors``), then unloads the previous one
  (the server holds exactly the current adapter after the sync), then stamps ``v``
  (``/update_weight_version``); every ``/generate`` names the current adapter in ``lora_path``;
- the log-probs the engine returns equal a float64 reference (a copy of the HF base in float64, wrapped by
  ``peft.inject_adapter_in_model`` with the same adapter) within fp32 rounding, 1e-5;
- the stand-in refuses a ``/generate`` naming an adapter it has not loaded, as SGLang's registry does.

Planted (each must fail the checks): generate without ``lora_path`` (the server serves the base model),
a sync that loads the new adapter without unloading the old, and one that reuses the adapter name.
``tests/sglang_real/test_sglang_real_lora.py`` runs the same flow with each sglang wheel's request classes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_export import peft_adapter_config
from srpo_megatron.rollout.base import EngineError, SamplingParams
from srpo_megatron.rollout.hf_lora import inject_lora
from srpo_megatron.rollout.sglang import engine as engine_module
from srpo_megatron.rollout.sglang import lora_requests
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.rollout.sglang.lora_requests import LOAD_FROM_TENSORS
from srpo_megatron.rollout.sglang.transports import HttpTransport
from srpo_megatron.testing.sglang_standin import SGLangStandInServer
from srpo_megatron.testing.tiny import tiny_hf_model

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


@pytest.fixture
def standin():
    base = tiny_hf_model("qwen3", num_layers=2)
    server = SGLangStandInServer(copy.deepcopy(base))
    yield server, base
    server.close()


def run_versions(server: SGLangStandInServer, base: torch.nn.Module, versions=(1, 2, 3)) -> list[float]:
    """Sync ``versions`` one after another into ``server`` and check each (module docstring); returns the
    engine-vs-reference gap of each version."""
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path="unused")
    engine = SGLangEngine(cfg, manifest={})
    shapes = {n: p.shape for n, p in inject_lora(copy.deepcopy(base), CONFIG).items()}
    gaps = []
    for v in versions:
        adapters = _adapters(shapes, seed=v)
        n_calls = len(server.bodies)
        engine.update_lora(adapters.items(), v, CONFIG)
        sync = [route for route, _ in server.bodies[n_calls:]]
        name = lora_requests.adapter_name(v)
        assert set(server.loras) == {name}, f"after the v{v} sync the server holds {sorted(server.loras)}"
        assert sync.index(LOAD_FROM_TENSORS) < sync.index("/update_weight_version") and server.version == str(
            v
        )
        n_calls = len(server.bodies)
        completions = engine.generate(PROMPTS, PARAMS)
        gaps.append(_gap(_reference(base, adapters), PROMPTS, completions))
        assert gaps[-1] < 1e-5, (v, gaps[-1])
        generates = [b for route, b in server.bodies[n_calls:] if route == "/generate"]
        assert len(generates) == 4 and all(b.get("lora_path") == name for b in generates), generates
        assert all(c.weight_version == v for group in completions for c in group)
    return gaps


def test_adapter_versions_serve_the_reference_logprobs(standin):
    server, base = standin
    gaps = run_versions(server, base)
    assert server.rejected == []
    routes = [route for route, _ in server.bodies if "lora" in route]
    assert routes == [LOAD_FROM_TENSORS] + [LOAD_FROM_TENSORS, "/unload_lora_adapter"] * 2
    unloaded = [b["lora_name"] for route, b in server.bodies if route == "/unload_lora_adapter"]
    assert unloaded == ["srpo-policy-v1", "srpo-policy-v2"]
    print(f"engine vs float64 reference, max |d log p| per version: {gaps}")


def test_standin_refuses_a_generate_naming_an_adapter_it_has_not_loaded(standin):
    server, _ = standin
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 2, "stop_token_ids": []}
    body = {"input_ids": [[1, 2]], "sampling_params": [sampling], "lora_path": "srpo-policy-v9"}
    with pytest.raises(EngineError, match=r"HTTP 400.*not loaded"):
        HttpTransport(server.url, 60).call("generate", body)


def test_planted_generate_without_lora_path_fails(standin, monkeypatch):
    server, base = standin
    monkeypatch.setattr(SGLangEngine, "_with_adapter", lambda self, body: body)  # the base model serves
    with pytest.raises(AssertionError, match=r"\(1, "):  # the log-prob check fails first
        run_versions(server, base)


def test_planted_load_without_unload_fails(standin, monkeypatch):
    server, base = standin
    monkeypatch.setattr(engine_module, "sync_requests", lambda load, previous: [(LOAD_FROM_TENSORS, load)])
    with pytest.raises(AssertionError, match="after the v2 sync the server holds"):
        run_versions(server, base)


def test_planted_reused_adapter_name_fails(standin, monkeypatch):
    server, base = standin
    for module in (engine_module, lora_requests):
        monkeypatch.setattr(module, "adapter_name", lambda version: "srpo-policy")
    with pytest.raises(EngineError, match="already loaded"):
        run_versions(server, base)
