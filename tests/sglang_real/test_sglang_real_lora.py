"""The adapter sync (``weights/lora_sync.py``) against SGLang's own LoRA code, once per sglang wheel
(``tools/dev`` puts 0.5.15.post1 and 0.5.23 on the path in turn; without one every test skips):

- request bodies: SGLang's ``LoadLoRAAdapterFromTensorsReqInput`` / ``LoadLoRAAdapterReqInput`` /
  ``UnloadLoRAAdapterReqInput`` / ``GenerateReqInput`` read every body ``lora_sync`` builds, through pydantic
  as FastAPI parses an HTTP body (0.5.23's per-rank payloads arrive base64, 0.5.15.post1's as one string);
- the LoRA code path that imports on CPU: SGLang's ``MultiprocessingSerializer`` + ``FlattenedTensorBucket``
  decode the payload as ``TpModelWorker.load_lora_adapter_from_tensors`` does, SGLang's
  ``LoRAConfig.from_dict`` reads the config and ``LoRAAdapter.initialize_weights_from_tensors`` stacks the
  adapters into its ``qkv_proj`` / ``gate_up_proj`` layout; the deltas ``adapter.scaling * B @ A`` that
  SGLang's kernels apply per output slice equal the trainer's ``(alpha/r) B A`` per projection, bit for
  bit (fp32). The GPU kernels and the memory pool do not run here;
- server flags: SGLang's parser and ``ServerArgs`` accept ``lora_server_args`` (as ``server_argv`` flags too),
  and the server launcher's argv for a ``lora.sync: adapter`` recipe parses to the LoRA fields;
- the engine's adapter syncs end to end (``tests/helpers/sglang_lora.run_versions``) into the stand-in
  server, whose body checks are this wheel's own request classes (load from tensors, unload,
  update_weight_version, ``GenerateReqInput`` with ``lora_path``) and payload decode SGLang's: none refused.

Planted: k/v adapters exchanged in the payload fail the delta check."""

from __future__ import annotations

import argparse
import inspect
import json

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_export import peft_adapter_config
from srpo_megatron.conversion.lora_table import LoraTable
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.sglang import protocol
from srpo_megatron.testing import sglang_import
from srpo_megatron.testing.tiny import tiny_hf_config
from srpo_megatron.weights import lora_sync

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )

TP = 2
LORA = LoraConfig(rank=4, alpha=8.0)


def _parse(cls_name: str, body: dict):
    """``body`` as SGLang's HTTP server reads it: JSON, then pydantic on the msgspec request class."""
    from pydantic import TypeAdapter

    return TypeAdapter(getattr(REAL.io_struct, cls_name)).validate_python(json.loads(json.dumps(body)))


def _adapters(config, seed: int = 0):
    table = LoraTable(Architecture.from_hf(config), LORA)
    g = torch.Generator().manual_seed(seed)
    return table, {n: torch.randn(table.row(n).shape, generator=g) for n in table.megatron_names()}


def _load_body(table, adapters, version: int = 1):
    peft = [table.to_peft(n, t) for n, t in adapters.items()]
    payloads, flat = protocol.serialize_bucket_per_tp_rank(peft, lora_sync.payloads_needed(REAL.version, TP))
    config = peft_adapter_config(LORA, sorted({table.row(n).target for n in adapters}), None)
    body = lora_sync.build_load_from_tensors_request(
        lora_sync.adapter_name(version), config, payloads, TP, REAL.version
    )
    return body, flat


def _sglang_adapter(body, config):
    """What a scheduler TP rank holds after the load: SGLang's decode, LoRAConfig and LoRAAdapter."""
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    req = _parse("LoadLoRAAdapterFromTensorsReqInput", body)
    per_rank = getattr(req, "serialized_named_tensors", None)
    payload = per_rank[TP - 1] if per_rank is not None else req.serialized_tensors
    assert req.load_format == "flattened_bucket"
    data = REAL.utils.MultiprocessingSerializer.deserialize(payload)
    bucket = REAL.tensor_bucket.FlattenedTensorBucket(
        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
    )
    tensors = dict(bucket.reconstruct_tensors())
    lora_config = LoRAConfig.from_dict(req.config_dict, None, base_vocab_size=config.vocab_size)
    adapter = LoRAAdapter(req.lora_name, lora_config, config, None, None)
    adapter.initialize_weights_from_tensors(tensors)
    return adapter


