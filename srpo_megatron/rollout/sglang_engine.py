"""SGLang rollout engine (GPU clusters) behind the ``RolloutEngine`` Protocol, on SGLang's public APIs only.

Two ways to reach SGLang, one code path above them:

- **offline** (``mode: offline``): an ``sglang.Engine`` hosted in a *child process* (a failing Engine
  kills its whole process tree, so it must never live in the trainer); the parent sends it method calls
  over a pipe (``torch.multiprocessing`` reductions, so colocated CUDA tensors travel as IPC handles).
- **http** (``mode: http``): a running ``sglang.launch_server`` at ``url``: ``POST /generate``,
  ``GET /health``, ``POST /flush_cache``, ``/update_weights_from_tensor``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/update_weights_from_disk``, ``/release_memory_occupation``,
  ``/resume_memory_occupation``.

Both take the same request bodies (the offline Engine's method keyword arguments are the HTTP JSON
fields), so requests are built and responses parsed by the pure ``build_*`` / ``parse_*`` functions of this
module, which the CPU contract tests check against SGLang's documented shapes.

Semantics kept identical to the CPU engine:

- each (prompt, sample) pair is its own request with ``sampling_seed = sample_seed(seed, i, j)`` (SGLang
  honours per-request seeds when the server runs with ``enable_deterministic_inference``), so ``n``
  samples of a prompt differ and seeded calls repeat;
- ``return_logprob`` gives ``log softmax(logits / T)`` of the sampled token *before* top-k/top-p (SGLang's
  default; do not set ``SGLANG_RETURN_ORIGINAL_LOGPROB``), and temperature 0 reports temperature-1
  log-probs; response token ids are read from ``output_token_logprobs`` so ids and log-probs align, and
  ``no_stop_trim`` keeps the stop token in the response, with its log-prob.

Weight versions. SGLang loads whatever named tensors it is sent, bucket by bucket, so an update that fails
half-way has already changed some weights. The engine therefore validates each tensor against the model's
HF manifest (names and shapes, read from the model's config on the meta device) *before* sending its
bucket, and if anything fails after the first bucket went out it marks itself inconsistent: ``generate``
refuses with a clear error until a complete update succeeds. The served version only moves after the
last bucket is acknowledged.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from srpo_megatron.configs import ConfigError
from srpo_megatron.rollout.base import Completion, EngineError, EngineHealth, SamplingParams, sample_seed
from srpo_megatron.rollout.routed_experts import decode_sglang_routed_experts
from srpo_megatron.weights.buckets import bucketize

WeightSync = Literal["tensor", "distributed", "disk"]


@dataclass
class SGLangEngineConfig:
    """How to reach (or start) SGLang and how to push weights into it."""

    mode: Literal["offline", "http"] = "offline"  # offline Engine in a child process, or an HTTP server
    model_path: str = ""  # HF model directory the engine serves (also gives the weight manifest)
    url: str = ""  # http mode: base URL of a running server, e.g. http://10.0.0.3:30000
    weight_sync: WeightSync = "tensor"  # tensor: colocated CUDA IPC; distributed: NCCL broadcast; disk
    bucket_bytes: int = 512 * 1024**2  # max bytes per weight-update request
    disk_sync_dir: str = ""  # weight_sync=disk: folder the safetensors shards are written to
    request_timeout_s: float = 1800.0  # one generate / update call; beyond it the engine is declared dead
    startup_timeout_s: float = 1200.0  # offline: model load + CUDA graph capture
    deterministic: bool = True  # start with enable_deterministic_inference so sampling_seed is honoured
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # extra ServerArgs (tp_size, mem_fraction_…)

    def __post_init__(self) -> None:
        if self.mode == "http" and not self.url:
            raise ConfigError("rollout.sglang.url is empty but mode=http: give the server's base URL")
        if self.mode == "offline" and not self.model_path:
            raise ConfigError("rollout.sglang.model_path is empty: the offline Engine needs an HF model dir")
        if self.weight_sync == "disk" and not self.disk_sync_dir:
            raise ConfigError(
                "rollout.sglang.weight_sync=disk needs disk_sync_dir: a folder on storage both trainer "
                "and engine can read"
            )
        if self.bucket_bytes < 1024**2:
            raise ConfigError(f"rollout.sglang.bucket_bytes={self.bucket_bytes} is below 1 MiB; use ≥ 64 MiB")


# ------------------------------------------------------------------------------------ request building


def build_sampling_params(params: SamplingParams, prompt_index: int, sample_index: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one (prompt, sample) request."""
    sp: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "max_new_tokens": int(params.max_new_tokens),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "no_stop_trim": True,  # keep the stop token: the trainer scores it like any other token
        "skip_special_tokens": False,
    }
    if params.seed is not None:
        sp["sampling_seed"] = sample_seed(params.seed, prompt_index, sample_index)
    return sp


