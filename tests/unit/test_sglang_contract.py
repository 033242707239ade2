"""SGLang engine on CPU: request building and response parsing checked against SGLang's documented shapes,
and the HTTP transport + disk weight sync run end to end against a *stand-in* server.

SGLang's engine cannot run here (PLATFORM.md). ``SGLangStandInServer`` (srpo_megatron/testing/
sglang_standin.py, re-exported here) is a tiny local HTTP server that speaks the subset of SGLang's HTTP
API the engine uses, on SGLang's own modules where they import (payload decoding, memory tags, request
classes: the sglang tier of ``tools/dev test`` runs this file with an sglang wheel on the path) and on
named fallbacks otherwise. Real-engine checks live in tests/gpu/test_sglang_engine.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from srpo_megatron.buckets import bucketize
from srpo_megatron.config import ConfigError, SGLangEngineConfig
from srpo_megatron.rollout.base import EngineError, SamplingParams, sample_seed
from srpo_megatron.rollout.sglang.engine import SGLangEngine, offline_engine_kwargs
from srpo_megatron.rollout.sglang.protocol import (
    build_generate_request,
    build_init_weights_update_group_request,
    build_memory_occupation_request,
    build_requests_body,
    build_sampling_params,
    build_update_weights_from_disk_request,
    build_update_weights_from_distributed_request,
    build_update_weights_from_tensor_request,
    parse_generate_response,
    parse_update_response,
    serialize_bucket_per_tp_rank,
)
from srpo_megatron.rollout.sglang.transports import _offline_update_from_tensor
from srpo_megatron.testing import sglang_import
from srpo_megatron.testing.sglang_standin import (
    SGLangStandInServer,
    standin_deserialize,
    standin_serialize,
)
from srpo_megatron.testing.sglang_standin import sglang_output as _sglang_output
from srpo_megatron.testing.sync_transports import DiskRouted
from tests.helpers.rollout_contract import (
    EOS,
    RolloutEngineContract,
    initial_weights,
    perturbed_copy,
    tiny_model,
)

# ------------------------------------------------------------------ pure request/response contract tests


def test_sglang_contract_sampling_params_fields():
    p = SamplingParams(
        n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33, stop_token_ids=(5, 9), seed=3
    )
    sp = build_sampling_params(p, prompt_index=2, sample_index=1)
    assert sp == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 33,
        "stop_token_ids": [5, 9],
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "sampling_seed": sample_seed(3, 2, 1),
    }
    assert "sampling_seed" not in build_sampling_params(SamplingParams(), 0, 0)
    assert json.loads(json.dumps(sp)) == sp  # JSON-serialisable as sent over HTTP


def test_sglang_contract_generate_request_expands_samples():
    body, rows = build_generate_request([[1, 2], [3]], SamplingParams(n=2, seed=0))
    assert rows == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert body["input_ids"] == [[1, 2], [1, 2], [3], [3]]
    assert body["return_logprob"] is True
    seeds = [sp["sampling_seed"] for sp in body["sampling_params"]]
    assert len(set(seeds)) == 4, "each sample needs its own seed or n samples would be identical"
    assert set(body) == {"input_ids", "sampling_params", "return_logprob"}


def test_sglang_contract_parse_generate_response():
    outs = [
        _sglang_output([7, 8, 2], [-0.5, -1.0, -0.1], {"type": "stop", "matched": 2}, "4"),
        _sglang_output([9, 9], [-2.0, -3.0], {"type": "length", "length": 2}, "4"),
        _sglang_output([], [], {"type": "abort", "message": "aborted by weight update"}),
    ]
    res = parse_generate_response(outs, [(0, 0), (0, 1), (1, 0)], 2, weight_version=4)
    assert [len(g) for g in res] == [2, 1]
    assert res[0][0].token_ids == [7, 8, 2] and res[0][0].logprobs == [-0.5, -1.0, -0.1]
    assert res[0][0].finish_reason == "stop" and res[0][1].finish_reason == "length"
    assert res[1][0].finish_reason == "abort" and res[1][0].prompt_index == 1
    assert res[0][1].meta["sample_index"] == 1 and res[0][0].weight_version == 4


def test_sglang_contract_top_logprobs_num_is_a_generate_request_field():
    """The parity diagnostic's request field (rollout.parity_top_k) is SGLang's own: its GenerateReqInput
    builds from the body and keeps K (sglang tier; plain venv: skipped)."""
    real = sglang_import.load()
    if real is None or real.io_struct is None:
        pytest.skip("SGLang's io_struct does not import here (the sglang tier runs this)")
    body, _ = build_generate_request([[1, 2]], SamplingParams(n=2, top_logprobs=4))
    assert real.io_struct.GenerateReqInput(**body).top_logprobs_num == 4
    body = build_requests_body([[1], [2]], [SamplingParams(top_logprobs=4)] * 2)
    assert real.io_struct.GenerateReqInput(**body).top_logprobs_num == 4


@pytest.mark.parametrize(
    "outputs,match",
    [
        ([{"text": "x"}], "output_token_logprobs"),
        ([], "0 outputs for 1 requests"),
        ([_sglang_output([1], [float("nan")], {"type": "stop"})], "NaN"),
        ([_sglang_output([1], [-1.0], {"type": "stop"}, "3")], "weight version 3"),
        ([_sglang_output([1], [-1.0], None)], "finish_reason"),
    ],
)
def test_sglang_contract_parse_generate_response_rejects_malformed(outputs, match):
    with pytest.raises(EngineError, match=match):
        parse_generate_response(outputs, [(0, 0)], 1, weight_version=4)


def test_sglang_contract_weight_sync_requests():
    t = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b.bias", torch.zeros(4))]
    assert build_update_weights_from_distributed_request(t, "g", False, 7) == {
        "names": ["a.weight", "b.bias"],
        "dtypes": ["bfloat16", "float32"],  # SGLang resolves getattr(torch, dtype)
        "shapes": [[2, 3], [4]],
        "group_name": "g",
        "flush_cache": False,
        "weight_version": "7",  # io_struct: weight_version: Optional[str]
    }
    assert build_init_weights_update_group_request("10.0.0.1", 29600, 1, 3, "g", "nccl") == {
        "master_address": "10.0.0.1",
        "master_port": 29600,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "g",
        "backend": "nccl",
    }
    assert build_update_weights_from_tensor_request(["s0", "s1"], 2, True, 3) == {
        "serialized_named_tensors": ["s0", "s1"],  # entry i is read by scheduler TP rank i
        "load_format": "flattened_bucket",
        "flush_cache": True,
        "weight_version": "3",
    }
    with pytest.raises(EngineError, match="one payload per engine TP rank"):
        build_update_weights_from_tensor_request(["s0"], 2, True, 3)  # SGLang: IndexError on rank 1
    assert build_update_weights_from_disk_request("/ckpt/v3", 3) == {
        "model_path": "/ckpt/v3",
        "load_format": None,
        "weight_version": "3",
    }
    assert build_memory_occupation_request(["kv_cache"]) == {"tags": ["kv_cache"]}  # tags always named


def test_sglang_contract_update_responses():
    parse_update_response({"success": True, "message": "ok"}, "x")  # HTTP form
    parse_update_response((True, "Succeeded", 0), "x")  # offline Engine form
    with pytest.raises(EngineError, match="shape mismatch"):
        parse_update_response({"success": False, "message": "shape mismatch"}, "x")
    with pytest.raises(EngineError, match="failed: boom"):
        parse_update_response((False, "boom"), "x")
    with pytest.raises(EngineError, match="unexpected response"):
        parse_update_response(42, "x")


def test_sglang_contract_bucketize_bounds_bytes():
    ts = [(f"t{k}", torch.zeros(n, dtype=torch.float32)) for k, n in enumerate([10, 10, 30, 5, 1])]
    buckets = [[n for n, _ in b] for b in bucketize(ts, bucket_bytes=80)]
    # 40+40 fit; 120 B goes alone (larger than a bucket); 20+4 share the last
    assert buckets == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_sglang_contract_config_errors():
    with pytest.raises(ConfigError, match="url"):
        SGLangEngineConfig(mode="http")
    with pytest.raises(ConfigError, match="disk_sync_dir"):
        SGLangEngineConfig(mode="http", url="http://x", weight_sync="disk")


# ------------------------------------------------------------- HTTP transport against a stand-in server

__all__ = ["SGLangStandInServer", "standin_deserialize", "standin_serialize"]


@pytest.fixture(scope="module")
def weight_sets():
    w0 = initial_weights("llama")
    return w0, perturbed_copy(w0, seed=1, scale=0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(d)
    return d


@pytest.fixture
def engine_factory(weight_sets, model_dir, tmp_path):
    servers = []
    manifest = {n: tuple(t.shape) for n, t in weight_sets[0].items()}

    def make():
        server = SGLangStandInServer(tiny_model("llama", weight_sets[0]))
        servers.append(server)
        cfg = SGLangEngineConfig(
            mode="http",
            url=server.url,
            model_path=str(model_dir),
            weight_sync="disk",
            disk_sync_dir=str(tmp_path / f"sync{len(servers)}"),
            bucket_bytes=1024**2,
        )
        # the disk strategy's route (weights.disk_sync): gate, folder, update_weights_from_disk
        return DiskRouted(SGLangEngine(cfg, manifest=manifest), cfg.disk_sync_dir, manifest)

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def engine(engine_factory):
    return engine_factory()


@pytest.fixture
def eos_token_ids():
    return (EOS,)


@pytest.fixture
def logprob_atol():
    return 2e-5


@pytest.fixture(scope="module")
def reference_logprobs():
    models: dict[int, torch.nn.Module] = {}  # one float64 copy per weight set (the top-K check scores often)

    def score(prompt, tokens, temperature, weights):
        model = models.get(id(weights))
        if model is None:
            model = models[id(weights)] = tiny_model("llama", weights, dtype=torch.float64)
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    return score


class TestSGLangEngineOverHttpAgainstStandInServer(RolloutEngineContract):
    """The SGLang engine's HTTP transport and disk sync pass the rollout contract against the stand-in."""


