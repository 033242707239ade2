"""A long rollout round is many requests, not one: ``request_timeout_s`` bounds one sample.

At 235B/671B with long responses a whole round does not fit in ``rollout.sglang.request_timeout_s``
(1800 s): the server runs only so many requests at once, so a round of N samples takes about
N / capacity sample-times. ``SGLangEngine`` sends one ``/generate`` per sample, ``concurrent_requests``
in flight (slime's ``sglang_rollout`` does the same; SGLang batches concurrent requests itself), and
collects each answer as it finishes.

- ``SlowRound``: a server on a fake clock (no wall-clock anywhere) that runs ``capacity`` requests at a
  time, each sample taking ``sample_s``; a call whose duration exceeds the timeout fails as a timed-out
  transport does. A round of 16 long samples at capacity 4 takes 4 x 1000 s: per sample every call
  meets the 1800 s bound. Planted: the old single ``/generate`` for the round times out.
- ``call_each`` over ``HttpTransport`` against a local server that holds each request until every one of them
  arrived and answers them last-first: the requests really are in flight together and the answers come
  back in completion order (the engine puts each back in its place).
- ``ChildEngineTransport.call_each``: the offline engine's child runs them concurrently in its event
  loop (``async_generate``), sends each answer as it finishes, and a request past its timeout fails.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.base import EngineError, SamplingParams
from srpo_megatron.rollout.sglang import protocol
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.rollout.sglang.transports import ChildEngineTransport, HttpTransport, call_each
from srpo_megatron.testing.sglang_standin import sglang_output

TIMEOUT_S = 1800.0


def _answer(body: dict) -> list[dict]:
    """Each request's output: token ids = its input (so a misplaced answer shows), finish stop."""
    return [sglang_output(list(ids), [-0.5] * len(ids), {"type": "stop"}, "0") for ids in body["input_ids"]]


class SlowRound:
    """An SGLang server on a fake clock: ``capacity`` requests at a time, each sample ``sample_s``."""

    def __init__(self, capacity: int, sample_s: float) -> None:
        self.capacity, self.sample_s = capacity, sample_s
        self.calls: list[tuple[int, float]] = []  # (requests in the call, its fake duration)

    def call(self, method, body=None, http_method="POST"):
        if method != "generate":
            return {"success": True, "message": ""}
        n = len(body["input_ids"])
        duration = math.ceil(n / self.capacity) * self.sample_s
        self.calls.append((n, duration))
        if duration > TIMEOUT_S:  # what HttpTransport / ChildEngineTransport raise past their timeout
            raise EngineError(
                f"SGLang server did not answer generate (timed out after {TIMEOUT_S:.0f}s, the round took "
                f"{duration:.0f}s); it crashed or timed out — restart it and resync the weights"
            )
        return _answer(body)

    def health(self):
        return True

    def close(self):
        pass


PROMPTS = [[10 + i, 20 + i] for i in range(4)]
PARAMS = SamplingParams(n=4, max_new_tokens=32768, seed=3)


def _engine(transport, concurrent: int = 512) -> SGLangEngine:
    cfg = SGLangEngineConfig(
        mode="http", url="http://unused", model_path="unused", concurrent_requests=concurrent
    )
    return SGLangEngine(cfg, transport=transport, manifest={})


def _check_round(result) -> None:
    assert [len(group) for group in result] == [4] * 4
    for i, group in enumerate(result):
        for j, c in enumerate(group):
            assert c.token_ids == PROMPTS[i] and c.meta["sample_index"] == j and c.finish_reason == "stop"


def test_a_long_round_goes_out_per_sample_and_each_request_meets_the_timeout():
    server = SlowRound(capacity=4, sample_s=1000.0)  # 16 samples: a 4000 s round, 1000 s per sample
    result = _engine(server).generate(PROMPTS, PARAMS)
    _check_round(result)
    assert [n for n, _ in server.calls] == [1] * 16
    assert max(d for _, d in server.calls) <= TIMEOUT_S


def test_planted_one_generate_per_round_times_out(monkeypatch):
    """The old engine: the whole round in one body. The same slow but alive server is declared dead."""
    monkeypatch.setattr(
        SGLangEngine, "_generate_each", lambda self, body: self._transport.call("generate", body)
    )
    server = SlowRound(capacity=4, sample_s=1000.0)
    with pytest.raises(EngineError, match="timed out"):
        _engine(server).generate(PROMPTS, PARAMS)
    assert server.calls == [(16, 4000.0)]


