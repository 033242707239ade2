"""Partial rollouts (rollout/partial.py): pause in mode abort, sync, continue, merge.

Pure merge/continuation rules first, then the whole cycle over HTTP against the CPU stand-in server
(srpo_megatron/testing/sglang_standin.py): a worker thread inside ``SGLangEngine.generate`` while the test's
main thread pauses, updates the weights and continues, as the off-policy scheduler does. The pause lands
mid-generation through the stand-in's ``hold_after_steps`` hook (events, no timing). Log-probs are checked
against the HF model recomputed at the weight version recorded for each token.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.base import Completion, EngineError, SamplingParams, sample_seed
from srpo_megatron.rollout.partial import (
    continuation_params,
    continue_partial,
    merge_routed_experts,
    merge_segments,
    segment_seed,
    settle,
)
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.rollout.sglang.protocol import build_generate_request, parse_generate_response
from srpo_megatron.testing.sglang_standin import SGLangStandInServer, sglang_output, standin_serialize
from tests.helpers.rollout_contract import EOS, initial_weights, perturbed_copy, tiny_model

WAIT_S = 120  # safety nets for event waits; nothing is asserted on time


def _c(ids, lps=None, finish="abort", version=1, versions=None, routed=None, j=0, i=0, segs=None):
    meta = {"sample_index": j} | ({"segments": segs} if segs else {})
    lps = lps if lps is not None else [-0.1 * (k + 1) for k in range(len(ids))]
    return Completion(i, list(ids), lps, finish, version, versions, routed, meta)


# ------------------------------------------------------------------------------------------ pure rules


def test_partial_merge_concatenates_tokens_logprobs_and_per_token_versions():
    first = _c([5, 6, 7], [-1.0, -2.0, -3.0], version=4)
    cont = _c([8, 9], [-4.0, -5.0], finish="stop", version=5)
    merged = merge_segments(first, cont, prompt_len=2)
    assert merged.token_ids == [5, 6, 7, 8, 9] and merged.logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert merged.token_versions == [4, 4, 4, 5, 5], "first segment's version per token, then the new one"
    assert merged.weight_version == 4, "the version at dispatch stays the sample's"
    assert merged.finish_reason == "stop" and merged.meta["segments"] == 2
    # a second continuation keeps the recorded versions of both earlier segments
    again = merge_segments(dataclasses.replace(merged, finish_reason="abort"), _c([1], version=7), 2)
    assert again.token_versions == [4, 4, 4, 5, 5, 7] and again.meta["segments"] == 3


@pytest.mark.parametrize("shaped", [False, True])
def test_partial_merge_routed_experts_keeps_the_experts_each_position_was_generated_with(shaped):
    """P=2 prompt, R1=3 then R2=2 tokens: the first segment forwarded P+R1-1=4 positions, the continuation
    (input P+R1=5) forwarded 6. Positions 0..3 keep the first segment's rows (they generated its tokens);
    4.. are the continuation's (position 4, the first segment's last token, was only forwarded there)."""
    layers, k, per = 2, 2, 4
    first = torch.arange(4 * per, dtype=torch.int32).reshape(4, layers, k)  # rows 0..3 = 0..15
    cont = 100 + torch.arange(6 * per, dtype=torch.int32).reshape(6, layers, k)
    if not shaped:  # SGLang's form: flat int32
        first, cont = first.reshape(-1), cont.reshape(-1)
    got = merge_routed_experts(first, cont, prompt_len=2, first_len=3, cont_len=2)
    rows = got.reshape(6, per)
    assert got.shape == ((6, layers, k) if shaped else (6 * per,))
    assert torch.equal(rows[:4], first.reshape(4, per)), "first segment's positions: its own experts"
    assert torch.equal(rows[4:], cont.reshape(6, per)[4:]), "after them: the continuation's"
    # the planted merge that takes the continuation's re-prefill for the old positions differs
    assert not torch.equal(rows, cont.reshape(6, per))
    with pytest.raises(EngineError, match="do not line up"):
        merge_routed_experts(first, cont[:-per], prompt_len=2, first_len=3, cont_len=2)
    assert merge_routed_experts(None, cont, 2, 0, 2) is cont, "nothing forwarded by the first segment"
    assert merge_routed_experts(first, None, 2, 3, 0) is first, "continuation aborted before prefill"
    with pytest.raises(EngineError, match="routed experts"):
        merge_routed_experts(first, None, 2, 3, 2)


def _experts(rows: int, base: int, layers: int = 3, k: int = 2) -> torch.Tensor:
    """``[rows, layers, k]`` ids unique per (position, layer, slot), offset by ``base`` (one per segment)."""
    return base + torch.arange(rows * layers * k, dtype=torch.int32).reshape(rows, layers, k)


def test_partial_two_segment_sample_stitches_every_generated_tokens_experts_in_order():
    """A hand-made sample: prompt P=3, segment 1 R1=4 tokens under version 2 (SGLang returns P+R1-1=6
    rows on abort), segment 2 R2=3 tokens under version 3 (its request is prompt + R1 tokens, so it returns
    P+R1+R2-1=9 rows, the first 6 re-forwarded under the new weights), then segment 3 R3=2 under version 4
    (11 rows). Stitched: one row per forwarded position, P+R-1 = 11 (tokens x layers x k), each from the
    segment that generated the token after it, in segment order."""
    layers, k, prompt = 3, 2, [11, 12, 13]
    seg1 = _c([1, 2, 3, 4], version=2, routed=_experts(6, 1000, layers, k).reshape(-1), i=5, j=1)
    seg2 = _c([5, 6, 7], version=3, routed=_experts(9, 2000, layers, k).reshape(-1))
    seg3 = _c([8, 9], finish="stop", version=4, routed=_experts(11, 3000, layers, k).reshape(-1))
    two = merge_segments(seg1, seg2, prompt_len=len(prompt))
    three = merge_segments(dataclasses.replace(two, finish_reason="abort"), seg3, prompt_len=len(prompt))
    want = torch.cat([_experts(6, 1000), _experts(9, 2000)[6:], _experts(11, 3000)[9:]])
    assert three.routed_experts.shape == (11 * layers * k,), "SGLang's flat form is kept"
    assert torch.equal(three.routed_experts.reshape(11, layers, k), want)
    # per generated token t (response position P+t-1 forwards the token that predicts t): its segment
    owner = [3000 if r >= 9 else 2000 if r >= 6 else 1000 for r in range(11)]
    got = three.routed_experts.reshape(11, layers * k)
    assert [int(row.min()) // 1000 * 1000 for row in got] == owner
    assert three.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert three.token_versions == [2] * 4 + [3] * 3 + [4] * 2 and three.meta["segments"] == 3


@pytest.mark.parametrize(
    "bad",
    [
        ("segment 2", lambda s1, s2: (s1, dataclasses.replace(s2, routed_experts=s2.routed_experts[:-6]))),
        (
            "segment 2",
            lambda s1, s2: (s1, dataclasses.replace(s2, routed_experts=_experts(10, 2000).reshape(-1))),
        ),
        ("segment 2", lambda s1, s2: (dataclasses.replace(s1, routed_experts=_experts(7, 1000)), s2)),
    ],
    ids=["continuation_one_row_short", "continuation_one_row_long", "first_one_row_long_shaped"],
)
def test_partial_wrong_routed_experts_length_is_refused_in_one_line_never_padded(bad):
    """A segment whose routed experts are not SGLang's P + R - 1 rows is refused, in one line naming the
    sample (prompt/sample index), the segment and both lengths."""
    want, corrupt = bad
    seg1 = _c([1, 2, 3, 4], version=2, routed=_experts(6, 1000).reshape(-1), i=5, j=1)
    seg2 = _c([5, 6, 7], version=3, routed=_experts(9, 2000).reshape(-1))
    s1, s2 = corrupt(seg1, seg2)
    if s1.routed_experts.dim() > 1:  # the shaped form, as the CPU engine reports it
        s2 = dataclasses.replace(s2, routed_experts=s2.routed_experts.reshape(-1, 3, 2))
    with pytest.raises(EngineError) as err:
        merge_segments(s1, s2, prompt_len=3)
    msg = str(err.value)
    assert "\n" not in msg and f"sample 5/1 {want}" in msg, msg
    assert "6 rows (P=3 + R=4 - 1)" in msg and "9 rows (+ R=3)" in msg, msg


def test_partial_continuation_params_reduce_the_budget_and_derive_a_seed_per_segment():
    params = SamplingParams(n=4, temperature=0.7, top_k=5, max_new_tokens=10, stop_token_ids=(9,), seed=3)
    c = _c([1, 2, 3], j=2, i=1)
    p = continuation_params(dataclasses.replace(params, prompt_offset=6), c, prompt_index=1)
    assert (p.n, p.max_new_tokens, p.stop_token_ids, p.temperature, p.top_k) == (1, 7, (9,), 0.7, 5)
    own = sample_seed(3, 6 + 1, 2)  # the sample's own seed, as the first segment had it
    assert p.seed == segment_seed(own, 1) and p.prompt_offset == 0
    assert p == continuation_params(dataclasses.replace(params, prompt_offset=6), c, 1), "deterministic"
    second = continuation_params(dataclasses.replace(params, prompt_offset=6), _c([1], j=2, segs=2), 1)
    assert second.seed == segment_seed(own, 2) != p.seed, "each segment its own seed"
    other = continuation_params(dataclasses.replace(params, prompt_offset=6), _c([1], j=3), 1)
    assert other.seed != p.seed, "each sample its own seed"
    assert continuation_params(SamplingParams(max_new_tokens=4), c, 0).seed is None, "unseeded stays so"
    with pytest.raises(EngineError, match="nothing left"):
        continuation_params(SamplingParams(max_new_tokens=3), c, 0)


def test_partial_abort_on_the_last_step_is_settled_not_continued():
    """SGLang checks an abort before the stop and length checks: an abort can land on the step that
    emitted EOS or spent the budget; continuing those would generate past the end."""
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(9,))
    assert settle(_c([1, 9]), params, ()).finish_reason == "stop"
    assert settle(_c([1, 3]), params, (3,)).finish_reason == "stop", "EOS"
    assert settle(_c([1, 2, 4, 5]), params, ()).finish_reason == "length"
    assert settle(_c([1, 2]), params, (3,)) is None


class _ScriptedEngine:
    """``generate_requests`` answering from a script: one list of completions per call (recorded)."""

    def __init__(self, script, eos=()):
        self.script, self.calls, self.eos_token_ids = list(script), [], eos

    def generate_requests(self, inputs, params):
        self.calls.append((inputs, params))
        return self.script.pop(0)


def test_partial_continue_loops_while_aborted_and_passes_the_rest_through():
    prompts = [[1, 2], [3]]
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    done = _c([7, 8], finish="stop", j=0)
    out = [[done, _c([4], j=1)], [_c([], j=0, i=1), _c([5, 5, 5, 5, 5, 5], j=1, i=1)]]
    engine = _ScriptedEngine(
        [
            [_c([6], version=2), _c([6, 6], version=2, finish="length")],  # round 1: 0/1 aborted again
            [_c([3], version=3, finish="stop")],  # round 2
        ]
    )
    res = continue_partial(engine, prompts, params, out, max_rounds=4)
    assert res[0][0] is done, "a finished completion passes through unchanged"
    assert res[1][1].finish_reason == "length" and engine.calls[0][0] == [[1, 2, 4], [3]], "settled"
    assert res[0][1].token_ids == [4, 6, 3] and res[0][1].token_versions == [1, 2, 3]
    assert res[0][1].finish_reason == "stop" and res[0][1].meta["segments"] == 3
    assert res[1][0].token_ids == [6, 6] and res[1][0].token_versions == [2, 2]
    assert engine.calls[1][0] == [[1, 2, 4, 6]] and engine.calls[1][1][0].max_new_tokens == 4
    assert out[0][1].token_ids == [4], "the input completions are not modified"
    one = continue_partial(_ScriptedEngine([[_c([6])]]), [[1]], SamplingParams(max_new_tokens=9), [[_c([4])]])
    assert one[0][0].finish_reason == "abort" and one[0][0].token_ids == [4, 6], "one round by default"
    stuck = _ScriptedEngine([[_c([6])], [_c([6])]])
    left = continue_partial(stuck, [[1]], SamplingParams(max_new_tokens=9), [[_c([4])]], max_rounds=2)
    assert left[0][0].finish_reason == "abort" and len(stuck.calls) == 2, "max_rounds bounds it"


# ------------------------------------------------------------------------- parsing versions and aborts


def test_partial_parse_fills_token_versions_from_sglang_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    out = sglang_output([7, 8, 9], [-1.0, -2.0, -3.0], {"type": "stop"}, "4", spans)
    c = parse_generate_response([out], [(0, 0)], 1, weight_version=3)[0][0]
    assert c.token_versions == [3, 3, 4] and c.weight_version == 3
    single = sglang_output(
        [7, 8], [-1.0, -2.0], {"type": "stop"}, "3", [{"version": "3", "start": 0, "end": 2}]
    )
    assert parse_generate_response([single], [(0, 0)], 1, 3)[0][0].token_versions is None, "one version"
    held = sglang_output([7, 8], [-1.0, -2.0], {"type": "stop"}, "4")  # 0.5.15: no spans; ran after a sync
    assert parse_generate_response([held], [(0, 0)], 1, 3)[0][0].token_versions == [4, 4]
    for bad, served, match in [
        ([{"version": "3", "start": 0, "end": 2}], "3", "cover 2 of 3"),
        ([{"version": "3", "start": 1, "end": 3}], "3", "do not tile"),
        ([{"version": "3", "start": 0, "end": 3}], "4", "last span"),
        ([{"version": "4", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}], "3", "backwards"),
        ([{"version": "2", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}], "4", "version 2"),
    ]:
        out = sglang_output([7, 8, 9], [-1.0, -2.0, -3.0], {"type": "stop"}, served, bad)
        with pytest.raises(EngineError, match=match):
            parse_generate_response([out], [(0, 0)], 1, weight_version=3)


def test_partial_parse_keeps_the_partial_output_of_an_aborted_request():
    aborted = sglang_output(
        [7, 8], [-1.0, -2.0], {"type": "abort", "message": "Aborted", "status_code": None}, "3"
    )
    waiting = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
    res = parse_generate_response([aborted, waiting], [(0, 0), (0, 1)], 1, weight_version=3)
    assert res[0][0].finish_reason == "abort" and res[0][0].token_ids == [7, 8]
    assert res[0][0].logprobs == [-1.0, -2.0] and res[0][1].token_ids == []


# ------------------------------------------------------------------------------ over HTTP, stand-in


@pytest.fixture(scope="module")
def weights():
    w0 = initial_weights("llama")
    return {1: perturbed_copy(w0, seed=1, scale=0.5), 2: w0, 3: perturbed_copy(w0, seed=2, scale=0.5)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(d)
    return d


@pytest.fixture
def served(weights, model_dir):
    """An SGLangEngine over HTTP to a stand-in serving version 1."""
    server = SGLangStandInServer(tiny_model("llama", weights[2]))
    manifest = {n: tuple(t.shape) for n, t in weights[2].items()}
    cfg = SGLangEngineConfig(mode="http", url=server.url, model_path=str(model_dir), bucket_bytes=1024**2)
    engine = SGLangEngine(cfg, manifest=manifest, serializer=standin_serialize)
    engine.update_weights(weights[1].items(), version=1)
    yield engine, server
    server.close()


def _score(weights, prompt, tokens, temperature):
    """Float64 teacher-forced log-probs of ``tokens`` after ``prompt`` under one weight set."""
    model = tiny_model("llama", weights, dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


PROMPTS = [[5, 6, 7], [11, 12]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7)


def _sync(engine, server, weights, version, hold_next=None):
    """The main thread at a sync: pause (the running generation returns aborted), update, continue."""
    engine.pause_generation()
    engine.update_weights(weights[version].items(), version=version)
    reached = server.hold_after_steps(hold_next) if hold_next else None
    engine.continue_generation()
    return reached


def _worker(engine, out, prompts=PROMPTS, params=PARAMS, **kw):
    """The engine-host worker thread: generate, then continue what a sync aborted."""

    def run():
        try:
            first = engine.generate(prompts, params)
            out["first"] = first
            done, calls = first, 0
            while any(c.finish_reason == "abort" for g in done for c in g) and calls < 5:
                done, calls = continue_partial(engine, prompts, params, done, **kw), calls + 1
            out["done"], out["calls"] = done, calls
        except BaseException as e:  # re-raised in the test thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _check_logprobs_per_version(weights, sample, prompt):
    for v in set(sample.token_versions):
        at = [t for t, tv in enumerate(sample.token_versions) if tv == v]
        ref = _score(weights[v], prompt, sample.token_ids, 1.0)
        got = torch.tensor(sample.logprobs, dtype=torch.float64)
        assert torch.allclose(got[at], ref[at], atol=2e-5), f"tokens of version {v}"
        other = _score(weights[2 if v != 2 else 1], prompt, sample.token_ids, 1.0)
        assert not torch.allclose(got[at], other[at], atol=1e-3), "the check tells the versions apart"


def test_partial_pause_mid_generation_sync_and_continue_records_versions_and_logprobs(served, weights):
    engine, server = served
    reached = server.hold_after_steps(4)
    out: dict = {}
    worker = _worker(engine, out)
    assert reached.wait(WAIT_S), "the generation never reached decode step 4"
    _sync(engine, server, weights, 2)
    worker.join(WAIT_S)
    assert "error" not in out, out.get("error")
    first, done = out["first"], out["done"]
    # One request per sample, all in flight: the one the stand-in's engine took first is held at step 4.
    (at,) = [
        (i, j)
        for i, g in enumerate(first)
        for j, c in enumerate(g)
        if c.token_ids and c.finish_reason == "abort"
    ]
    held = first[at[0]][at[1]]
    assert len(held.token_ids) == 4, "aborted at step 4, tokens kept"
    for c in (c for g in first for c in g if c is not held):
        aborted_empty = c.finish_reason == "abort" and not c.token_ids  # SGLang's waiting queue
        held_by_pause = c.finish_reason != "abort" and set(c.token_versions or [1]) == {2}  # sent after it
        assert aborted_empty or held_by_pause, "a request not started came back with version 1 tokens"
    sample = done[at[0]][at[1]]
    assert sample.token_ids[:4] == held.token_ids and sample.logprobs[:4] == held.logprobs
    assert sample.token_versions[:4] == [1] * 4 and set(sample.token_versions[4:]) == {2}
    assert len(sample.token_versions) == len(sample.token_ids) > 4
    assert sample.weight_version == 1 and sample.meta["segments"] == 2
    _check_logprobs_per_version(weights, sample, PROMPTS[at[0]])
    for i, group in enumerate(done):
        for c in group:
            assert c.finish_reason in ("stop", "length") and len(c.token_ids) <= PARAMS.max_new_tokens
            assert len(c.logprobs) == len(c.token_ids) == len(c.token_versions)
            if len(set(c.token_versions)) > 1:
                _check_logprobs_per_version(weights, c, PROMPTS[i])
            if c is not sample:  # wholly generated by the continuation: version 2 throughout
                assert set(c.token_versions) == {2} and c.weight_version == 1
    assert not server.dead


@pytest.mark.parametrize("rounds", [1, 2])
def test_partial_aborted_twice_is_continued_twice(served, weights, rounds):
    """One round per call, the worker calling again while any is aborted (the off-policy scheduler), or
    two rounds in one call (the second continuation waits at SGLang's pause). One sample: with one
    request per sample, which of several the stand-in's engine takes first is not fixed."""
    engine, server = served
    reached = server.hold_after_steps(3)
    out: dict = {}
    one = dataclasses.replace(PARAMS, n=1)
    worker = _worker(engine, out, prompts=PROMPTS[:1], params=one, max_rounds=rounds)
    assert reached.wait(WAIT_S)
    again = _sync(engine, server, weights, 2, hold_next=2)  # the continuation is held at its step 2
    assert again.wait(WAIT_S), "the continuation never reached its decode step 2"
    _sync(engine, server, weights, 3)
    worker.join(WAIT_S)
    assert "error" not in out, out.get("error")
    sample = out["done"][0][0]
    assert sample.token_versions[:5] == [1, 1, 1, 2, 2] and set(sample.token_versions[5:]) <= {3}
    assert sample.meta["segments"] == 3 and sample.finish_reason in ("stop", "length")
    assert out["calls"] == (2 if rounds == 1 else 1)
    assert len(sample.token_ids) <= PARAMS.max_new_tokens
    for v in (1, 2, 3):
        at = [t for t, tv in enumerate(sample.token_versions) if tv == v]
        ref = _score(weights[v], PROMPTS[0], sample.token_ids, 1.0)
        assert torch.allclose(torch.tensor(sample.logprobs, dtype=torch.float64)[at], ref[at], atol=2e-5), v


class _ReturnAfterSync:
    """Transport whose ``generate`` answer reaches the caller only after the test's sync finished: the
    sync lands between dispatch and return, deterministically."""

    def __init__(self, inner):
        self.inner, self.answered, self.synced = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def call(self, method, body=None, http_method="POST"):
        result = self.inner.call(method, body, http_method)
        if method == "generate":
            self.answered.set()
            assert self.synced.wait(WAIT_S)
        return result


class _StampAtCompletion(SGLangEngine):
    """The planted bug: the version read after the call returned (the old ``generate``)."""

    def generate(self, prompts, params):
        body, rows = build_generate_request(prompts, params)
        outputs = self._transport.call("generate", body)
        return parse_generate_response(outputs, rows, len(prompts), self._version)


@pytest.mark.parametrize("planted", [False, True])
def test_partial_version_is_stamped_at_dispatch_not_at_completion(served, weights, planted):
    engine, _ = served
    if planted:
        engine.__class__ = _StampAtCompletion
    transport = engine._transport = _ReturnAfterSync(engine._transport)
    out: dict = {}

    def run():
        try:
            out["res"] = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1))
        except EngineError as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert transport.answered.wait(WAIT_S)
    engine.update_weights(weights[2].items(), version=2)  # the sync lands during the call
    transport.synced.set()
    t.join(WAIT_S)
    if planted:
        assert "produced by weight version 1, expected 2" in str(out.get("error")), "planted bug caught"
        return
    c = out["res"][0][0]
    assert c.weight_version == 1 and c.token_versions is None, "every token of the call has version 1"


