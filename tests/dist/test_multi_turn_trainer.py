"""Multi-turn samples through the real megatron scoring and learning passes (tiny Qwen3, CPU, fp32).

The trajectories come from the CPU engine (``HFEngine``, fp32, the same weights as the policy) the way a
token-in-token-out rollout makes them: turn 1 generated from the prompt ids, tool tokens appended as ids,
turn 2 generated from prompt + turn 1 + tool ids; ``rollout_logp`` is the engine's for its own tokens and
0.0 for the tool tokens (``Sample.response_mask`` 0). One SDPO-routed trajectory has a teacher prompt,
one sample is single-turn.

- The rollout log-prob gap (``|log π_old − log π_rollout|``, the step's ``rollout_logp_gap_*``) on the
  assistant tokens is 0 up to fp32 kernels (≤ 1e-5; the tool tokens, if counted, would read their full
  log-prob, ~5), and the step counts only assistant tokens; so does the parity KL over the engine's top-K
  (``rollout.parity_top_k``; the tool rows carry junk top-K, which it must not read).
- Packed micro-batches (a token budget of 24, and all in one) give the same loss, SDPO sum, gradients
  (≤ 1e-5 relative) and parameters after the Adam step (≤ 3e-5: Adam divides small gradients by their
  own size) as padded ones, with the multi-turn samples split differently.
- CP2 (packed, each rank scoring its chunks) gives the same as CP1.

Planted by hand, each caught: the batch mask built as if single-turn (``sample_tokens`` with an all-True
mask: the step counted 52 tokens, the assistant wrote 37); the parity rows taken from every response row
(``engine_top_k``'s ``have`` all True: the KL reads 22.4 on the tool rows' junk top-K).
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import TINY_POLICY_VOCAB, tiny  # noqa: F401  (module fixture)

BUDGETS = (0, 24, 400)  # 0 = padded micro-batches (the reference)
K = 4  # rollout.parity_top_k
LR, ADAM_EPS = 0.01, 1e-8  # the step compared below (Adam, first step)


def _trajectories(hf):
    """Four samples of the CPU engine: three two-turn trajectories (one SDPO-routed) and one single-turn."""
    from srpo_megatron.rollout.base import SamplingParams
    from srpo_megatron.rollout.hf_engine import HFEngine, HFEngineConfig
    from srpo_megatron.trainer.step_types import Sample

    engine = HFEngine.from_config(HFEngineConfig(model_path=str(hf), dtype="float32", eos_token_ids=(1,)))
    g = torch.Generator().manual_seed(21)
    out = []
    for m in range(4):
        prompt = torch.randint(10, TINY_POLICY_VOCAB, (3 + m,), generator=g).tolist()
        params = SamplingParams(n=1, max_new_tokens=4 + m, seed=m, top_logprobs=K)
        first = engine.generate([prompt], params)[0][0]
        ids, logp, mask = list(first.token_ids), list(first.logprobs), [1] * len(first.token_ids)
        top_ids, top_logp = [first.top_ids], [first.top_logprobs]
        if m != 3:  # two turns: the tool turn's ids, then turn 2 from everything so far
            tool = torch.randint(10, TINY_POLICY_VOCAB, (3 + 2 * m,), generator=g).tolist()
            second = engine.generate([prompt + ids + tool], params)[0][0]
            ids += tool + list(second.token_ids)
            logp += [0.0] * len(tool) + list(second.logprobs)
            mask += [0] * len(tool) + [1] * len(second.token_ids)
            # the tool rows have no engine distribution: junk top-K (ids 0..K-1, log-prob 0) the trainer
            # must not read
            top_ids += [torch.arange(K).expand(len(tool), K), second.top_ids]
            top_logp += [torch.zeros(len(tool), K), second.top_logprobs]
        sdpo = m == 1
        teacher = torch.randint(10, TINY_POLICY_VOCAB, (9,), generator=g).tolist() if sdpo else None
        out.append(
            Sample(
                0,
                m,
                prompt,
                ids,
                logp,
                advantage=0.0 if sdpo else (1.0 if m % 2 == 0 else -1.0),
                grpo=not sdpo,
                sdpo=sdpo,
                needs_teacher=sdpo,
                teacher_prompt_ids=teacher,
                response_mask=None if m == 3 else mask,
                engine_top_ids=torch.cat(top_ids),
                engine_top_logp=torch.cat(top_logp).float(),
            )
        )
    return out


def _step(
    rank,
    world,
    tiny,  # noqa: F811
    run_dir,
    samples,
    budgets,
    extra,
):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.observe.step_metrics import gather_stats
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.state.policy import Policy
    from tests.helpers.recipe import RECIPE

    hf, data = tiny
    out = []
    groups = None
    for budget in budgets:
        ov = [
            f"model.hf_dir={hf}",
            f"data.train_files=[{data}]",
            f"run.dir={run_dir}/{budget}",
            "loss.mode=srpo",
            f"rollout.parity_top_k={K}",
            f"optim.lr={LR}",
            f"optim.adam_eps={ADAM_EPS}",
            "optim.warmup_steps=0",
            "train.micro_batch_size=2",
            f"train.max_tokens_per_micro_batch={budget}",
            *extra,
        ]
        cfg = load_config(TrainConfig, str(RECIPE), ov)
        groups = groups or initialize_model_parallel(1, 1, seed=1, cp=cfg.parallel.cp)
        policy = Policy(cfg, groups)
        scored = scoring_pass(policy, samples)
        parity = gather_stats(scored.stats, groups.host)  # the scoring pass's own stats (the parity KL)
        stats = gather_stats(learn(policy, scored, 1), groups.host)
        # the gradients the optimizer stepped on (megatron DDP's main_grad buffer, zeroed only at the next
        # mini-batch), and the parameters after the step
        grads = {
            n: getattr(p, "main_grad", p.grad).detach().float().clone()
            for n, p in policy.model.named_parameters()
        }
        params = {n: (p.detach().float().clone(), grads[n]) for n, p in policy.model.named_parameters()}
        gaps = (stats.rollout_logp_gap_max, parity.topk_kl_max, parity.topk_kl_tokens)
        out.append((stats.loss, stats.sdpo_loss_sum, stats.tokens, gaps, params))
    return out


@pytest.fixture(scope="module")
def samples(tiny):  # noqa: F811
    return _trajectories(tiny[0])


def _check(results, samples, budgets):
    assistant = sum(sum(s.response_mask) if s.response_mask else len(s.response_ids) for s in samples)
    total = sum(len(s.response_ids) for s in samples)
    assert total - assistant >= 10, "the tool turns must hold tokens"
    (ref_loss, ref_sdpo, ref_tokens, ref_gap, ref_params), *others = results
    assert ref_tokens == assistant, f"the step counted {ref_tokens} tokens, the assistant wrote {assistant}"
    assert ref_gap[0] <= 1e-5, f"engine and trainer log-probs differ by {ref_gap[0]} on assistant tokens"
    assert ref_gap[1] <= 1e-6, f"the parity KL over the engine's top-{K} reads {ref_gap[1]}"
    assert ref_gap[2] == assistant, f"the parity KL counted {ref_gap[2]} rows, not the assistant's"
    assert ref_sdpo != 0.0, "the SDPO trajectory took no loss: the teacher path is not exercised"
    for budget, (loss, sdpo, tokens, gap, params) in zip(budgets[1:], others, strict=True):
        assert tokens == assistant and gap[0] <= 1e-5 and gap[1] <= 1e-6, f"budget {budget}: {tokens}, {gap}"
        assert loss == pytest.approx(ref_loss, abs=1e-6), f"budget {budget}: loss"
        assert sdpo == pytest.approx(ref_sdpo, abs=1e-5), f"budget {budget}: SDPO loss sum"
        for name, (want, want_grad) in ref_params.items():
            got, grad = params[name]
            rel = ((grad - want_grad).abs().max() / want_grad.abs().max().clamp_min(1e-30)).item()
            assert rel <= 1e-5, f"budget {budget}: gradient of {name} differs by {rel} (relative)"
            # Adam's first step is lr * g / (|g| + eps): where |g| is near eps the step is set by eps, and
            # a gradient difference far inside the tolerance above moves it by up to ~lr/2 (one element of
            # 4096 here: |g| 4.8e-9, gradient off by 1e-10, step off by 4.8e-5 on an AVX-512 host). The
            # steps are compared where the gradient is 0 (no step) or well above eps; the rest (few) are
            # bounded by lr.
            near_eps = (want_grad.abs() < 100 * ADAM_EPS) & (want_grad != 0)
            assert near_eps.float().mean() <= 0.1, f"{name}: too many gradients near Adam's eps to compare"
            diff = (got - want)[~near_eps].abs().max().item()
            assert diff <= 3e-5, f"budget {budget}: parameter {name} differs by {diff} after the step"
            assert (got - want).abs().max().item() <= LR, f"budget {budget}: {name}: a step off by > lr"


@pytest.mark.packing
def test_multi_turn_step_gap_zero_and_packed_equals_padded(tiny, samples, tmp_path):  # noqa: F811
    results = run_distributed(_step, 1, tiny, str(tmp_path), samples, BUDGETS, (), timeout=900)[0]
    _check(results, samples, BUDGETS)


@pytest.mark.packing
def test_multi_turn_step_cp2_equals_cp1(tiny, samples, tmp_path):  # noqa: F811
    one = run_distributed(_step, 1, tiny, str(tmp_path / "cp1"), samples, (32,), (), timeout=900)[0]
    two = run_distributed(
        _step, 2, tiny, str(tmp_path / "cp2"), samples, (32,), ("parallel.cp=2",), timeout=900
    )
    _check(one + two[0], samples, (32, 32))