def test_sglang_contract_dead_server_is_a_clear_error(engine_factory):
    eng = engine_factory()
    eng._transport.url = "http://127.0.0.1:9"  # nothing listens on the discard port
    eng._transport.timeout_s = 2.0
    with pytest.raises(EngineError, match="crashed or timed out"):
        eng.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert not eng.health().ok


def test_sglang_contract_release_marks_weights_stale_until_resync(engine, weight_sets):
    engine.release_memory()
    engine.resume_memory()
    with pytest.raises(EngineError, match="released"):
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    engine.update_weights(weight_sets[0].items(), version=engine.weight_version + 1)
    out = engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert math.isfinite(out[0][0].logprobs[0])


# ------------------------------------------------ tensor sync, release/resume order, weight_version


@pytest.fixture
def tensor_engine_factory(weight_sets, model_dir):
    servers = []
    manifest = {n: tuple(t.shape) for n, t in weight_sets[0].items()}

    def make(tp_size=2):
        server = SGLangStandInServer(tiny_model("llama", weight_sets[0]), tp_size=tp_size)
        servers.append(server)
        cfg = SGLangEngineConfig(
            mode="http", url=server.url, model_path=str(model_dir), weight_sync="tensor", bucket_bytes=1024**2
        )
        return SGLangEngine(cfg, manifest=manifest, serializer=standin_serialize), server

    yield make
    for s in servers:
        s.close()


