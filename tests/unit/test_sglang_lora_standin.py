"""``SGLangEngine.update_lora`` (``lora.sync: adapter``) against the named SGLang stand-in server
(``testing/sglang_standin.py``: SGLang's request classes and payload decode where the wheel imports,
``peft`` on its HF model), over HTTP, three adapter versions:

- each sync loads ``srpo-policy-v<v>`` (``/load_lora_adapter_from_tensors``), then unloads the previous one
  (the server holds exactly the current adapter after the sync), then stamps ``v``
  (``/update_weight_version``); every ``/generate`` names the current adapter in ``lora_path``;
- the log-probs the engine returns equal a float64 reference (a copy of the HF base in float64, wrapped by
  ``peft.inject_adapter_in_model`` with the same adapter) within fp32 rounding, 1e-5;
- an engine rebuilt after a failed sync (it loaded nothing itself) resyncs a version the living server
  holds: it reads the server's adapters (``GET /v1/models``), reloads that one, unloads the rest;
- the stand-in refuses a ``/generate`` naming an adapter it has not loaded, as SGLang's registry does.

Planted (each must fail the checks): generate without ``lora_path`` (the server serves the base model),
a sync that loads the new adapter without unloading the old, one that reuses the adapter name, and a
rebuilt engine that ignores the server's adapters (SGLang: "already loaded").
``tests/sglang_real/test_sglang_real_lora.py`` runs the same flow with each sglang wheel's request classes.
"""

from __future__ import annotations

import copy

import pytest

from srpo_megatron.rollout.base import EngineError
from srpo_megatron.rollout.sglang import engine as engine_module
from srpo_megatron.rollout.sglang import lora_requests
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.rollout.sglang.lora_requests import LOAD_FROM_TENSORS
from srpo_megatron.rollout.sglang.transports import HttpTransport
from srpo_megatron.testing.sglang_standin import SGLangStandInServer
from srpo_megatron.testing.tiny import tiny_hf_model
from tests.helpers.sglang_lora import run_versions


@pytest.fixture
def standin():
    base = tiny_hf_model("qwen3", num_layers=2)
    server = SGLangStandInServer(copy.deepcopy(base))
    yield server, base
    server.close()


def test_adapter_versions_serve_the_reference_logprobs(standin):
    server, base = standin
    gaps = run_versions(server, base)
    assert server.rejected == []
    routes = [route for route, _ in server.bodies if "lora" in route]
    assert routes == [LOAD_FROM_TENSORS] + [LOAD_FROM_TENSORS, "/unload_lora_adapter"] * 2
    unloaded = [b["lora_name"] for route, b in server.bodies if route == "/unload_lora_adapter"]
    assert unloaded == ["srpo-policy-v1", "srpo-policy-v2"]
    print(f"engine vs float64 reference, max |d log p| per version: {gaps}")


def test_a_rebuilt_engine_resyncs_a_version_the_server_holds(standin):
    """After a failed sync the service rebuilds the engine object and resyncs the same version into the
    same (living) server: the new engine finds the policy adapters the server lists (``GET /v1/models``),
    reloads that version's under its name and unloads the rest."""
    server, base = standin
    run_versions(server, base, versions=(1, 2))
    run_versions(server, base, versions=(2, 3))  # a new SGLangEngine: it loaded nothing itself
    assert set(server.loras) == {"srpo-policy-v3"}


def test_planted_rebuilt_engine_that_ignores_the_servers_adapters_fails(standin, monkeypatch):
    server, base = standin
    run_versions(server, base, versions=(1,))
    monkeypatch.setattr(engine_module, "policy_adapters", lambda models: [])
    with pytest.raises(EngineError, match="already loaded"):
        run_versions(server, base, versions=(1,))


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
    monkeypatch.setattr(SGLangEngine, "_loaded_adapters", lambda self: [])  # no unload
    with pytest.raises(AssertionError, match="after the v2 sync the server holds"):
        run_versions(server, base)


def test_planted_reused_adapter_name_fails(standin, monkeypatch):
    server, base = standin
    for module in (engine_module, lora_requests):
        monkeypatch.setattr(module, "adapter_name", lambda version: "srpo-policy")
    with pytest.raises(AssertionError, match="v2 reuses the adapter name"):
        run_versions(server, base)