def _delta(adapters: dict[str, torch.Tensor], layer: int, proj: str) -> torch.Tensor:
    """The trainer's (alpha/r) B A of ``proj`` in ``layer``, from the megatron-named adapters."""
    (a_name,) = [n for n in adapters if f"layers.{layer}." in n and n.endswith(f".{proj}.lora_A")]
    return LORA.scaling * adapters[a_name.removesuffix("lora_A") + "lora_B"] @ adapters[a_name]


def _check_deltas(adapter, adapters, config) -> None:
    """SGLang's stacked factors give, per output slice, the trainer's delta of each projection."""
    a = Architecture.from_hf(config)
    q, kv, f = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    r = LORA.rank
    stacks = {"qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]}
    stacks["gate_up_proj"] = [("gate_proj", f), ("up_proj", f)]
    for i, layer in enumerate(adapter.layers):
        w = layer.weights
        for stacked, parts in stacks.items():
            where = "self_attn" if stacked == "qkv_proj" else "mlp"
            A = w[f"base_model.model.model.layers.{i}.{where}.{stacked}.lora_A.weight"]
            B = w[f"base_model.model.model.layers.{i}.{where}.{stacked}.lora_B.weight"]
            row = 0
            for k, (proj, out) in enumerate(parts):
                got = adapter.scaling * B[row : row + out] @ A[k * r : (k + 1) * r]
                assert torch.equal(got, _delta(adapters, i, proj)), (i, proj)
                row += out
        for proj, where in (("o_proj", "self_attn"), ("down_proj", "mlp")):
            A = w[f"base_model.model.model.layers.{i}.{where}.{proj}.lora_A.weight"]
            B = w[f"base_model.model.model.layers.{i}.{where}.{proj}.lora_B.weight"]
            assert torch.equal(adapter.scaling * B @ A, _delta(adapters, i, proj)), (i, proj)


def test_sglang_real_lora_sync_reaches_sglangs_lora_adapter_exactly():
    config = tiny_hf_config("qwen3", num_layers=2)
    table, adapters = _adapters(config)
    body, flat = _load_body(table, adapters)
    _check_deltas(_sglang_adapter(body, config), adapters, config)
    del flat


def test_sglang_real_lora_planted_kv_swap_fails():
    config = tiny_hf_config("qwen3", num_layers=2)
    table, adapters = _adapters(config)
    swapped = {  # planted: k's adapter sent under v's name and v's under k's (same shapes)
        n.replace("k_proj", "TMP").replace("v_proj", "k_proj").replace("TMP", "v_proj"): t
        for n, t in adapters.items()
    }
    body, flat = _load_body(table, swapped)
    with pytest.raises(AssertionError):
        _check_deltas(_sglang_adapter(body, config), adapters, config)
    del flat


def test_sglang_real_lora_request_classes_read_every_body(tmp_path):
    config = tiny_hf_config("qwen3", num_layers=1)
    table, adapters = _adapters(config)
    load, flat = _load_body(table, adapters, version=3)
    req = _parse("LoadLoRAAdapterFromTensorsReqInput", load)
    assert (req.lora_name, req.config_dict["r"], req.config_dict["lora_alpha"]) == ("srpo-policy-v3", 4, 8.0)
    assert lora_sync.per_rank_payloads(REAL.version) == hasattr(req, "serialized_named_tensors")
    if hasattr(req, "serialized_named_tensors"):
        assert len(req.serialized_named_tensors) == TP
    steps = lora_sync.sync_requests(load, ["srpo-policy-v2"])
    assert [route for route, _ in steps] == ["/load_lora_adapter_from_tensors", "/unload_lora_adapter"]
    assert _parse("UnloadLoRAAdapterReqInput", steps[1][1]).lora_name == "srpo-policy-v2"
    disk = lora_sync.build_load_from_disk_request("srpo-policy-v3", str(tmp_path))
    assert _parse("LoadLoRAAdapterReqInput", disk).lora_path == str(tmp_path)
    params = SamplingParams(n=2, max_new_tokens=3, stop_token_ids=(7,), seed=1)
    generate = lora_sync.with_adapter(protocol.build_generate_request([[1, 2], [3]], params)[0], 3)
    assert _parse("GenerateReqInput", generate).lora_path == "srpo-policy-v3"
    del flat


def test_sglang_real_lora_server_flags_parse_and_construct():
    from srpo_megatron.rollout.sglang.servers import server_argv

    kw = lora_sync.lora_server_args(LORA, ["q_proj", "k_proj", "v_proj", "o_proj"])
    parser = argparse.ArgumentParser()
    REAL.server_args.ServerArgs.add_cli_args(parser)
    argv = server_argv(SGLangEngineConfig(model_path="/m", engine_kwargs=kw), 0)
    ns = parser.parse_args(argv[3:])
    for key, value in kw.items():
        assert getattr(ns, key) == value, key
    cls = REAL.server_args.ServerArgs
    try:  # 0.5.23 runs its LoRA checks here; 0.5.15.post1 stops at "no accelerator" after __init__
        args = cls(model_path="/m", **kw)
    except (RuntimeError, NotImplementedError) as e:
        assert set(kw) <= set(inspect.signature(cls).parameters), e
        return
    assert args.enable_lora and args.max_lora_rank == 4
    assert set(args.lora_target_modules) == set(kw["lora_target_modules"])


def test_sglang_real_lora_launcher_argv_parses_to_the_lora_fields():
    from srpo_megatron.config.lora import LORA_TARGETS
    from srpo_megatron.rollout.sglang.servers import recipe_rollout_config, server_commands

    http = ["lora.rank=16", "rollout.sglang.mode=http", "rollout.sglang.url=http://h:30000"]
    rollout = recipe_rollout_config("examples/qwen3_8b_srpo.yaml", http)
    argv = server_commands(rollout, gpus=8)[0]
    parser = argparse.ArgumentParser()
    REAL.server_args.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[3:])
    assert (
        ns.enable_lora and ns.max_lora_rank == 16 and sorted(ns.lora_target_modules) == sorted(LORA_TARGETS)
    )
    assert (ns.max_loras_per_batch, ns.max_loaded_loras, ns.tp_size) == (1, 2, 4)
    try:  # 0.5.23 runs its LoRA checks here; 0.5.15.post1 stops at "no accelerator" after __init__
        args = REAL.server_args.ServerArgs.from_cli_args(ns)
    except (RuntimeError, NotImplementedError):
        return
    assert (
        args.enable_lora and args.max_lora_rank == 16 and set(args.lora_target_modules) == set(LORA_TARGETS)
    )