def test_sglang_contract_tensor_sync_sends_one_flattened_bucket_per_server_tp_rank(
    tensor_engine_factory, weight_sets
):
    engine, server = tensor_engine_factory(tp_size=2)
    engine.update_weights(weight_sets[1].items(), version=1)
    updates = [b for p, b in server.bodies if p == "/update_weights_from_tensor"]
    assert updates and all(len(b["serialized_named_tensors"]) == 2 for b in updates)  # TP of the server
    assert all(b["load_format"] == "flattened_bucket" and b["weight_version"] == "1" for b in updates)
    received = {n: t for ranks in server.tensor_updates for n, t in ranks[1]}  # what rank 1 decoded
    assert set(received) == set(weight_sets[1]), "rank 1's payload must hold the whole bucket too"
    assert all(torch.equal(received[n], weight_sets[1][n]) for n in received)
    # generate checks the version SGLang stamps on each output
    out = engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, seed=0))
    assert out[0][0].weight_version == 1 and server.version == "1"


def test_sglang_contract_tensor_sync_into_an_fp8_folder_engine(weight_sets, model_dir, tmp_path):
    """Colocated tensor path, engine serving a blockwise FP8 folder: its manifest (built from the folder)
    holds every FP8 weight's weight_scale_inv; the FP8 stream travels in SGLang's flattened buckets and the
    stand-in FP8 engine holds the block dequantization. Planted: today's bf16 stream into it is refused
    for the missing scales, before anything is sent."""
    import shutil

    from srpo_megatron.conversion.fp8_layout import Fp8Layout
    from srpo_megatron.ops.fp8_blocks import fake_quantize
    from srpo_megatron.weights.fp8_sync import quantize_named

    folder = tmp_path / "fp8"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    server = SGLangStandInServer(tiny_model("llama", weight_sets[0]), tp_size=1)
    try:
        cfg = SGLangEngineConfig(mode="http", url=server.url, model_path=str(folder), weight_sync="tensor")
        engine = SGLangEngine(cfg, serializer=standin_serialize, tied_aliases=())
        with pytest.raises(EngineError, match=r"mis-typed tensor .*float8_e4m3fn"):
            engine.update_weights(weight_sets[1].items(), version=1)
        assert not [b for p, b in server.bodies if p == "/update_weights_from_tensor"]
        engine.update_weights(quantize_named(weight_sets[1].items(), Fp8Layout()), version=2)
        got = dict(server.model.named_parameters())
        fp8 = [n for n in weight_sets[1] if Fp8Layout().is_fp8(n)]
        assert fp8 and all(torch.equal(got[n], fake_quantize(weight_sets[1][n])) for n in fp8)
    finally:
        server.close()


