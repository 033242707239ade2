"""The project against SGLang's own Python code (marker ``sglang_real``), not against its reading of it.

``tools/dev test`` runs this file once per sglang wheel (the container's 0.5.15.post1 and the newest 0.5.x,
unpacked without GPU dependencies, see tools/dev and srpo_megatron/testing/sglang_import.py); without an
sglang wheel on the path every test skips. What is checked, each against SGLang's code:

- payloads: SGLang's ``MultiprocessingSerializer`` + ``FlattenedTensorBucket`` decode what the trainer's
  weight path sends (the megatron policy's colocated sync, ``weights.engine_sync``; flat buckets of
  ``buckets`` over the ``weights.p2p`` wire; both re-bucketed by ``SGLangEngine`` and serialized
  by ``protocol.serialize_bucket_per_tp_rank``) into the HF tensors bit for bit (dense and MoE Qwen3, fp32
  and bf16) on every TP rank, and the CPU writer (``flat_wire``) writes SGLang's payload;
- memory tags: every tag of SGLang's ``GPU_MEMORY_ALL_TYPES`` that the engine releases is resumed before
  the next generation, nothing is paused twice (stand-in server with SGLang's constants);
- server arguments: SGLang's ``ServerArgs`` parses every recipe's engine arguments, as ``server_argv``
  flags and as ``offline_engine_kwargs`` keywords; a mistyped flag fails;
- request bodies: SGLang's ``io_struct`` classes accept every body ``protocol`` builds (and the stand-in
  checks every body it receives with them);
- weight names: SGLang's own ``load_weights`` consumes every name the gate accepts (per-expert file names
  for MoE) and fills every parameter of its model. SGLang's models cannot be built on CPU, so the target
  parameter names (``sglang_param_names``) are this file's reading of qwen3.py / qwen3_moe.py; SGLang's
  own renaming must land on them, shard by shard, or the test fails.

Each planted defect is encoded as its own test (``*_planted_*``).
"""

from __future__ import annotations

import argparse
import io
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.conversion.manifest import hf_manifest
from srpo_megatron.rollout.base import EngineError, SamplingParams
from srpo_megatron.rollout.sglang import flat_wire, protocol
from srpo_megatron.rollout.sglang.engine import SGLangEngine, offline_engine_kwargs
from srpo_megatron.testing import sglang_import
from tests.helpers.sglang_sync import policy_sync_worker

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )

ROOT = Path(__file__).resolve().parents[2]


def need(module: str):
    """SGLang's module ``module`` (an attribute of ``RealSGLang``), or skip naming why it did not import."""
    got = getattr(REAL, module)
    if got is None:
        pytest.skip(f"sglang {REAL.version}: {module} does not import here: {REAL.errors}")
    return got


def test_sglang_real_modules_import():
    """Everything tools/dev measured imports (0.5.15.post1 and 0.5.23, with the torchvision stub)."""
    assert REAL.errors == {}, f"sglang {REAL.version}: {REAL.errors}"


