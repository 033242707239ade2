"""``rollout.true_on_policy_mode`` on the CPU engine (``rollout/true_on_policy.py``), without the trainer:
the sampled tokens are those of the plain decode loop (sampling unchanged), the reported log-probs agree
with an independent float64 teacher-forced reference (≤ 1e-5) on a vocabulary the trainer pads (250 ->
256 rows), and the key is refused with the SGLang engine. Exactly 0 against the trainer's own scoring
pass is ``tests/integration/test_true_on_policy.py``."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.config import ConfigError
from srpo_megatron.config.rollout import RolloutConfig, SGLangEngineConfig
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.hf_engine import HFEngine

VOCAB = 250  # not a multiple of 128: the rescoring pads the output weight to 256 rows and masks 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_qwen3_no_tokenizer

    return write_tiny_qwen3_no_tokenizer(tmp_path_factory.mktemp("top"), vocab_size=VOCAB)


def _engine(model_dir, mode: bool) -> HFEngine:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return HFEngine(model, max_batch_size=3, eos_token_ids=[VOCAB - 1], true_on_policy_mode=mode)


def _reference(model_dir, prompt, response, temperature) -> torch.Tensor:
    """float64 log softmax(logits / T) at the response tokens, one unpadded forward of the float64 model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, ids[0, len(prompt) :, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_tokens_and_float64_logprobs(model_dir, temperature):
    prompts = [[5, 9, 17], [3] * 11, [40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=9, seed=11)
    plain = _engine(model_dir, False).generate(prompts, params)
    exact = _engine(model_dir, True).generate(prompts, params)
    worst = 0.0
    for i, (a_row, b_row) in enumerate(zip(plain, exact, strict=True)):
        for a, b in zip(a_row, b_row, strict=True):
            assert a.token_ids == b.token_ids, "the mode must not change what is sampled"
            assert len(b.logprobs) == len(b.token_ids)
            ref = _reference(model_dir, prompts[i], b.token_ids, temperature)
            worst = max(worst, (torch.tensor(b.logprobs, dtype=torch.float64) - ref).abs().max().item())
    assert worst <= 1e-5, worst


def test_refused_with_sglang():
    with pytest.raises(ConfigError, match="true_on_policy_mode=true needs"):
        RolloutConfig(engine="sglang", sglang=SGLangEngineConfig(model_path="/m"), true_on_policy_mode=True)
