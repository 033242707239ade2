"""The parity KL in the real scoring pass (``trainer/passes/scoring.scoring_pass`` with ``rollout.parity_top_k``):
the trainer's log-probs at the engine's top-K ids, from the megatron policy's logits shard, against an
independent float64 transformers forward of the same weights.

- An engine whose top-K is the reference distribution's own reads ≈ 0 (fp32 trainer vs float64: < 1e-6).
- A perturbed engine (its logits + noise) reads the KL an independent float64 computation gives, to 1e-4
  relative, and far above the identical engine's.
- The same at CP2 with packing (each CP rank scores its chunks; the per-row KL is gathered over CP and
  counted once), and the temperature is applied (rollout.temperature 0.8 on both sides).

Planted by hand, each caught: engine rows misaligned by one token in ``engine_top_k`` (both cases fail the
identical-engine check: max KL 3.4e-3 on this near-uniform tiny model, against < 1e-6); dropping the CP
gather of the KL (CP2 fails: the counted rank sums only its own rows, 5.8e-4 against 6.5e-3 per token).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import TINY_POLICY_VOCAB, tiny  # noqa: F401  (module fixture)
from tests.helpers.parity import reference_kl as _reference_kl

K = 4
TEMPERATURE = 0.8


def _samples():
    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(11)
    out = []
    for m in range(8):
        prompt = torch.randint(10, TINY_POLICY_VOCAB, (3 + m % 3,), generator=g).tolist()
        resp = torch.randint(10, TINY_POLICY_VOCAB, (2 + (5 * m) % 7,), generator=g).tolist()
        out.append(Sample(m // 4, m % 4, prompt, resp, [-1.0] * len(resp), advantage=0.5 - (m % 2)))
    return out


def _reference(hf, samples) -> list[torch.Tensor]:
    """Per sample [R, V] float64 log-softmax at TEMPERATURE of the HF model in ``hf`` (no megatron)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
            rows = logits[len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)]
            out.append(torch.log_softmax(rows / TEMPERATURE, dim=-1))
    return out


def _with_engine(samples, engine_logp: list[torch.Tensor]):
    """The samples with the engine's top-K of ``engine_logp`` (what the engine would report)."""
    out = []
    for s, lp in zip(samples, engine_logp, strict=True):
        top = lp.topk(K, dim=-1)
        out.append(dataclasses.replace(s, engine_top_ids=top.indices, engine_top_logp=top.values.float()))
    return out


def _score(rank, world, tiny, run_dir, extra, cases):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.observe.step_metrics import gather_stats
    from tests.helpers.recipe import RECIPE

    hf, data = tiny
    ov = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}", *extra]
    ov += [f"rollout.parity_top_k={K}", f"rollout.temperature={TEMPERATURE}"]
    cfg = load_config(TrainConfig, str(RECIPE), ov)
    p = cfg.parallel
    policy = Policy(cfg, initialize_model_parallel(p.tp, p.pp, seed=1, cp=p.cp))
    out = {}
    for name, samples in cases.items():
        s = gather_stats(scoring_pass(policy, samples).stats, policy.groups.host)
        out[name] = (s.topk_kl_sum, s.topk_kl_max, s.topk_kl_tokens)
    return out


@pytest.fixture(scope="module")
def cases(tiny):  # noqa: F811
    samples = _samples()
    ref = _reference(tiny[0], samples)
    g = torch.Generator().manual_seed(5)
    noisy = [torch.log_softmax(lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype), -1) for lp in ref]
    expected = 0.0
    for lp, nz in zip(ref, noisy, strict=True):
        top = nz.topk(K, dim=-1)
        for r in range(lp.shape[0]):
            p_row = top.values[r].float().double().tolist()  # the engine reports float32
            expected += _reference_kl(p_row, lp[r, top.indices[r]].tolist())
    tokens = sum(len(s.response_ids) for s in samples)
    return {"same": _with_engine(samples, ref), "perturbed": _with_engine(samples, noisy)}, expected, tokens


@pytest.mark.parametrize(
    "world,extra",
    [(1, []), (2, ["parallel.cp=2", "train.max_tokens_per_micro_batch=32"])],
    ids=["world1", "cp2_packed"],
)
def test_parity_kl_in_the_scoring_pass(tiny, cases, tmp_path, world, extra):  # noqa: F811
    engines, expected, tokens = cases
    got = run_distributed(_score, world, tiny, str(tmp_path), extra, engines)[0]
    same_sum, same_max, same_tokens = got["same"]
    pert_sum, pert_max, pert_tokens = got["perturbed"]
    assert same_tokens == pert_tokens == tokens, "every response token is counted once"
    assert same_max < 1e-6, f"identical distributions must read ~0 (fp32 vs float64), got max {same_max}"
    assert pert_sum / tokens == pytest.approx(expected / tokens, rel=1e-4)
    assert pert_max > 1e-3 and pert_sum / tokens > 1e3 * max(same_sum / tokens, 1e-9)