# ------------------------------------------------------------------------------------------- payloads


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_qwen3, write_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("tiny")
    return {"dense": write_tiny_qwen3(root / "dense"), "moe": write_tiny_qwen3_moe(root / "moe")}


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors under their file names (what SGLang loads from disk)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _recording_unpickler_globals(payload: str) -> tuple[list[tuple[str, str]], dict]:
    import base64

    seen: list[tuple[str, str]] = []
    safe = REAL.utils.common.SafeUnpickler  # SGLang's allow-listing unpickler

    class Recording(safe):
        def find_class(self, module, name):
            seen.append((module, name))
            return super().find_class(module, name)

    return seen, Recording(io.BytesIO(base64.b64decode(payload))).load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sglang_real_cpu_writer_is_sglangs_payload(dtype):
    """``flat_wire`` (the CPU path, no SGLang) writes what SGLang's classes write: the same pickled
    globals, equal metadata objects (SGLang's own class), the same bytes; SGLang decodes it."""
    need("utils"), need("tensor_bucket")
    bucket = [
        ("odd.bias", torch.arange(3, dtype=torch.int64)),
        ("model.layers.0.mlp.experts.1.up_proj.weight", torch.randn(3, 5).to(dtype)),
        ("model.norm.weight", torch.randn(7).to(dtype)),
    ]
    cpu, _ = flat_wire.encode(bucket, 1)
    real_bucket = REAL.tensor_bucket.FlattenedTensorBucket(named_tensors=bucket)
    data = {"flattened_tensor": real_bucket.get_flattened_tensor(), "metadata": real_bucket.get_metadata()}
    real = REAL.utils.MultiprocessingSerializer.serialize(data, output_str=True)
    cpu_globals, cpu_data = _recording_unpickler_globals(cpu[0])
    real_globals, real_data = _recording_unpickler_globals(real)
    assert cpu_globals == real_globals
    assert type(cpu_data["metadata"][0]) is REAL.tensor_bucket.FlattenedTensorMetadata
    assert cpu_data["metadata"] == real_data["metadata"]
    assert torch.equal(cpu_data["flattened_tensor"], real_data["flattened_tensor"])
    again, _ = flat_wire.encode(bucket, 1)
    decoded = REAL.utils.MultiprocessingSerializer.deserialize(again[0])
    out = REAL.tensor_bucket.FlattenedTensorBucket(
        flattened_tensor=decoded["flattened_tensor"], metadata=decoded["metadata"]
    ).reconstruct_tensors()
    assert [(n, t.dtype, t.tolist()) for n, t in out] == [(n, t.dtype, t.tolist()) for n, t in bucket]


def test_sglang_real_misaligned_mixed_dtypes_fail_in_sglang_and_are_refused_early():
    """SGLang packs a bucket without padding: a wider dtype after an odd number of narrow bytes cannot be
    viewed by its ``reconstruct_tensors``; ``serialize_bucket_per_tp_rank`` refuses such a bucket upfront."""
    need("tensor_bucket")
    bucket = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(2, dtype=torch.float32))]
    with pytest.raises(RuntimeError, match="storage_offset"):
        REAL.tensor_bucket.FlattenedTensorBucket(named_tensors=bucket).reconstruct_tensors()
    with pytest.raises(EngineError, match="element size"):
        protocol.serialize_bucket_per_tp_rank(bucket, 1)


def test_sglang_real_planted_tuple_metadata_is_refused():
    """The project's former CPU payload (metadata as (name, shape, "dtype") tuples) is not SGLang's
    format: SGLang's scheduler reads ``meta.start_idx`` and fails on it."""
    need("utils"), need("tensor_bucket")
    t = torch.ones(4)
    planted = flat_wire.serialize(
        {"flattened_tensor": t.view(torch.uint8), "metadata": [("w", (4,), "float32")]}
    )
    data = REAL.utils.MultiprocessingSerializer.deserialize(planted)
    with pytest.raises(AttributeError):
        for meta in data["metadata"]:  # what _update_weights_from_flattened_bucket does
            REAL.tensor_bucket.FlattenedTensorMetadata(
                meta.name, meta.shape, meta.dtype, meta.start_idx, meta.end_idx, meta.numel
            )


