"""How calls reach SGLang: JSON over HTTP to ``sglang.launch_server``, or a pipe to an offline
``sglang.Engine`` in a child process (a failing Engine kills its whole process tree, so it must never live
in the trainer). Only picklable host objects cross the pipe: weight buckets arrive already serialized
(``protocol.serialize_bucket_per_tp_rank``), never as tensors, because CUDA tensors received from another
process cannot be re-shared by it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from srpo_megatron.rollout.base import EngineError


class HttpTransport:
    """JSON over HTTP to ``sglang.launch_server`` (stdlib only).

    Thread-safe: every call opens its own connection (``urlopen``) and the object holds nothing that a call
    changes, so the main thread's ``/pause_generation`` or weight update runs while a worker thread waits
    inside ``/generate`` (separate placement, partial rollouts)."""

    supports_pause = True  # SGLang's HTTP server has /pause_generation and /continue_generation

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


def _offline_update_from_tensor(engine: Any, body: dict[str, Any]) -> Any:
    """``Engine.update_weights_from_tensor`` with the HTTP body: the offline method names the payload list
    ``named_tensors`` and passes it through untouched when ``load_format="flattened_bucket"``. Engines
    whose method takes no ``weight_version`` keyword get it stamped by ``update_weight_version`` instead,
    where they have one."""
    kwargs = dict(body)
    kwargs["named_tensors"] = kwargs.pop("serialized_named_tensors")
    version = kwargs.pop("weight_version", None)
    accepts = inspect.signature(engine.update_weights_from_tensor).parameters
    if version is not None and "weight_version" in accepts:
        kwargs["weight_version"] = version
        version = None
    result = engine.update_weights_from_tensor(**kwargs)
    if version is not None and hasattr(engine, "update_weight_version"):
        engine.update_weight_version(new_version=version)
    return result


# What torchrun's agent (torch.distributed.elastic) exports to each worker, besides every TORCHELASTIC_*
# variable. A process the worker starts is not a worker, and SGLang's schedulers misread these: the
# tcp:// rendezvous of their own world makes every rank a store client while TORCHELASTIC_USE_AGENT_STORE
# is set (nothing listens: a timeout), and SGLang takes MASTER_ADDR/MASTER_PORT (its TCP store, the CPU
# shared-memory setup) and RANK/WORLD_SIZE (checkpoint-engine updates) from the environment first.
_TORCHRUN_WORKER_VARS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


def torchrun_worker_vars(env: Mapping[str, str]) -> list[str]:
    """The torchrun worker variables ``env`` holds, to clear in an engine process the worker starts."""
    return sorted(k for k in env if k.startswith("TORCHELASTIC_") or k in _TORCHRUN_WORKER_VARS)


def _engine_child(
    conn, engine_kwargs: dict[str, Any], factory: str, clear: list[str], parent_pid: int | None = None
) -> None:
    """Child process: own an ``sglang.Engine`` (``factory``, "module:attr") and execute ``(method,
    kwargs)`` calls from the parent. ``clear``: the parent's torchrun variables, dropped before SGLang
    starts its scheduler processes (they inherit this environment). Ends with ``parent_pid``, the trainer
    (srpo_megatron/children.py); SGLang's scheduler processes end with this one."""
    from srpo_megatron.children import exit_when_orphaned

    if parent_pid is not None:
        exit_when_orphaned(parent_pid)
    for key in clear:
        os.environ.pop(key, None)
    try:
        module, attr = factory.split(":")
        engine = getattr(importlib.import_module(module), attr)(**engine_kwargs)
        conn.send(("ready", None))
    except BaseException as e:
        conn.send(("error", f"{factory.replace(':', '.')} failed to start: {e!r}"))
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
                result = _offline_update_from_tensor(engine, kwargs)
            else:
                result = getattr(engine, method)(**kwargs)
            conn.send(("ok", result))
        except BaseException as e:
            conn.send(("error", f"{method} raised {e!r}"))
    engine.shutdown()


class ChildEngineTransport:
    """An offline ``sglang.Engine`` in a spawned child process; method calls go over a pipe, one at a time
    (a lock: a second thread waits for the first call's answer), so it cannot pause a running generate.

    ``engine_factory`` ("module:attr", called with ``engine_kwargs``) is SGLang's ``Engine``; the CPU
    tests put an engine there that does the scheduler's own rendezvous."""

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        startup_timeout_s: float,
        timeout_s: float,
        engine_factory: str = "sglang:Engine",
    ) -> None:
        import torch.multiprocessing as tmp  # registers CUDA-IPC reductions for tensors sent over the pipe

        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        clear = torchrun_worker_vars(os.environ)
        self._proc = ctx.Process(
            target=_engine_child,
            args=(child, engine_kwargs, engine_factory, clear, os.getpid()),
            daemon=False,
        )
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