def test_partial_generate_arriving_while_paused_waits_and_runs_on_the_new_weights(served, weights):
    engine, _ = served
    engine.pause_generation()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(res=engine.generate([[5, 6, 7]], PARAMS)), daemon=True)
    t.start()  # dispatched at version 1; SGLang holds it until continue_generation
    engine.update_weights(weights[2].items(), version=2)
    assert t.is_alive() and "res" not in out, "answered while paused"
    engine.continue_generation()
    t.join(WAIT_S)
    c = out["res"][0][0]
    assert c.weight_version == 1 and c.token_versions == [2] * len(c.token_ids), "ran on version 2"
    assert c.finish_reason != "abort"
    assert torch.allclose(
        torch.tensor(c.logprobs, dtype=torch.float64),
        _score(weights[2], [5, 6, 7], c.token_ids, 1.0),
        atol=2e-5,
    )


def test_partial_standin_refuses_the_pause_modes_it_does_not_implement(served):
    engine, server = served
    for mode in ("retract", "in_place"):
        with pytest.raises(EngineError, match=r"HTTP 400.*mode abort only"):
            engine._transport.call("pause_generation", {"mode": mode})
    assert not server.dead and not server.generation_paused


def test_partial_abort_request_aborts_without_pausing(served):
    engine, server = served
    reached = server.hold_after_steps(2)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(res=engine.generate([[5, 6]], PARAMS)), daemon=True)
    t.start()
    assert reached.wait(WAIT_S)
    engine._transport.call("abort_request", {"abort_all": True})
    t.join(WAIT_S)
    res = out["res"][0]  # one request per sample: the one the stand-in's engine took first was held
    (held,) = [c for c in res if c.finish_reason == "abort" and c.token_ids]
    assert len(held.token_ids) == 2
    assert all(c is held or not c.token_ids or c.finish_reason != "abort" for c in res)
    assert not server.generation_paused
    assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0][0].finish_reason != "abort"