def test_sglang_real_protocol_default_is_sglangs_classes():
    """With SGLang importable, ``serialize_bucket_per_tp_rank`` makes the payload with SGLang's classes."""
    need("utils"), need("tensor_bucket")
    bucket = [("a", torch.randn(2, 3)), ("b", torch.randn(5).bfloat16())]
    payload, flat = protocol.serialize_bucket_per_tp_rank(bucket, 2)
    assert len(payload) == 2
    seen, data = _recording_unpickler_globals(payload[0])
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in seen
    assert data["flattened_tensor"].data_ptr() == flat.data_ptr() or torch.equal(
        data["flattened_tensor"], flat
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sglang_real_decodes_the_trainers_flat_bucket_without_a_copy(dtype):
    """``protocol.flat_bucket_data``: the trainer's ``FlatBucket`` (tensors at 256-byte aligned offsets,
    gaps between them) serialized with SGLang's ``MultiprocessingSerializer`` IS the bucket's buffer, and
    SGLang's ``FlattenedTensorBucket(flattened_tensor=..., metadata=...).reconstruct_tensors()`` (what its
    ``flattened_bucket`` loader runs) gives back every tensor bit for bit."""
    need("utils"), need("tensor_bucket")
    from srpo_megatron.buckets import FlatBucket, TensorSpec

    want = {"a.weight": torch.randn(3, 5).to(dtype), "b.bias": torch.randn(7).to(dtype), "c": torch.randn(1)}
    bucket = FlatBucket.empty([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in want.items()])
    for (_, view), t in zip(bucket.views(), want.values(), strict=True):
        view.copy_(t)
    data = protocol.flat_bucket_data(bucket)
    assert data["flattened_tensor"].data_ptr() == bucket.flat.data_ptr()  # one copy
    assert type(data["metadata"][0]) is REAL.tensor_bucket.FlattenedTensorMetadata
    payload = protocol.serialize_payload(data)
    decoded = REAL.utils.MultiprocessingSerializer.deserialize(payload)
    out = REAL.tensor_bucket.FlattenedTensorBucket(
        flattened_tensor=decoded["flattened_tensor"], metadata=decoded["metadata"]
    ).reconstruct_tensors()
    assert [n for n, _ in out] == list(want)
    for (_, got), t in zip(out, want.values(), strict=True):
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


class _Loopback:
    """A ``weights.p2p`` channel to itself: what is sent is what the next recv gets (copied)."""

    def __init__(self) -> None:
        self.queue: list[torch.Tensor] = []

    def send(self, t: torch.Tensor) -> None:
        self.queue.append(t.clone())

    def recv(self, t: torch.Tensor) -> None:
        t.copy_(self.queue.pop(0))

    send_meta, recv_meta = send, recv


def trainer_stream(tensors: dict[str, torch.Tensor], version: int, bucket_bytes: int):
    """The trainer's wire for ``tensors``: flat buckets (``buckets.flat_buckets``, aligned
    offsets) sent and received over ``weights.p2p``'s bucket format, as a receiving rank streams them."""
    from srpo_megatron.buckets import PendingParam, TensorSpec, flat_buckets
    from srpo_megatron.testing.sync_transports import send_buckets
    from srpo_megatron.weights.p2p import receive_stream

    pending = [
        PendingParam(
            name=n,
            nbytes=t.numel() * t.element_size(),
            fetch=lambda n=n, t=t: [(n, t)],
            specs=(TensorSpec(n, t.dtype, tuple(t.shape)),),
        )
        for n, t in tensors.items()
    ]
    ch = _Loopback()
    send_buckets(ch, flat_buckets(pending, bucket_bytes), version)
    return receive_stream(ch, version)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sglang_real_decodes_the_trainers_buckets_bit_for_bit(tiny_folders, kind, dtype):
    """Trainer flat buckets -> ``SGLangEngine`` (tensor sync, TP2 server) -> SGLang's decoder: every TP
    rank gets every HF tensor, bit for bit, and the stand-in's model then holds them."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    need("utils"), need("tensor_bucket")
    folder = tiny_folders[kind]
    tensors = {n: t.to(dtype) for n, t in file_tensors(folder).items()}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    server = SGLangStandInServer(model, tp_size=2)
    try:
        cfg = SGLangEngineConfig(
            mode="http",
            url=server.url,
            model_path=str(folder),
            weight_sync="tensor",
            bucket_bytes=4 * 1024**2,
        )
        manifest = {n: tuple(t.shape) for n, t in tensors.items()}
        engine = SGLangEngine(cfg, manifest=manifest, tied_aliases=())
        engine.update_weights(trainer_stream(tensors, 1, 2 * 1024**2), version=1)
        assert len(server.tensor_updates) > 1, "the test should span several buckets"
        for rank in range(2):
            got = Counter()
            for update in server.tensor_updates:
                for name, t in update[rank]:
                    got[name] += 1
                    want = tensors[name]
                    assert t.dtype == want.dtype and t.shape == want.shape, name
                    assert torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8)), name
            assert got == Counter(list(tensors)), f"rank {rank} did not get every tensor exactly once"
        params = dict(server.model.named_parameters())
        assert all(torch.equal(params[n].detach(), tensors[n]) for n in params if n in tensors)
        assert server.version == "1"
    finally:
        server.close()


# ------------------------------------------------------------------------------------------ memory tags


@pytest.fixture
def colocated_engine(tiny_folders):
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    folder = tiny_folders["dense"]
    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path=str(folder), weight_sync="tensor")
    tensors = file_tensors(folder)
    engine = SGLangEngine(cfg, manifest={n: tuple(t.shape) for n, t in tensors.items()}, tied_aliases=())
    yield engine, server, tensors
    server.close()


def test_sglang_real_standin_uses_sglangs_memory_types(colocated_engine):
    _, server, _ = colocated_engine
    assert server.memory_types == tuple(need("constants").GPU_MEMORY_ALL_TYPES)


def test_sglang_real_every_released_tag_is_resumed_before_generation(colocated_engine):
    """Colocated cycle, twice: release (training) -> update_weights -> generate. SGLang's release with
    null tags pauses every type of GPU_MEMORY_ALL_TYPES (cuda_graph included)."""
    engine, server, tensors = colocated_engine
    engine.update_weights(tensors.items(), version=1)
    for version in (2, 3):
        engine.release_memory()
        assert server.paused == set(server.memory_types), "the engine releases every type (tags=None)"
        engine.update_weights(tensors.items(), version=version)
        # nothing paused twice / resumed unreleased (the stand-in raises: server.dead), nothing left paused
        assert not server.dead and not server.paused, f"never resumed: {sorted(server.paused)}"
        out = engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))
        assert out[0][0].weight_version == version and not server.dead
    released = [tags for op, tags in server.memory_log if op == "release"]
    assert len(released) == 2 and all(set(tags) == set(server.memory_types) for tags in released)


def test_sglang_real_planted_unresumed_tag_is_caught(colocated_engine):
    """The D2 bug, played on the wire: release with null tags, resume only weights and kv_cache, generate:
    cuda_graph stays paused and the stand-in refuses the generation (SGLang would replay unmapped graphs)."""
    engine, server, tensors = colocated_engine
    engine.update_weights(tensors.items(), version=1)
    transport = engine._transport
    transport.call("release_memory_occupation", {"tags": None})  # SGLang: every type
    transport.call("resume_memory_occupation", {"tags": ["weights"]})
    transport.call("resume_memory_occupation", {"tags": ["kv_cache"]})
    assert server.paused == {"cuda_graph"}
    with pytest.raises(EngineError):
        transport.call(
            "generate", protocol.build_generate_request([[5]], SamplingParams(max_new_tokens=1))[0]
        )


def test_sglang_real_planted_double_pause_is_caught(colocated_engine):
    engine, server, _ = colocated_engine
    transport = engine._transport
    transport.call("release_memory_occupation", {"tags": ["kv_cache"]})
    with pytest.raises(EngineError):
        transport.call("release_memory_occupation", {"tags": None})  # kv_cache again, among all types
    assert "paused twice" in server.dead


# ------------------------------------------------------------------------------------- server arguments


def recipe_engines() -> list[tuple[str, SGLangEngineConfig]]:
    """Every recipe's ``rollout.sglang`` section, loaded as the trainer loads it."""
    from srpo_megatron.config import load_recipe

    out = []
    for recipe in sorted((ROOT / "examples").glob("*.yaml")):
        rollout = load_recipe(recipe).rollout
        if rollout.sglang is not None:
            out.append((recipe.name, rollout.sglang))
    return out


def variants(fn) -> list[dict]:
    """The keyword variants of a launcher function to check: with and without routed experts where the
    function takes ``routed_experts`` (rollout.routing_replay)."""
    import inspect

    return [{}, {"routed_experts": True}] if "routed_experts" in inspect.signature(fn).parameters else [{}]


RECIPES = recipe_engines()


def sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    need("server_args").ServerArgs.add_cli_args(parser)
    return parser


def parse_server_argv(argv: list[str]):
    """What ``python -m sglang.launch_server ARGV`` does with its arguments: SGLang's own parser."""
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv[:3]
    ns = sglang_parser().parse_args(argv[3:])
    return ns


def test_sglang_real_recipes_exist():
    assert len(RECIPES) >= 5, [n for n, _ in RECIPES]


@pytest.mark.parametrize(("recipe", "cfg"), RECIPES, ids=[n for n, _ in RECIPES])
def test_sglang_real_server_args_parse_every_recipe(recipe, cfg):
    from srpo_megatron.rollout.sglang.servers import server_argv

    for extra in variants(server_argv):
        for index in range(2):
            ns = parse_server_argv(server_argv(cfg, index, **extra))
            for key, value in cfg.engine_kwargs.items():
                assert getattr(ns, key) == value, (recipe, key)
    for extra in variants(offline_engine_kwargs):
        server_args_accept(offline_engine_kwargs(cfg, colocated=True, base_gpu_id=0, **extra))


def test_sglang_real_server_args_parse_each_node_of_an_engine_over_nodes():
    """bf16 DeepSeek-V3's TP32 engine on four 8-GPU nodes: SGLang's parser reads every node's part
    (``--nnodes 4 --node-rank k --dist-init-addr FIRST:PORT``) as ``launch/engine_nodes.py`` starts it."""
    from srpo_megatron.rollout.sglang.servers import DIST_INIT_PORT, recipe_rollout_config, server_commands

    rollout = recipe_rollout_config(str(ROOT / "examples/deepseek_v3_srpo.yaml"), [])
    hosts = ["e0", "e1", "e2", "e3"]
    for index in range(4):
        (argv,) = server_commands(rollout, 8, hosts, index)
        ns = parse_server_argv(argv)
        assert (ns.nnodes, ns.node_rank, ns.dist_init_addr) == (4, index, f"e0:{DIST_INIT_PORT}")
        assert (ns.tp_size, ns.port, ns.base_gpu_id) == (32, 30000, 0)
        assert ns.tp_size % ns.nnodes == 0  # SGLang's check_server_args: tp_size divisible by nnodes


def server_args_accept(kwargs: dict) -> None:
    """``ServerArgs(**kwargs)``, what ``sglang.Engine(**kwargs)`` builds. 0.5.15.post1's ``__post_init__``
    then looks for an accelerator (none here): unknown keywords fail before that, in ``__init__``, so an
    accelerator error still means SGLang accepted every keyword (checked against its signature too)."""
    import inspect

    cls = need("server_args").ServerArgs
    try:
        args = cls(**kwargs)
    except (RuntimeError, NotImplementedError) as e:  # no accelerator
        assert set(kwargs) <= set(inspect.signature(cls).parameters), e
        return
    for key, value in kwargs.items():
        assert getattr(args, key) == value, key


def test_sglang_real_planted_mistyped_flag_fails():
    from srpo_megatron.rollout.sglang.servers import server_argv

    cfg = SGLangEngineConfig(model_path="/m", engine_kwargs={"tp_sizee": 2})
    with pytest.raises(SystemExit):
        parse_server_argv(server_argv(cfg, 0))
    with pytest.raises(TypeError):
        server_args_accept(offline_engine_kwargs(cfg, colocated=True))


# -------------------------------------------------------------------------------------- request bodies


def project_bodies() -> dict[str, dict]:
    t = [("model.norm.weight", torch.zeros(4, dtype=torch.bfloat16))]
    params = SamplingParams(n=2, max_new_tokens=3, stop_token_ids=(7,), seed=1, return_routed_experts=True)
    payload, _ = protocol.serialize_bucket_per_tp_rank(t, 1)
    return {
        "GenerateReqInput": protocol.build_generate_request([[1, 2], [3]], params)[0],
        "UpdateWeightsFromTensorReqInput": protocol.build_update_weights_from_tensor_request(
            payload, 1, True, 3
        ),
        "UpdateWeightsFromDistributedReqInput": protocol.build_update_weights_from_distributed_request(
            t, "g", False, 3
        ),
        "InitWeightsUpdateGroupReqInput": protocol.build_init_weights_update_group_request(
            "10.0.0.1", 29600, 1, 3, "g", "nccl"
        ),
        "UpdateWeightFromDiskReqInput": protocol.build_update_weights_from_disk_request("/ckpt", 3),
        "ReleaseMemoryOccupationReqInput": protocol.build_memory_occupation_request(
            ["kv_cache", "weights", "cuda_graph"]
        ),
        "ResumeMemoryOccupationReqInput": protocol.build_memory_occupation_request(["weights"]),
    }


@pytest.mark.parametrize("cls_name", list(project_bodies()))
def test_sglang_real_request_classes_accept_the_projects_bodies(cls_name):
    io_struct = need("io_struct")
    body = project_bodies()[cls_name]
    req = getattr(io_struct, cls_name)(**json.loads(json.dumps(body)))  # as the JSON arrives over HTTP
    for key, value in json.loads(json.dumps(body)).items():
        assert getattr(req, key) == value, (cls_name, key)
    if cls_name == "GenerateReqInput":
        req.normalize_batch_and_arguments()  # SGLang's own validation of a batch request
        assert req.batch_size == 4 and req.return_logprob in (True, [True] * 4)


def test_sglang_real_planted_unknown_body_field_fails():
    with pytest.raises(TypeError):
        need("io_struct").UpdateWeightsFromTensorReqInput(serialized_named_tensors=["x"], load_fromat="x")


# --------------------------------------------------------------------------------------- weight names


class _Recorded:
    """A parameter of SGLang's model whose ``weight_loader`` records what SGLang routes to it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def weight_loader(self, param, loaded, *args, **kwargs):
        shard = kwargs.get("shard_id", args[1] if len(args) > 1 else (args[0] if args else None))
        self.log.append((self.name, shard, kwargs.get("expert_id")))


def sglang_param_names(config, moe: bool) -> list[str]:
    """SGLang's parameter names of a Qwen3 / Qwen3-MoE model (qwen3.py / qwen3_moe.py: fused qkv_proj and
    gate_up_proj, experts as w13_weight / w2_weight of a FusedMoE)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        names += [
            p + "self_attn." + s
            for s in ("qkv_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight")
        ]
        if moe:
            names += [p + "mlp.gate.weight", p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"]
        else:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return names


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sglang_real_load_weights_consumes_the_gates_names(tiny_folders, kind):
    """SGLang's own ``load_weights`` (qwen3 / qwen3_moe) routes every name of the gate's manifest to a
    parameter (it skips unknown names silently, so a name it does not know would never load) and every
    parameter receives all its shards (q/k/v, gate/up, every expert's w1/w2/w3)."""
    from transformers import AutoConfig

    module = REAL.models.get("qwen3_moe" if kind == "moe" else "qwen3")
    if module is None:
        pytest.skip(f"sglang {REAL.version}: the model module does not import: {REAL.errors}")
    folder = tiny_folders[kind]
    config = AutoConfig.from_pretrained(folder)
    manifest = hf_manifest(str(folder))
    files = file_tensors(folder)
    assert set(manifest) == set(files), (
        "the gate must accept the checkpoint's file names (per-expert for MoE); differs by "
        f"{sorted(set(manifest) ^ set(files))[:6]}"
    )
    log: list = []
    params = {n: _Recorded(n, log) for n in sglang_param_names(config, kind == "moe")}
    cls = module.Qwen3MoeForCausalLM if kind == "moe" else module.Qwen3ForCausalLM
    fake = SimpleNamespace(
        config=config,
        model=SimpleNamespace(),
        pp_group=SimpleNamespace(is_last_rank=True, is_first_rank=True),
        named_parameters=lambda: iter(params.items()),
    )
    cls.load_weights(fake, [(n, files[n]) for n in manifest])
    hits = Counter(name for name, _, _ in log)
    assert sum(hits.values()) == len(manifest), "every name reaches exactly one parameter"
    experts = getattr(config, "num_experts", 0)
    for name in params:
        if name.endswith("qkv_proj.weight"):
            want = 3
        elif name.endswith("gate_up_proj.weight"):
            want = 2
        elif name.endswith("experts.w13_weight"):
            want = 2 * experts
        elif name.endswith("experts.w2_weight"):
            want = experts
        else:
            want = 1
        assert hits[name] == want, f"{name}: {hits[name]} shards loaded, expected {want}"
    if kind == "moe":
        w13 = {(s, e) for n, s, e in log if n.endswith("layers.0.mlp.experts.w13_weight")}
        assert w13 == {(s, e) for e in range(experts) for s in ("w1", "w3")}


# ------------------------------------------------------------- payloads from the megatron policy itself


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sglang_real_decodes_the_policys_sync_bit_for_bit(tiny_folders, kind):
    """The megatron policy's colocated sync (fp32, then bf16) into a TP2 stand-in: SGLang's decoder gives
    every TP rank the checkpoint's tensors bit for bit (bf16: the checkpoint cast to bf16)."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.distributed import run_distributed
    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    need("utils"), need("tensor_bucket")
    folder = tiny_folders[kind]
    files = file_tensors(folder)
    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tp_size=2)
    try:
        (served,) = run_distributed(
            policy_sync_worker, 1, str(folder), server.url, sorted(files), timeout=600
        )
        assert served == 2 and server.version == "2"
        by_version: dict[str, list] = {"1": [], "2": []}
        versions = [b["weight_version"] for p, b in server.bodies if p == "/update_weights_from_tensor"]
        for version, update in zip(versions, server.tensor_updates, strict=True):
            by_version[version].append(update)
        for version, dtype in (("1", torch.float32), ("2", torch.bfloat16)):
            for rank in range(2):
                got = {n: t for update in by_version[version] for n, t in update[rank]}
                assert set(got) == set(files), f"v{version} rank {rank}: {sorted(set(got) ^ set(files))[:4]}"
                for name, t in got.items():
                    want = files[name].to(dtype)
                    assert t.dtype == dtype and torch.equal(t.view(torch.uint8), want.view(torch.uint8)), name
    finally:
        server.close()


def test_sglang_real_standin_checks_bodies_with_sglangs_request_classes(colocated_engine):
    """The stand-in builds SGLang's io_struct class from every body (as SGLang's HTTP server does): the
    engine's own traffic passes, a body with a field SGLang does not know is refused with 400."""
    need("io_struct")
    engine, server, tensors = colocated_engine
    engine.update_weights(tensors.items(), version=1)
    engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, seed=0))
    assert not server.rejected
    body = protocol.build_generate_request([[5]], SamplingParams(max_new_tokens=1))[0]
    with pytest.raises(EngineError):
        engine._transport.call("generate", {**body, "return_logprobs": True})  # planted typo
    assert server.rejected and server.rejected[0][0] == "/generate" and not server.dead