def build_generate_request(
    prompts: Sequence[Sequence[int]], params: SamplingParams
) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The ``/generate`` body (== ``Engine.generate`` kwargs) for all samples, and the (prompt, sample)
    pair of each request in order."""
    rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
    body = {
        "input_ids": [[int(t) for t in prompts[i]] for i, _ in rows],
        "sampling_params": [build_sampling_params(params, i, j) for i, j in rows],
        "return_logprob": True,
    }
    if params.return_routed_experts:  # MoE rollout routing replay: meta_info["routed_experts"] per output
        body["return_routed_experts"] = True
    return body, rows


def build_init_weights_update_group_request(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    """``/init_weights_update_group``: the engine's TP ranks join a group whose rank 0 is the trainer."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def build_update_weights_from_distributed_request(
    tensors: Sequence[tuple[str, torch.Tensor]], group_name: str, flush_cache: bool
) -> dict[str, Any]:
    """``/update_weights_from_distributed``: names/dtypes/shapes the trainer then broadcasts, in order."""
    return {
        "names": [n for n, _ in tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
    }


def build_update_weights_from_tensor_request(
    serialized_per_tp_rank: list[str], flush_cache: bool
) -> dict[str, Any]:
    """``/update_weights_from_tensor`` (HTTP): one serialized ``[(name, tensor)]`` list per engine TP rank."""
    return {
        "serialized_named_tensors": list(serialized_per_tp_rank),
        "load_format": None,
        "flush_cache": flush_cache,
    }


def build_update_weights_from_disk_request(model_path: str) -> dict[str, Any]:
    return {"model_path": model_path, "load_format": None}


def build_memory_occupation_request(tags: Sequence[str] | None = None) -> dict[str, Any]:
    """``/release_memory_occupation`` / ``/resume_memory_occupation``; ``None`` = weights and KV cache."""
    return {"tags": list(tags) if tags is not None else None}


# ------------------------------------------------------------------------------------ response parsing


def parse_finish_reason(meta: dict[str, Any]) -> str:
    """SGLang reports ``{"type": "stop"|"length"|"abort", ...}`` (or null while unfinished)."""
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length", "abort"):
        return kind
    raise EngineError(f"SGLang returned finish_reason={fr!r}; expected type stop, length or abort")


def parse_generate_response(
    outputs: Any, rows: list[tuple[int, int]], n_prompts: int, weight_version: int
) -> list[list[Completion]]:
    """Turn SGLang's per-request outputs into ``result[prompt][sample]`` Completions.

    Each output is ``{"output_ids"?, "meta_info": {"output_token_logprobs": [[logprob, token_id, text|null],
    ...], "finish_reason": {...}, "completion_tokens": int, "weight_version"?: str}}``.
    """
    if isinstance(outputs, dict):
        outputs = [outputs]
    if not isinstance(outputs, list) or len(outputs) != len(rows):
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise EngineError(f"SGLang returned {got} outputs for {len(rows)} requests")
    result: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for k, (out, (i, j)) in enumerate(zip(outputs, rows, strict=True)):
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
            raise EngineError(
                f"SGLang output {k} has no meta_info.output_token_logprobs; the request must set "
                f"return_logprob=true (got {out!r:.300})"
            )
        entries = meta["output_token_logprobs"] or []
        logprobs = [float(e[0]) for e in entries]
        token_ids = [int(e[1]) for e in entries]
        if any(lp != lp for lp in logprobs):  # NaN: a broken model must not reach the loss
            raise EngineError(f"SGLang output {k} has NaN log-probs")
        n_tokens = meta.get("completion_tokens")
        if n_tokens is not None and int(n_tokens) != len(token_ids):
            raise EngineError(
                f"SGLang output {k}: completion_tokens={n_tokens} but {len(token_ids)} output_token_logprobs"
            )
        served = str(meta.get("weight_version", ""))
        if served.isdigit() and int(served) != weight_version:
            raise EngineError(
                f"SGLang output {k} was produced by weight version {served}, expected {weight_version}"
            )
        finish = parse_finish_reason(meta)
        extra = {}
        if meta.get("routed_experts"):  # base64 int32 [P + R - 1, layers, top_k], flat here
            extra["routed_experts"] = decode_sglang_routed_experts(meta["routed_experts"])
        result[i].append(
            Completion(
                prompt_index=i,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=finish,  # type: ignore[arg-type]
                weight_version=weight_version,
                meta={"sample_index": j, "finish_reason": meta.get("finish_reason"), **extra},
            )
        )
    return result


def parse_update_response(resp: Any, what: str) -> None:
    """Weight/memory calls answer ``{"success": bool, "message": str}`` (HTTP) or ``(success, message, ...)``
    (offline Engine). Raise ``EngineError`` with SGLang's message when it failed."""
    if isinstance(resp, dict):
        ok, msg = resp.get("success", True), resp.get("message", "")
    elif isinstance(resp, tuple | list) and resp and isinstance(resp[0], bool):
        ok, msg = resp[0], resp[1] if len(resp) > 1 else ""
    elif resp is None:
        ok, msg = True, ""
    else:
        raise EngineError(f"SGLang {what} returned an unexpected response {resp!r}")
    if not ok:
        raise EngineError(f"SGLang {what} failed: {msg}")


# -------------------------------------------------------------------------------------------- manifest


def hf_manifest(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the served model, built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_against_manifest(
    name: str, tensor: torch.Tensor, manifest: dict[str, tuple[int, ...]], aliases: set[str]
) -> str | None:
    """Why ``(name, tensor)`` does not belong to the model, or None when it does."""
    if name in aliases:
        return None
    if name not in manifest:
        return f"unexpected tensor {name}"
    if tuple(tensor.shape) != manifest[name]:
        return f"mis-shaped tensor {name}: got {tuple(tensor.shape)}, model has {manifest[name]}"
    return None


# ------------------------------------------------------------------------------------------ transports


class HttpTransport:
    """JSON over HTTP to ``sglang.launch_server`` (stdlib only)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, method: str, body: dict[str, Any] | None = None, http_method: str = "POST") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}/{method}",
            data=data if http_method == "POST" else None,
            method=http_method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            raise EngineError(f"SGLang {method} answered HTTP {e.code}: {e.read()[:500]!r}") from e
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise EngineError(
                f"SGLang server at {self.url} did not answer {method} ({e}); it crashed or timed out — "
                "restart it and resync the weights"
            ) from e
        if not payload:
            return None
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            return payload.decode(errors="replace")

    def health(self) -> bool:
        try:
            self.call("health", None, http_method="GET")
            return True
        except EngineError:
            return False

    def close(self) -> None:
        pass


def _engine_child(conn, engine_kwargs: dict[str, Any]) -> None:
    """Child process: own an ``sglang.Engine`` and execute ``(method, kwargs)`` calls from the parent."""
    try:
        import sglang

        engine = sglang.Engine(**engine_kwargs)
        conn.send(("ready", None))
    except BaseException as e:
        conn.send(("error", f"sglang.Engine failed to start: {e!r}"))
        return
    while True:
        try:
            method, kwargs = conn.recv()
        except EOFError:
            break
        if method == "shutdown":
            break
        try:
            if method == "health":
                result = True
            elif method == "update_weights_from_tensor":
                result = engine.update_weights_from_tensor(**kwargs)
            else:
                result = getattr(engine, method)(**kwargs)
            conn.send(("ok", result))
        except BaseException as e:
            conn.send(("error", f"{method} raised {e!r}"))
    engine.shutdown()


class ChildEngineTransport:
    """An offline ``sglang.Engine`` in a spawned child process; method calls go over a pipe."""

    def __init__(self, engine_kwargs: dict[str, Any], startup_timeout_s: float, timeout_s: float) -> None:
        import torch.multiprocessing as tmp  # registers CUDA-IPC reductions for tensors sent over the pipe

        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_child, args=(child, engine_kwargs), daemon=False)
        self._proc.start()
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        status, detail = self._recv(startup_timeout_s, "startup")
        if status != "ready":
            self.close()
            raise EngineError(detail)

    def _recv(self, timeout: float, what: str):
        if not self._conn.poll(timeout):
            alive = self._proc.is_alive()
            raise EngineError(
                f"SGLang engine process {'did not answer' if alive else 'died (exit code '}"
                f"{'' if alive else str(self._proc.exitcode) + ')'} during {what} within {timeout:.0f}s; "
                "restart the engine and resync the weights"
            )
        try:
            return self._conn.recv()
        except EOFError as e:
            raise EngineError(
                f"SGLang engine process exited during {what} (code {self._proc.exitcode})"
            ) from e

    def call(self, method: str, body: dict[str, Any] | None = None, http_method: str = "POST") -> Any:
        with self._lock:
            if not self._proc.is_alive():
                raise EngineError(f"SGLang engine process is dead (exit code {self._proc.exitcode})")
            self._conn.send((method, body or {}))
            status, result = self._recv(self.timeout_s, method)
        if status == "error":
            raise EngineError(f"SGLang {result}")
        return result

    def health(self) -> bool:
        try:
            return bool(self.call("health"))
        except EngineError:
            return False

    def close(self) -> None:
        try:
            if self._proc.is_alive():
                self._conn.send(("shutdown", {}))
                self._proc.join(timeout=60)
        finally:
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()


# ---------------------------------------------------------------------------------------------- engine


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
    ) -> None:
        """Start or connect to SGLang. ``transport`` and ``manifest`` may be given (tests, custom launch)."""
        self.cfg = cfg
        self._manifest = manifest if manifest is not None else hf_manifest(cfg.model_path)
        self._aliases = {a for a in tied_aliases if a not in self._manifest}
        self._version = int(initial_version)
        self._released = False
        self._inconsistent = ""
        self._shut_down = False
        self._broadcast: tuple[Any, str] | None = None  # (trainer-side process group, group name)
        if transport is not None:
            self._transport = transport
        elif cfg.mode == "http":
            self._transport = HttpTransport(cfg.url, cfg.request_timeout_s)
        else:
            kwargs = {"model_path": cfg.model_path, "skip_tokenizer_init": True, **cfg.engine_kwargs}
            if cfg.deterministic:
                kwargs.setdefault("enable_deterministic_inference", True)
            if cfg.weight_sync == "tensor":
                kwargs.setdefault("enable_memory_saver", True)
            self._transport = ChildEngineTransport(kwargs, cfg.startup_timeout_s, cfg.request_timeout_s)

    @property
    def weight_version(self) -> int:
        return self._version

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
            raise EngineError("generate called while SGLang's memory is released; call resume_memory first")
        if self._inconsistent:
            raise EngineError(self._inconsistent)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        self._check_serving()
        body, rows = build_generate_request(prompts, params)
        outputs = self._transport.call("generate", body)
        return parse_generate_response(outputs, rows, len(prompts), self._version)

    def flush_cache(self) -> None:
        self._transport.call("flush_cache", {})

    def release_memory(self) -> None:
        parse_update_response(
            self._transport.call("release_memory_occupation", build_memory_occupation_request()), "release"
        )
        self._released = True

    def resume_memory(self) -> None:
        parse_update_response(
            self._transport.call("resume_memory_occupation", build_memory_occupation_request()), "resume"
        )
        self._released = False
        # Released weights come back as uninitialised memory: refuse to serve until the next full sync.
        self._inconsistent = "weights were released; push a complete weight update after resume_memory"

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self._transport.close()

    # --------------------------------------------------------------------------------- weight updates

    def attach_broadcast_group(self, group: Any, group_name: str) -> None:
        """weight_sync=distributed: the trainer-side group made with the same address/port/world size as
        ``init_broadcast_group`` sent the engine (trainer rank 0, engine ranks 1..tp)."""
        self._broadcast = (group, group_name)

    def init_broadcast_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "nccl"
    ) -> threading.Thread:
        """Ask the engine to join the broadcast group; returns the thread waiting for its answer (the engine
        blocks until the trainer joins too, so the caller creates its side, then joins the thread)."""
        body = build_init_weights_update_group_request(
            master_address, master_port, 1, world_size, group_name, backend
        )
        return _in_thread(
            lambda: parse_update_response(
                self._transport.call("init_weights_update_group", body), "init group"
            )
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stream HF-named tensors into SGLang in buckets and serve them as ``version`` (see module doc)."""
        if self._shut_down:
            raise EngineError("the SGLang engine was shut down; start a new one and resync its weights")
        if version <= self._version and not self._inconsistent:
            raise EngineError(
                f"weight version {version} is not newer than the served version {self._version}"
            )
        send = {"tensor": self._send_tensor_bucket, "distributed": self._send_broadcast_bucket, "disk": None}[
            self.cfg.weight_sync
        ]
        seen: set[str] = set()
        sent_any = False
        disk_shards: list[dict[str, torch.Tensor]] = []
        try:
            for bucket in bucketize(self._validated(named_tensors, seen), self.cfg.bucket_bytes):
                if send is None:
                    disk_shards.append({n: t.detach().cpu().contiguous() for n, t in bucket})
                    continue
                sent_any = True
                send(bucket)
            missing = sorted(set(self._manifest) - seen)
            if missing:
                raise EngineError(f"missing {len(missing)} tensors: {', '.join(missing[:8])}")
            if send is None:
                sent_any = True
                self._send_disk(disk_shards)
            self._transport.call("flush_cache", {})
        except Exception as e:
            if sent_any:
                self._inconsistent = (
                    f"weight update to version {version} failed after buckets were sent ({e}); SGLang "
                    "holds a mixture of versions and generate is refused until a complete update succeeds"
                )
            msg = f"weight update to version {version} rejected ({e}); "
            msg += "engine refuses to generate" if sent_any else f"still serving version {self._version}"
            raise EngineError(msg) from e
        self._inconsistent = ""
        self._version = int(version)

    def _validated(self, named_tensors, seen: set[str]):
        for name, tensor in named_tensors:
            problem = check_against_manifest(name, tensor, self._manifest, self._aliases)
            if problem is None and name in seen:
                problem = f"tensor {name} sent twice"
            if problem:
                raise EngineError(problem)
            seen.add(name)
            yield name, tensor

    def _send_tensor_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if isinstance(self._transport, HttpTransport):
            from sglang.srt.utils import MultiprocessingSerializer  # GPU clusters only

            tp = int(self.cfg.engine_kwargs.get("tp_size", 1))
            payload = [MultiprocessingSerializer.serialize(bucket, output_str=True) for _ in range(tp)]
            body = build_update_weights_from_tensor_request(payload, flush_cache=False)
        else:
            body = {"named_tensors": bucket, "flush_cache": False}
        parse_update_response(
            self._transport.call("update_weights_from_tensor", body), "update_weights_from_tensor"
        )

    def _send_broadcast_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self._broadcast is None:
            raise EngineError(
                "weight_sync=distributed needs attach_broadcast_group(...) before update_weights"
            )
        group, name = self._broadcast
        body = build_update_weights_from_distributed_request(bucket, name, flush_cache=False)
        waiter = _in_thread(
            lambda: parse_update_response(
                self._transport.call("update_weights_from_distributed", body),
                "update_weights_from_distributed",
            )
        )
        for _, t in bucket:  # the engine receives in the order of ``names``
            torch.distributed.broadcast(t.contiguous(), src=0, group=group)
        waiter.join()

    def _send_disk(self, shards: list[dict[str, torch.Tensor]]) -> None:
        import shutil
        from pathlib import Path

        from safetensors.torch import save_file

        out = Path(self.cfg.disk_sync_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in out.glob("*.safetensors"):
            f.unlink()
        for k, shard in enumerate(shards):
            save_file(shard, str(out / f"model-{k:05d}-of-{len(shards):05d}.safetensors"))
        for cfg_file in Path(self.cfg.model_path).glob("*.json"):
            if not cfg_file.name.endswith(".index.json"):
                shutil.copy(cfg_file, out / cfg_file.name)
        body = build_update_weights_from_disk_request(str(out))
        parse_update_response(
            self._transport.call("update_weights_from_disk", body), "update_weights_from_disk"
        )


class _Waiter(threading.Thread):
    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as e:
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _in_thread(fn: Callable[[], None]) -> _Waiter:
    w = _Waiter(fn)
    w.start()
    return w


__all__ = [
    "ChildEngineTransport",
    "HttpTransport",
    "SGLangEngine",
    "SGLangEngineConfig",
    "bucketize",
    "build_generate_request",
    "build_init_weights_update_group_request",
    "build_memory_occupation_request",
    "build_sampling_params",
    "build_update_weights_from_disk_request",
    "build_update_weights_from_distributed_request",
    "build_update_weights_from_tensor_request",
    "parse_generate_response",
    "parse_update_response",
]
