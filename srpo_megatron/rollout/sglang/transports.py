"""How calls reach SGLang: JSON over HTTP to ``sglang.launch_server``, or a pipe to an offline
``sglang.Engine`` in a child process (a failing Engine kills its whole process tree, so it must never live
in the trainer). Only picklable host objects cross the pipe: weight buckets arrive already serialized
(``protocol.serialize_bucket_per_tp_rank``), never as tensors, because CUDA tensors received from another
process cannot be re-shared by it.

A round's generation goes out as one request per sample (``call_each``): threads over the HTTP client, or
one pipe message the offline child runs concurrently in the engine's event loop, answering each request
as it finishes; either way the timeout bounds one request, not the round.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from srpo_megatron.rollout.base import EngineError

EACH = "__call_each__"  # the pipe message of ``ChildEngineTransport.call_each``
_PIPE_SLACK_S = 30.0  # beyond a request's own timeout: the child's answer crossing the pipe


class HttpTransport:
    """JSON over HTTP to ``sglang.launch_server`` (stdlib only).

    Thread-safe: every call opens its own connection (``urlopen``) and the object holds nothing that a call
    changes, so the main thread's ``/pause_generation`` or weight update runs while a worker thread waits
    inside ``/generate`` (separate placement, partial rollouts)."""

    supports_pause = True  # SGLang's HTTP server has /pause_generation and /continue_generation
    thread_safe = True  # ``call_each`` runs its calls from a pool of threads

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


def call_each(
    transport: Any, method: str, bodies: Sequence[dict[str, Any]], limit: int
) -> Iterator[tuple[int, Any]]:
    """``(index, answer)`` of one call per body, as each finishes: the transport's own ``call_each`` (the
    offline engine's child), else ``limit`` threads over ``call`` where the transport is ``thread_safe``
    (HTTP: each request on its own connection with its own timeout), else one call after another. The
    first failure cancels what was not sent yet and raises; requests already sent finish inside SGLang
    or meet their own timeout."""
    each = getattr(transport, "call_each", None)
    if each is not None:
        yield from each(method, bodies, limit)
        return
    if not getattr(transport, "thread_safe", False):
        for i, body in enumerate(bodies):
            yield i, transport.call(method, body)
        return
    pool = ThreadPoolExecutor(max_workers=max(1, min(limit, len(bodies))), thread_name_prefix="sglang")
    try:
        futures = {pool.submit(transport.call, method, body): i for i, body in enumerate(bodies)}
        for done in as_completed(futures):
            yield futures[done], done.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_each(
    engine: Any, conn, method: str, bodies: list[dict[str, Any]], limit: int, timeout: float
) -> None:
    """Child: the calls of ``call_each`` on the offline engine, at most ``limit`` at once in its event
    loop (``Engine.async_generate``: SGLang batches them like an HTTP server's requests), each bounded by
    ``timeout``; every answer goes to the parent as it finishes. An engine without ``async_<method>``
    (CPU stand-ins) answers them one after another."""
    coro = getattr(engine, f"async_{method}", None)
    if coro is None:
        for i, body in enumerate(bodies):
            conn.send(("item", (i, getattr(engine, method)(**body))))
        return

    async def run() -> None:
        gate = asyncio.Semaphore(limit)

        async def one(i: int, body: dict[str, Any]) -> None:
            async with gate:
                try:
                    answer = await asyncio.wait_for(coro(**body), timeout)
                except TimeoutError:
                    raise EngineError(f"request {i} did not finish within {timeout:.0f}s") from None
            conn.send(("item", (i, answer)))

        tasks = [asyncio.ensure_future(one(i, b)) for i, b in enumerate(bodies)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # none may answer into the pipe after the error
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    loop = getattr(engine, "loop", None) or asyncio.new_event_loop()
    loop.run_until_complete(run())


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
            elif method == EACH:
                _run_each(engine, conn, **kwargs)
                result = None
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

    def call_each(
        self, method: str, bodies: Sequence[dict[str, Any]], limit: int
    ) -> Iterator[tuple[int, Any]]:
        """All bodies in one message; the child runs them concurrently (``_run_each``) and sends each
        answer as it finishes, so ``timeout_s`` bounds the wait for the next answer, not the round: a
        request that runs longer fails in the child. The pipe stays taken until the last answer."""
        with self._lock:
            if not self._proc.is_alive():
                raise EngineError(f"SGLang engine process is dead (exit code {self._proc.exitcode})")
            spec = {"method": method, "bodies": list(bodies), "limit": int(limit), "timeout": self.timeout_s}
            self._conn.send((EACH, spec))
            status = "item"
            try:
                while status == "item":
                    status, result = self._recv(self.timeout_s + _PIPE_SLACK_S, method)
                    if status == "item":
                        yield result
                    elif status == "error":
                        raise EngineError(f"SGLang {result}")
            except EngineError:
                status = "error" if status == "error" else "lost"  # a pipe that timed out is not read again
                raise
            finally:
                while status == "item":  # a caller that stopped early: the pipe must be in step again
                    status, _ = self._recv(self.timeout_s + _PIPE_SLACK_S, method)

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