def test_partial_pause_needs_the_http_server():
    from tests.helpers.sglang import SGLangMemoryRules

    cfg = SGLangEngineConfig(mode="http", url="http://unused", model_path="/nowhere")
    engine = SGLangEngine(cfg, transport=SGLangMemoryRules(), manifest={})
    with pytest.raises(EngineError, match="needs an SGLang HTTP server"):
        engine.pause_generation()
    assert engine.eos_token_ids == (), "no model folder: no EOS ids"


def test_partial_sglang_engine_reads_eos_like_sglang(served, model_dir):
    engine, _ = served
    assert engine.eos_token_ids == (EOS,)


# ------------------------------------------------------------------- MoE routed experts, CPU engine


def test_partial_continued_moe_sample_keeps_each_positions_experts():
    """HFEngine directly (the same through the stand-in server and the HTTP client:
    tests/sglang_real/test_sglang_standin_routed_experts.py): abort at step 3, new weights, continue; the
    merged experts are the old model's for the first segment's positions, the new one's after."""
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.rollout.hf_moe_layout import file_format_params
    from srpo_megatron.rollout.routed_experts import hf_routed_experts
    from srpo_megatron.testing.tiny import TINY_MOE_TOP_K as TOP_K
    from srpo_megatron.testing.tiny import tiny_moe_model

    old, new = tiny_moe_model(seed=3), tiny_moe_model(seed=4)
    reference_old = tiny_moe_model(seed=3)
    engine = HFEngine(old, max_batch_size=4, eos_token_ids=[299])
    reached = threading.Event()

    def hook(step, aborted):
        if step == 3 and not reached.is_set():
            reached.set()
            aborted.wait(WAIT_S)

    engine.step_hook = hook
    prompt = [5, 17, 42]
    params = SamplingParams(max_new_tokens=8, seed=11, return_routed_experts=True)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(first=engine.generate([prompt], params)), daemon=True)
    t.start()
    assert reached.wait(WAIT_S)
    assert engine.abort_running() == 1
    t.join(WAIT_S)
    first = out["first"]
    assert first[0][0].finish_reason == "abort" and len(first[0][0].token_ids) == 3
    assert first[0][0].routed_experts.shape == (len(prompt) + 2, 2, TOP_K)
    state = file_format_params(dict(new.state_dict(keep_vars=True)))
    engine.update_weights([(n, t.detach().clone()) for n, t in state.items()], version=1)
    sample = continue_partial(engine, [prompt], params, first)[0][0]
    ids = prompt + sample.token_ids
    kept = len(prompt) + 3 - 1
    got = sample.routed_experts.long().sort(-1).values
    assert got.shape == (len(ids) - 1, 2, TOP_K) and sample.token_versions[:3] == [0, 0, 0]
    want_old = hf_routed_experts(reference_old, torch.tensor([ids[:kept]]), TOP_K)
    want_new = hf_routed_experts(new, torch.tensor([ids[:-1]]), TOP_K)
    assert torch.equal(got[:kept], want_old), "first segment's positions: the old weights' experts"
    assert torch.equal(got[kept:], want_new[kept:]), "after them: the new weights' experts"
    assert not torch.equal(want_old, want_new[:kept]), "the two versions route differently here"