def test_split_requests_keeps_the_shared_fields_and_every_request():
    body, rows = protocol.build_generate_request(PROMPTS[:2], SamplingParams(n=2, top_logprobs=3))
    bodies = protocol.split_requests(body)
    assert len(bodies) == len(rows) == 4
    for k, b in enumerate(bodies):
        assert b["input_ids"] == [body["input_ids"][k]] and b["sampling_params"] == [
            body["sampling_params"][k]
        ]
        assert b["return_logprob"] is True and b["top_logprobs_num"] == 3
    with pytest.raises(EngineError, match="2 outputs"):
        protocol.join_outputs([[{}, {}]], 1)


class _ChainServer:
    """HTTP server: each /generate waits until all ``n`` requests arrived (all in flight together), and
    request k answers only once the *client* got request k+1's answer (``received``): the last request
    first, and only a transport that hands out each answer as it finishes gets past the first."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrived = threading.Barrier(n)
        self.received = [threading.Event() for _ in range(n + 1)]
        self.received[n].set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                k = body["input_ids"][0][0]
                try:
                    server.arrived.wait(timeout=60)  # a safety net for a broken run, not a timing check
                    if not server.received[k + 1].wait(timeout=60):
                        raise RuntimeError("chain broken")
                except (threading.BrokenBarrierError, RuntimeError):
                    self.send_response(500)
                    self.end_headers()
                    return
                payload = json.dumps(_answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                self.wfile.flush()

        # uvicorn's backlog, as SGLang's server has: socketserver's 5 can reset a round's requests at once
        self.httpd = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 2048})(
            ("127.0.0.1", 0), Handler
        )
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_http_requests_are_in_flight_together_and_stream_back_as_each_finishes():
    n = 6
    server = _ChainServer(n)
    try:
        bodies = [{"input_ids": [[k]], "sampling_params": [{}], "return_logprob": True} for k in range(n)]
        got = []
        for k, answer in call_each(HttpTransport(server.url, TIMEOUT_S), "generate", bodies, limit=n):
            got.append((k, answer))
            server.received[k].set()  # only now may request k - 1 answer
        assert [k for k, _ in got] == list(range(n - 1, -1, -1))  # completion order, last request first
        assert all(answer[0]["output_ids"] == [k] for k, answer in got)
    finally:
        server.close()


class AsyncEngine:
    """The offline engine's stand-in for ``ChildEngineTransport``: ``async_generate`` holds each request
    until all ``n`` are in flight, then answers them last-first; input ``[[-1]]`` never answers."""

    def __init__(self, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.n = kwargs["n"]
        self.in_flight = 0
        self.done: dict[int, asyncio.Event] = {}

    async def async_generate(self, **body):
        k = body["input_ids"][0][0]
        if k < 0:
            await asyncio.Event().wait()  # a request that never finishes
        self.in_flight += 1
        for key in (k, k + 1):
            self.done.setdefault(key, asyncio.Event())
        while self.in_flight < self.n:
            await asyncio.sleep(0)
        if k + 1 < self.n:
            await self.done[k + 1].wait()
        self.done[k].set()
        return _answer(body)

    def shutdown(self):
        pass


def test_offline_child_runs_the_requests_concurrently_and_answers_each_as_it_finishes():
    n = 5
    factory = f"{__name__}:AsyncEngine"
    transport = ChildEngineTransport({"n": n}, 120, 60, engine_factory=factory)
    try:
        bodies = [{"input_ids": [[k]], "sampling_params": [{}], "return_logprob": True} for k in range(n)]
        got = list(transport.call_each("generate", bodies, limit=n))
        assert [k for k, _ in got] == list(range(n - 1, -1, -1))
        assert all(answer[0]["output_ids"] == [k] for k, answer in got)
    finally:
        transport.close()


def test_offline_child_request_past_its_timeout_is_an_error_naming_it():
    transport = ChildEngineTransport({"n": 1}, 120, 0.5, engine_factory=f"{__name__}:AsyncEngine")
    try:
        with pytest.raises(EngineError, match="request 1 did not finish within"):
            list(transport.call_each("generate", [{"input_ids": [[0]]}, {"input_ids": [[-1]]}], limit=2))
        assert transport.health()  # the pipe is in step again: the child answered the error and waits
    finally:
        transport.close()
