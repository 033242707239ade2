"""SGLang rollout engine (GPU clusters) behind the ``RolloutEngine`` Protocol, on SGLang's public APIs.

Semantics kept identical to the CPU engine:

- each (prompt, sample) pair is its own request with ``sampling_seed = sample_seed(seed, i, j)``: samples
  of a prompt differ and do not depend on batching (bitwise repeats additionally need
  ``deterministic: true``, i.e. ``enable_deterministic_inference``, which costs throughput: off by default);
- ``return_logprob`` gives ``log softmax(logits / T)`` of the sampled token before top-k/top-p; ids and
  log-probs are read from ``output_token_logprobs`` so they align; ``no_stop_trim`` keeps the stop token.

Weights. The version gate and the name/shape checks are ``rollout.gate`` (shared with the CPU engine); each
tensor is checked *before* its bucket leaves, and a failure after the first bucket marks the engine
inconsistent (``generate`` refuses until a complete update succeeds). Every update request carries
``weight_version``; every generate checks the version SGLang stamped on its outputs.

Memory (colocated). ``release_memory`` frees every memory type SGLang has (``GPU_MEMORY_ALL_TYPES``:
KV cache, weights, CUDA graphs) for training, naming each tag, and records what it released; it never
pauses a tag twice. ``resume_memory`` resumes only what was released: SGLang raises on resuming an
unreleased tag and then kills its process tree, and a CUDA graph replayed while its memory is paused reads
unmapped memory. A weight update resumes the weights before its first bucket and every other released tag
after its last one, as slime does (weights -> update -> CUDA graphs and KV cache), so a synced engine
holds nothing released when it generates; ``generate`` refuses while anything is released. Resumed
weights are uninitialised: the engine refuses to serve until the next full sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from srpo_megatron.buckets import FlatBucket, bucketize
from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.conversion.manifest import hf_manifest
from srpo_megatron.rollout.base import Completion, EngineError, EngineHealth, SamplingParams
from srpo_megatron.rollout.gate import check_version, head, missing_names, validated_stream
from srpo_megatron.rollout.served_precision import served_fp8_layout, with_fp8_scales
from srpo_megatron.rollout.sglang.lora_requests import (
    adapter_name,
    build_load_from_tensors_request,
    build_weight_version_request,
    payloads_needed,
    policy_adapters,
    sync_requests,
    with_adapter,
)
from srpo_megatron.rollout.sglang.protocol import (
    build_continue_generation_request,
    build_generate_request,
    build_memory_occupation_request,
    build_pause_generation_request,
    build_requests_body,
    build_update_weights_from_disk_request,
    build_update_weights_from_tensor_request,
    flat_bucket_data,
    join_outputs,
    memory_tags,
    model_eos_token_ids,
    parse_generate_response,
    parse_update_response,
    serialize_bucket_per_tp_rank,
    serialize_payload,
    server_tp_size,
    server_version,
    split_requests,
)
from srpo_megatron.rollout.sglang.transports import ChildEngineTransport, HttpTransport, call_each


def offline_engine_kwargs(
    cfg: SGLangEngineConfig, colocated: bool, base_gpu_id: int = 0, routed_experts: bool = False
) -> dict[str, Any]:
    """``sglang.Engine`` arguments with the GPU defaults of this project (explicit ``engine_kwargs`` win):
    deterministic inference only when asked (slow); the memory saver when colocated (release/resume need
    it); ``base_gpu_id`` = the first device of this engine's rank group; ``routed_experts``
    (``rollout.routing_replay``): the engine reports each token's experts, which SGLang does only when
    started with ``enable_return_routed_experts``."""
    kwargs: dict[str, Any] = {"model_path": cfg.model_path, "skip_tokenizer_init": True}
    kwargs["base_gpu_id"] = int(base_gpu_id)
    if cfg.deterministic:
        kwargs["enable_deterministic_inference"] = True
    if cfg.memory_saver if cfg.memory_saver is not None else colocated:
        kwargs["enable_memory_saver"] = True
    if routed_experts:
        kwargs["enable_return_routed_experts"] = True
    kwargs.update(cfg.engine_kwargs)
    return kwargs


def _release_ipc_memory(final: bool) -> None:
    """After the engine copied a bucket, drop the CUDA IPC references it held (``ipc_collect``); after the
    last one return the freed blocks to the device for training (``empty_cache``)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        if final:
            torch.cuda.empty_cache()