def test_sglang_contract_tp_size_comes_from_the_server_not_the_recipe(tensor_engine_factory, weight_sets):
    engine, server = tensor_engine_factory(tp_size=4)  # recipe says nothing: cfg.tp_size == 1
    engine.update_weights(weight_sets[1].items(), version=1)
    updates = [b for p, b in server.bodies if p == "/update_weights_from_tensor"]
    assert {len(b["serialized_named_tensors"]) for b in updates} == {4}


def test_sglang_contract_stale_served_version_is_refused(tensor_engine_factory, weight_sets):
    engine, server = tensor_engine_factory()
    engine.update_weights(weight_sets[1].items(), version=1)
    server.version = "0"  # e.g. a restarted server that nobody resynced
    with pytest.raises(EngineError, match="weight version 0, expected 1"):
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))


def test_sglang_contract_release_comes_before_resume(tensor_engine_factory, weight_sets):
    """The colocated cycle on SGLang's memory tags (the stand-in pauses every type of GPU_MEMORY_ALL_TYPES
    on a null release, refuses a double pause, an unknown resume and a generate while anything is
    paused): weights are resumed before the first bucket, every released tag before the next generate."""
    engine, server = tensor_engine_factory()
    engine.update_weights(weight_sets[1].items(), version=1)  # first sync: nothing released, no resume
    assert "/resume_memory_occupation" not in server.calls and not server.dead
    engine.release_memory()
    assert server.paused == set(server.memory_types)
    engine.update_weights(weight_sets[0].items(), version=2)
    paused = set()
    for path, body in server.bodies[server.calls.index("/release_memory_occupation") :]:
        tags = set(body.get("tags") or server.memory_types) if path.endswith("memory_occupation") else set()
        paused = paused | tags if path == "/release_memory_occupation" else paused - tags
        if path == "/update_weights_from_tensor":
            assert "weights" not in paused, "a bucket arrived while the weights were released"
    assert not server.dead and not server.paused, f"never resumed: {sorted(server.paused)}"
    assert engine.generate([[5]], SamplingParams(max_new_tokens=1))[0][0].weight_version == 2


def test_sglang_contract_planted_resume_without_release_kills_the_stand_in(tensor_engine_factory):
    """The bug the order guards against: resuming an unreleased tag kills SGLang's process tree."""
    engine, server = tensor_engine_factory()
    engine._released = {"weights", "kv_cache"}  # plant: engine believes it released, the server did not
    with pytest.raises(EngineError):
        engine.resume_memory()
    assert server.dead and not engine.health().ok


def test_sglang_contract_bucket_serialized_once_per_tp_rank_keeps_flat_tensor():
    bucket = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    payload, flat = serialize_bucket_per_tp_rank(bucket, 3, standin_serialize)
    assert len(payload) == 3 and flat.numel() == 6 * 4 + 4 * 2
    for p in payload:
        assert [(n, t.tolist()) for n, t in standin_deserialize(p)] == [(n, t.tolist()) for n, t in bucket]


class _FakeOfflineEngine:
    """The offline ``sglang.Engine`` method signatures this project calls (recorded, not executed)."""

    def __init__(self, with_version: bool) -> None:
        self.calls: list[tuple[str, dict]] = []
        if with_version:
            self.update_weights_from_tensor = self._with_version

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(
            ("update_weights_from_tensor", dict(named_tensors=named_tensors, load_format=load_format))
        )
        return True, "ok"

    def _with_version(self, named_tensors, load_format=None, flush_cache=True, weight_version=None):
        self.calls.append(
            ("update_weights_from_tensor", dict(load_format=load_format, weight_version=weight_version))
        )
        return True, "ok"

    def update_weight_version(self, new_version):
        self.calls.append(("update_weight_version", dict(new_version=new_version)))