def test_sglang_real_lora_engine_syncs_pass_the_request_classes():
    import copy

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer, request_class
    from srpo_megatron.testing.tiny import tiny_hf_model
    from tests.helpers.sglang_lora import run_versions

    routes = (
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
        "/update_weight_version",
        "/generate",
    )
    assert all(request_class(r) is not None for r in routes), (
        "the stand-in checks bodies with the real classes"
    )
    base = tiny_hf_model("qwen3", num_layers=2)
    server = SGLangStandInServer(copy.deepcopy(base), tp_size=TP)
    try:
        gaps = run_versions(server, base)
    finally:
        server.close()
    assert server.rejected == [] and max(gaps) < 1e-5
    load = next(b for r, b in server.bodies if r == routes[0])
    assert ("serialized_named_tensors" in load) == lora_sync.per_rank_payloads(REAL.version)


def test_sglang_real_lora_planted_other_release_body_is_refused(monkeypatch):
    """Planted: the engine takes the server for the other release, so its load body has the other payload
    field; this wheel's request class refuses it (HTTP 400) and the sync fails."""
    import copy

    from srpo_megatron.rollout.base import EngineError
    from srpo_megatron.rollout.sglang import engine as engine_module
    from srpo_megatron.testing.sglang_standin import SGLangStandInServer
    from srpo_megatron.testing.tiny import tiny_hf_model
    from tests.helpers.sglang_lora import run_versions

    other = "0.5.15.post1" if lora_sync.per_rank_payloads(REAL.version) else "0.5.23"
    monkeypatch.setattr(engine_module, "server_version", lambda transport: other)
    base = tiny_hf_model("qwen3", num_layers=2)
    server = SGLangStandInServer(copy.deepcopy(base), tp_size=TP)
    try:
        with pytest.raises(EngineError, match="LoadLoRAAdapterFromTensorsReqInput rejects the body"):
            run_versions(server, base, versions=(1,))
    finally:
        server.close()
    assert [r for r, _ in server.rejected] == ["/load_lora_adapter_from_tensors"]