class TPPeerPayloads(Protocol):
    """The serialized payloads of an engine's TP ranks 1.., each made by the trainer rank owning that GPU
    from its own copy of ``bucket`` (``weights.tp_payloads.EnginePeers``)."""

    def payloads(self, bucket: FlatBucket, version: int) -> list[str]: ...


class SGLangEngine:
    """``RolloutEngine`` over SGLang (offline child-process Engine or HTTP server)."""

    def __init__(
        self,
        cfg: SGLangEngineConfig,
        *,
        transport: Any | None = None,
        manifest: dict[str, tuple[int, ...]] | None = None,
        tied_aliases: Iterable[str] = ("lm_head.weight",),
        initial_version: int = 0,
        colocated: bool = True,
        base_gpu_id: int = 0,
        url: str | None = None,
        serializer: Callable[[Any], str] | None = None,
        routed_experts: bool = False,
    ) -> None:
        """Start or connect to SGLang. ``transport``, ``manifest`` and ``serializer`` may be given (tests,
        custom launch); ``url`` picks one server of ``cfg.url`` (http mode); ``routed_experts``: start the
        offline engine able to report routed experts (``rollout.routing_replay``; an HTTP server gets the
        flag from ``servers.server_argv``)."""
        self.cfg = cfg
        if manifest is None:  # a blockwise FP8 folder: its FP8 weights' weight_scale_inv too
            manifest = with_fp8_scales(hf_manifest(cfg.model_path), served_fp8_layout(cfg.model_path))
        self._manifest = manifest
        self._aliases = frozenset(a for a in tied_aliases if a not in self._manifest)
        self._version = int(initial_version)
        self._memory_tags = memory_tags()  # SGLang's GPU_MEMORY_ALL_TYPES, in its order
        self._released: set[str] = set()  # tags paused inside SGLang right now
        self._inconsistent = ""
        self._shut_down = False
        self._serializer = serializer
        self._tp: int | None = None
        self._eos: tuple[int, ...] | None = None
        self._adapter: int | None = None  # lora.sync=adapter: the version whose adapter generate names
        if transport is not None:
            self._transport = transport
        elif cfg.mode == "http":
            self._transport = HttpTransport(url or cfg.url.split(",")[0], cfg.request_timeout_s)
        else:
            kwargs = offline_engine_kwargs(cfg, colocated, base_gpu_id, routed_experts)
            self._transport = ChildEngineTransport(kwargs, cfg.startup_timeout_s, cfg.request_timeout_s)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def tp_size(self) -> int:
        """The engine's TP size: asked from the server (``/get_server_info``) in http mode, where the
        launch flags, not this recipe, decide it; the recipe's ``tp_size`` offline."""
        if self._tp is None:
            self._tp = self.cfg.tp_size
            if isinstance(self._transport, HttpTransport):
                self._tp = server_tp_size(self._transport, self._tp)
        return self._tp

    def health(self) -> EngineHealth:
        if self._shut_down:
            return EngineHealth(False, self._version, "shut down")
        if not self._transport.health():
            return EngineHealth(False, self._version, "SGLang does not answer its health check")
        if self._inconsistent:
            return EngineHealth(False, self._version, self._inconsistent)
        return EngineHealth(True, self._version, "released" if self._released else "serving")

    def _check_serving(self) -> None:
        if self._shut_down:
            raise EngineError("the SGLang engine was shut down; start a new one and resync its weights")
        if self._released:
            raise EngineError("generate called while SGLang's memory is released; sync weights first")
        if self._inconsistent:
            raise EngineError(self._inconsistent)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt. Thread-safe against the main thread's pause, sync and
        continue (separate placement): the version is read at dispatch, before the request leaves, and
        stamped on every Completion (``Completion.weight_version``); a sync that lands during the call
        does not change it. A pause in the call returns the running completions with finish_reason
        abort and the tokens so far (``rollout/partial.py`` continues them)."""
        self._check_serving()
        dispatched = self._version  # before the call: a sync may land while the request runs
        body, rows = build_generate_request(prompts, params)
        outputs = self._generate_each(body)
        return parse_generate_response(outputs, rows, len(prompts), dispatched, params.top_logprobs)

    def _with_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """``lora.sync=adapter``: every ``/generate`` names the policy's adapter (without ``lora_path`` SGLang
        serves the base model alone)."""
        return body if self._adapter is None else with_adapter(body, self._adapter)

    def _generate_each(self, body: dict[str, Any]) -> list[Any]:
        """``body``'s requests as one ``/generate`` each, ``cfg.concurrent_requests`` in flight (SGLang
        batches concurrent requests itself), collected as each finishes: ``request_timeout_s`` bounds one
        sample, so a long round of long samples is not taken for a dead engine. A pause aborts the
        running requests (each answers finish_reason abort with its tokens so far) and holds the ones
        sent later until continue, as for one body."""
        bodies = split_requests(self._with_adapter(body))
        answers: list[Any] = [None] * len(bodies)
        for i, answer in call_each(self._transport, "generate", bodies, self.cfg.concurrent_requests):
            answers[i] = answer
        return join_outputs(answers, len(bodies))

    def generate_requests(
        self, inputs: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Completion]:
        """One completion per input, each request with its own sampling parameters (``n`` = 1, seed
        ``sample_seed(seed, prompt_offset, 0)``), one ``/generate`` each (``_generate_each``): the
        continuations of partial rollouts. Versions as in ``generate``."""
        self._check_serving()
        dispatched = self._version
        body = build_requests_body(inputs, params)
        outputs = self._generate_each(body)
        rows = [(k, 0) for k in range(len(inputs))]
        k = params[0].top_logprobs if params else 0  # build_requests_body: the same K for every request
        groups = parse_generate_response(outputs, rows, len(inputs), dispatched, k)
        return [c for group in groups for c in group]

    # ------------------------------------------------------------------------- pause (partial rollouts)
    # SGLang's /pause_generation and /continue_generation exist on its HTTP server only (io_struct:
    # "PauseGenerationRequests is only supported in SGLang Server"); the offline Engine has no such method.

    def pause_generation(self) -> None:
        """Abort every in-flight request (each comes back to its ``generate`` caller as finish_reason abort
        with its tokens, log-probs and routed experts so far) and hold new ones until
        ``continue_generation``; returns once SGLang holds no request. Call from another thread than the
        one inside ``generate``; the weight sync follows, then ``continue_generation``."""
        self._require_http("pause_generation")
        self._transport.call("pause_generation", build_pause_generation_request())

    def continue_generation(self) -> None:
        """Let the held requests (and new ones) run on the weights installed since ``pause_generation``."""
        self._require_http("continue_generation")
        self._transport.call("continue_generation", build_continue_generation_request())

    def _require_http(self, what: str) -> None:
        if self._shut_down:
            raise EngineError("the SGLang engine was shut down; start a new one and resync its weights")
        if not getattr(self._transport, "supports_pause", False):
            raise EngineError(
                f"{what} needs an SGLang HTTP server (rollout.placement separate, sglang.mode http): the "
                "offline sglang.Engine has no pause/continue routes, and its pipe serves one call at a time"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids SGLang stops at besides ``stop_token_ids``: the model's ``config.json`` and
        ``generation_config.json`` ``eos_token_id`` (``ModelConfig._get_hf_eos_token_id``); () when the
        folder holds neither (a continuation then cannot tell an aborted sample that ended in EOS)."""
        if self._eos is None:
            self._eos = model_eos_token_ids(self.cfg.model_path)
        return self._eos

    def release_memory(self) -> None:
        """Free every memory type SGLang has (training phase, colocated). Idempotent: only tags that are
        not already paused are released (pausing a paused tag fails inside SGLang). Under adapter syncs the
        base weights stay resident: no sync sends them again."""
        keep = {"weights"} if self._adapter is not None else set()
        todo = [t for t in self._memory_tags if t not in self._released and t not in keep]
        if not todo:
            return
        body = build_memory_occupation_request(todo)
        parse_update_response(self._transport.call("release_memory_occupation", body), "release")
        self._released |= set(todo)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Resume released memory (all of it, or ``tags``); a no-op for what was not released, because
        SGLang raises on an unknown tag. Resumed weights are uninitialised until the next full sync."""
        want = set(tags) if tags is not None else self._released
        todo = [t for t in self._memory_tags if t in want and t in self._released]
        if not todo:
            return
        body = build_memory_occupation_request(todo)
        parse_update_response(self._transport.call("resume_memory_occupation", body), "resume")
        self._released -= set(todo)
        if "weights" in todo:
            self._inconsistent = "weights were released; push a complete weight update after resume_memory"

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self._transport.close()

    # --------------------------------------------------------------------------------- weight updates
    # One route each; the trainer's ``WeightSync`` strategy (weights/weight_sync.py) decides which runs:
    # ``update_weights`` (colocated, CUDA IPC), ``update_weights_from_disk`` (a folder the strategy wrote)
    # or ``adopt_version`` (the stage senders broadcast into the server themselves).

    def adopt_version(self, version: int) -> None:
        """The trainer's stage senders installed ``version`` into this server directly (separate placement,
        ``weights.broadcast_sync``: they checked names and shapes, and every server answered every bucket
        with success): serve it from now on."""
        if self._shut_down:
            raise EngineError("the SGLang engine was shut down; start a new one and resync its weights")
        self._inconsistent = ""
        self._version = int(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stream HF-named tensors into SGLang in buckets (``/update_weights_from_tensor``) and serve them
        as ``version`` (see module doc). A single-process path (tests, tools): each bucket is flattened
        into a new buffer and every TP rank gets this process's tensors; the colocated sync uses
        ``update_weight_buckets`` (the trainer's buffers, one payload per TP rank's own GPU)."""
        with self._installing(version) as sent:
            seen: set[str] = set()
            stream = validated_stream(named_tensors, self._manifest, seen, self._aliases)
            for bucket in bucketize(stream, self.cfg.bucket_bytes):
                sent.append(True)
                self._send_tensor_bucket(bucket, version)
                del bucket
            missing = missing_names(self._manifest, seen)
            if missing:
                raise EngineError(f"missing {len(missing)} tensors: {head(missing)}")

    def update_weight_buckets(
        self, buckets: Iterable[FlatBucket], version: int, peers: TPPeerPayloads | None = None
    ) -> None:
        """Install the trainer's flat buckets as they are, one ``/update_weights_from_tensor`` each, and
        serve them as ``version``. Each bucket's buffer is the payload's ``flattened_tensor`` (no second
        copy, ``protocol.flat_bucket_data``). ``peers`` gives engine TP ranks 1.. their payloads: each
        trainer rank that owns one of this engine's other GPUs received the bucket and serialized its
        own copy (``weights.tp_payloads``), so scheduler rank i maps only GPU i, as SGLang's
        ``TpModelWorker`` expects (it deserializes ``serialized_named_tensors[tp_rank]``). Without
        ``peers`` (an engine of TP 1, single-process tests) every rank gets this rank's tensors."""
        with self._installing(version) as sent:
            seen: set[str] = set()
            for bucket in buckets:
                for _ in validated_stream(bucket.views(), self._manifest, seen, self._aliases):
                    pass  # checks every tensor before the bucket leaves
                sent.append(True)
                self._send_flat_bucket(bucket, version, peers)
                del bucket
            missing = missing_names(self._manifest, seen)
            if missing:
                raise EngineError(f"missing {len(missing)} tensors: {head(missing)}")

    def _send_flat_bucket(self, bucket: FlatBucket, version: int, peers: TPPeerPayloads | None) -> None:
        data = flat_bucket_data(bucket)
        own = serialize_payload(data, self._serializer)
        if peers is not None:
            payload = [own, *peers.payloads(bucket, version)]
        else:
            payload = [own] + [serialize_payload(data, self._serializer) for _ in range(self.tp_size - 1)]
        body = build_update_weights_from_tensor_request(payload, self.tp_size, False, version)
        resp = self._transport.call("update_weights_from_tensor", body)
        del data, payload  # only now: SGLang answered, every TP rank copied out of its buffer
        _release_ipc_memory(final=False)
        parse_update_response(resp, "update_weights_from_tensor")

    def update_weights_from_disk(self, folder: str, version: int) -> None:
        """Load the checkpoint folder ``folder`` (complete and checked: ``weights.disk_sync`` wrote it) and
        serve it as ``version``."""
        with self._installing(version) as sent:
            sent.append(True)
            body = build_update_weights_from_disk_request(folder, version)
            parse_update_response(
                self._transport.call("update_weights_from_disk", body), "update_weights_from_disk"
            )

    def update_lora(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, config: dict
    ) -> None:
        """``lora.sync: adapter`` (``weights.lora_engine_sync``): load the policy's PEFT-named adapters (full
        shapes: each TP rank slices its own) as ``srpo-policy-v<version>`` by
        ``/load_lora_adapter_from_tensors``, unload the previous version's, stamp ``version``
        (``/update_weight_version``), and from then name it in every generate's ``lora_path``
        (``lora_requests``). ``config``: the adapter_config dict. The base weights stay as launched. HTTP
        only: the offline ``sglang.Engine`` has no ``update_weight_version``."""
        if not isinstance(self._transport, HttpTransport):
            raise EngineError(
                "lora.sync=adapter needs an SGLang HTTP server (rollout.sglang.mode: http): the offline "
                "sglang.Engine cannot stamp the adapter's weight version; or set lora.sync: merged"
            )
        named = list(named_tensors)
        with self._installing(version) as sent:
            tp, release = self.tp_size, server_version(self._transport)
            payloads, flat = serialize_bucket_per_tp_rank(
                named, payloads_needed(release, tp), self._serializer
            )
            load = build_load_from_tensors_request(adapter_name(version), config, payloads, tp, release)
            for route, body in sync_requests(load, self._loaded_adapters()):
                sent.append(True)
                parse_update_response(self._transport.call(route.strip("/"), body), route)
            del flat, payloads  # SGLang answered: every TP rank copied the adapter out
            body = build_weight_version_request(version)
            parse_update_response(
                self._transport.call("update_weight_version", body), "update_weight_version"
            )
        self._adapter = int(version)

    def _loaded_adapters(self) -> list[str]:
        """The policy adapters the server holds: the one this engine loaded or, for an engine that loaded
        none (new, or rebuilt after a failed sync, on a server that lives on), what the server lists."""
        if self._adapter is not None:
            return [adapter_name(self._adapter)]
        return policy_adapters(self._transport.call("v1/models", None, http_method="GET"))

    @contextlib.contextmanager
    def _installing(self, version: int) -> Iterator[list[bool]]:
        """The frame of every update: the version gate, the weights resident before the first request and
        the other released tags back after the last, one cache flush, and the failure rule (a failure
        after anything was sent leaves SGLang holding a mixture: generate is refused until a complete
        update succeeds). The body appends to the yielded list once it sends something."""
        if self._shut_down:
            raise EngineError("the SGLang engine was shut down; start a new one and resync its weights")
        check_version(version, self._version, self._inconsistent, released="weights" in self._released)
        # Colocated: weights must be resident to receive; the other tags come back after the update.
        self.resume_memory(("weights",))
        sent: list[bool] = []
        try:
            yield sent
            self.resume_memory()  # every other released tag (KV cache, CUDA graphs) before generating
            self._transport.call("flush_cache", {})
        except Exception as e:
            if sent:
                self._inconsistent = (
                    f"weight update to version {version} failed after buckets were sent ({e}); SGLang "
                    "holds a mixture of versions and generate is refused until a complete update succeeds"
                )
            msg = f"weight update to version {version} rejected ({e}); "
            msg += "engine refuses to generate" if sent else f"still serving version {self._version}"
            raise EngineError(msg) from e
        finally:
            _release_ipc_memory(final=True)
        self._inconsistent = ""
        self._version = int(version)

    def _send_tensor_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        payload, flat = serialize_bucket_per_tp_rank(bucket, self.tp_size, self._serializer)
        body = build_update_weights_from_tensor_request(payload, self.tp_size, False, version)
        resp = self._transport.call("update_weights_from_tensor", body)
        del flat, payload  # only now: SGLang answered, so every TP rank has copied out of the flat tensor
        _release_ipc_memory(final=False)
        parse_update_response(resp, "update_weights_from_tensor")