@pytest.mark.parametrize("with_version", [True, False])
def test_sglang_contract_offline_update_passes_serialized_payloads_and_version(with_version):
    eng = _FakeOfflineEngine(with_version)
    body = build_update_weights_from_tensor_request(["p0", "p1"], 2, False, 5)
    parse_update_response(_offline_update_from_tensor(eng, body), "update")
    _, kwargs = eng.calls[0]
    assert kwargs["load_format"] == "flattened_bucket"
    if with_version:
        assert kwargs["weight_version"] == "5" and len(eng.calls) == 1
    else:  # the payload list goes through untouched (strings, never tensors), version stamped after
        assert kwargs["named_tensors"] == ["p0", "p1"]
        assert eng.calls[1] == ("update_weight_version", {"new_version": "5"})


def test_sglang_gpu_defaults():
    cfg = SGLangEngineConfig(model_path="/m", engine_kwargs={"tp_size": 4})
    colocated = offline_engine_kwargs(cfg, colocated=True, base_gpu_id=4)
    assert colocated["enable_memory_saver"] is True and colocated["base_gpu_id"] == 4
    assert "enable_deterministic_inference" not in colocated  # slow: only on request
    assert "enable_memory_saver" not in offline_engine_kwargs(cfg, colocated=False)
    det = SGLangEngineConfig(model_path="/m", deterministic=True, memory_saver=False)
    kw = offline_engine_kwargs(det, colocated=True)
    assert kw["enable_deterministic_inference"] is True and "enable_memory_saver" not in kw


def test_sglang_contract_distributed_sync_broadcasts_every_bucket_into_every_server(weight_sets):
    """weight_sync=distributed (separate placement): one group with the stage sender as rank 0 and every
    server's TP ranks after it (offsets 1 and 2 for a TP1 and a TP2 server, world 4); per bucket the
    metadata goes to each server, the tensors are broadcast once (gloo here, NCCL on GPU), both servers
    load them and stamp the version. A server that rejects a bucket is named in the error."""
    from srpo_megatron.rollout.sglang.transports import HttpTransport
    from srpo_megatron.weights.broadcast_sync import StageBroadcaster

    servers = [SGLangStandInServer(tiny_model("llama", weight_sets[0]), tp_size=tp) for tp in (1, 2)]
    try:
        urls = [s.url for s in servers]
        transports = [HttpTransport(u, 120) for u in urls]
        sender = StageBroadcaster(
            transports, urls, [1, 2], "srpo-test-pp0-g0", "gloo", "127.0.0.1", timeout_s=60
        )
        items = list(weight_sets[1].items())
        half = len(items) // 2
        sender.send_bucket(items[:half], 5)
        sender.send_bucket(items[half:], 5)
        for s in servers:
            got = dict(s.model.named_parameters())
            assert all(torch.equal(got[n], t) for n, t in items if n in got)
            assert s.version == "5"
        inits = [b for s in servers for path, b in s.bodies if path == "/init_weights_update_group"]
        assert [(b["rank_offset"], b["world_size"], b["backend"]) for b in inits] == [
            (1, 4, "gloo"),
            (2, 4, "gloo"),
        ]
        first = next(b for path, b in servers[1].bodies if path == "/update_weights_from_distributed")
        assert first["names"] == [n for n, _ in items[:half]]
        assert first["group_name"] == "srpo-test-pp0-g0" and first["weight_version"] == "5"
        with pytest.raises(EngineError, match=r"bad tensor model\.bogus"):
            sender.send_bucket([("model.bogus", torch.zeros(2))], 6)
        sender.close()
        assert all(not s.weight_groups for s in servers), "the servers left the group"
    finally:
        for s in servers:
            s.close()


def test_sglang_contract_distributed_sync_carries_fp8_blocks(weight_sets):
    """The broadcast path with an FP8 stream (``weights.fp8_sync``): the metadata names float8_e4m3fn and
    float32 scales, the bytes travel over gloo (no float8 type there: ``wire_tensor`` sends the bytes), and
    the stand-in FP8 engine holds exactly the block dequantization of what the trainer quantized."""
    from srpo_megatron.conversion.fp8_layout import Fp8Layout
    from srpo_megatron.ops.fp8_blocks import fake_quantize
    from srpo_megatron.rollout.sglang.transports import HttpTransport
    from srpo_megatron.weights.broadcast_sync import StageBroadcaster
    from srpo_megatron.weights.fp8_sync import quantize_named

    server = SGLangStandInServer(tiny_model("llama", weight_sets[0]), tp_size=1)
    try:
        transports = [HttpTransport(server.url, 120)]
        sender = StageBroadcaster(
            transports, [server.url], [1], "srpo-fp8-pp0-g0", "gloo", "127.0.0.1", timeout_s=60
        )
        layout = Fp8Layout()
        sent = list(quantize_named(weight_sets[1].items(), layout))
        sender.send_bucket(sent, 7)
        body = next(b for path, b in server.bodies if path == "/update_weights_from_distributed")
        assert "float8_e4m3fn" in body["dtypes"] and any(n.endswith("_scale_inv") for n in body["names"])
        got = dict(server.model.named_parameters())
        fp8 = [n for n in weight_sets[1] if layout.is_fp8(n)]
        assert fp8 and all(torch.equal(got[n], fake_quantize(weight_sets[1][n])) for n in fp8)
        assert all(torch.equal(got[n], t) for n, t in weight_sets[1].items() if n in got and n not in fp8)
        sender.close()
    finally:
        server.close()


# ------------------------------------------------------------------ partial rollouts: pause / continue


def test_sglang_contract_pause_and_continue_bodies():
    from srpo_megatron.rollout.sglang.protocol import (
        build_continue_generation_request,
        build_pause_generation_request,
        build_requests_body,
    )

    assert build_pause_generation_request() == {"mode": "abort"}
    assert build_continue_generation_request() == {}
    a = SamplingParams(max_new_tokens=5, seed=9)
    body = build_requests_body([[1, 2], [3]], [a, SamplingParams(max_new_tokens=2, stop_token_ids=(4,))])
    assert body["input_ids"] == [[1, 2], [3]] and body["return_logprob"] is True
    assert body["sampling_params"][0]["sampling_seed"] == sample_seed(9, 0, 0)
    assert (
        body["sampling_params"][1]["max_new_tokens"] == 2
        and "sampling_seed" not in body["sampling_params"][1]
    )
    with pytest.raises(EngineError, match="n=1"):
        build_requests_body([[1]], [SamplingParams(n=2)])


def test_sglang_contract_pause_bodies_are_sglangs_request_classes():
    """The bodies against SGLang's own io_struct classes, where they import (the sglang tier): mode abort
    is one of PauseGenerationReqInput's modes, its default; the empty continue body takes SGLang's
    defaults; AbortReq(abort_all) is what the stand-in's /abort_request takes."""
    from srpo_megatron.rollout.sglang.protocol import (
        build_continue_generation_request,
        build_pause_generation_request,
    )
    from srpo_megatron.testing import sglang_import

    real = sglang_import.load()
    if real is None or real.io_struct is None:
        why = real.errors if real is not None else "no sglang wheel on the path"
        pytest.skip(
            f"SGLang io_struct does not import here ({why}); tools/dev test runs this in its sglang tier"
        )
    import typing

    pause = real.io_struct.PauseGenerationReqInput(**build_pause_generation_request())
    assert pause.mode == "abort" == real.io_struct.PauseGenerationReqInput().mode
    modes = typing.get_args(typing.get_type_hints(real.io_struct.PauseGenerationReqInput)["mode"])
    assert set(modes) == {"abort", "retract", "in_place"}, modes
    cont = real.io_struct.ContinueGenerationReqInput(**build_continue_generation_request())
    assert cont.torch_empty_cache is True
    assert real.io_struct.AbortReq(abort_all=True).abort_all is True


def test_sglang_contract_standin_spans_are_sglangs():
    """Where SGLang's utils.weight_versions imports (0.5.23), the stand-in's spans are its own output and
    parse back to one version per token; elsewhere (0.5.15.post1, no sglang) there are none."""
    from srpo_megatron.testing.sglang_standin import weight_version_spans

    spans = weight_version_spans("5", 3)
    try:
        from sglang.srt.utils import weight_versions  # noqa: F401
    except ImportError:
        assert spans is None
        return
    assert spans == [{"version": "5", "start": 0, "end": 3}]
    out = _sglang_output([1, 2, 3], [-1.0, -1.0, -1.0], {"type": "stop"}, "5", spans)
    assert parse_generate_response([out], [(0, 0)], 1, 5)[0][0].token_versions is None
