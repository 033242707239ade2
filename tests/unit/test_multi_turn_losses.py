"""Multi-turn samples in the trainer's losses: tool/user tokens are context only, and SRPO's teacher sees
the correct sibling's whole trajectory.

Hand-made two-turn trajectories on the packaged Qwen3 tokenizer (assistant turn with a think block and a
tool call, the chat template's tool turn, a final assistant turn), routed by the real ``route_groups``
and laid out by the real ``sample_tokens`` (where ``Sample.response_mask`` is folded into the batch mask):

- perturbing the student's, π_old's and the teacher's outputs at the tool rows only changes neither the
  loss nor any gradient nor any metric, bit for bit, in GRPO, SDPO and the routed objective (both
  aggregations, and token-level MIS, which rejects rows);
- the routed loss and its gradient equal an independent float64 reference (``ref_routed_loss`` with the
  assistant mask), and the SDPO samples' teacher prompt ids equal the hand-written rendering of the
  sibling's trajectory (each turn cleaned by SDPO's think rule);
- planted: single-turn masks (``assistant_rows`` ignoring ``response_mask``) are caught by both.

``mt_completion`` builds a completion the way the multi-turn rollout does (its ``Trajectory`` in ``meta``).
The loss part maps the real token ids into a 48-id vocabulary (the reference materialises [T, V]).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srpo_megatron.config import LossConfig, TeacherConfig
from srpo_megatron.data.assets import qwen3_tokenizer
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.rows import Row
from srpo_megatron.losses import (
    apply_rejections,
    global_normalizers,
    routed_loss,
    score_student,
    score_teacher,
    sequence_weights,
)
from srpo_megatron.rollout.base import Completion
from srpo_megatron.rollout.multi_turn import Trajectory
from srpo_megatron.trainer.collect.sample_routing import route_groups, trajectory_messages
from srpo_megatron.trainer.microbatches import batches
from srpo_megatron.trainer.microbatches.batches import row_offsets, sample_tokens
from tests.helpers.losses_reference import ref_log_softmax, ref_routed_loss, rel_err
from tests.helpers.losses_scenario import ref_cfg

V = 48
REWARDS = [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
ROW = Row("What is the sum? Use the calculator.", "You are a careful solver.", "5", "math", "t", "t:1")


def mt_completion(i: int, ids: list[int], logp: list[float], mask: list[int]) -> Completion:
    """A multi-turn completion as the rollout driver leaves it: its ``Trajectory`` bookkeeping (1 = the
    engine's token, 0 = a tool turn's) in ``Completion.meta``."""
    return Completion(i, ids, logp, "stop", meta={"multi_turn": Trajectory(response_mask=mask).to_meta()})


def _turns(i: int, j: int) -> list[tuple[str, int]]:
    """(text, mask) of sample (i, j)'s response: assistant, the template's tool turn, assistant."""
    a = i + j
    call = f'<tool_call>\n{{"name": "calc", "arguments": {{"expr": "{i}+{j}"}}}}\n</tool_call>'
    return [
        (f"<think>\nTry {i} and {j}{' carefully' * j}.\n</think>\n\n{call}<|im_end|>", 1),
        (
            f"\n<|im_start|>user\n<tool_response>\n{a}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
            0,
        ),
        (f"The answer is {a}{'!' * i}.<|im_end|>", 1),
    ]


def expected_shown(i: int, j: int) -> str:
    """What the teacher must be shown of sibling (i, j), written by hand: think blocks gone per turn,
    special tokens skipped, the tool turn's text as the template rendered it."""
    call = f'<tool_call>\n{{"name": "calc", "arguments": {{"expr": "{i}+{j}"}}}}\n</tool_call>'
    tool = f"\nuser\n<tool_response>\n{i + j}\n</tool_response>\nassistant\n"
    return f"{call}{tool}The answer is {i + j}{'!' * i}."


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def routed(tok):
    """``route_groups`` on the hand-made trajectories: mode → the routed samples."""
    gen = torch.Generator().manual_seed(3)
    prompt_ids = tok.apply_chat_template(
        [{"role": "system", "content": ROW.system}, {"role": "user", "content": ROW.prompt}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        enable_thinking=False,
    )["input_ids"]
    prompts, groups, texts = [], [], []
    for i, rewards in enumerate(REWARDS):
        prompts.append(Prompt(tuple(prompt_ids), ROW))  # the student's prompt (not shown to the teacher)
        group = []
        for j in range(len(rewards)):
            ids, mask = [], []
            for text, m in _turns(i, j):
                seg = tok(text, add_special_tokens=False)["input_ids"]
                ids += seg
                mask += [m] * len(seg)
            logp = [(-3 * float(torch.rand((), generator=gen))) if m else 0.0 for m in mask]
            group.append(mt_completion(i, ids, logp, mask))
        groups.append(group)
        texts.append([tok.decode(c.token_ids, skip_special_tokens=True) for c in group])
    return {
        mode: route_groups(
            tok, prompts, groups, texts, REWARDS, LossConfig(mode=mode), TeacherConfig()
        ).samples
        for mode in ("srpo", "grpo", "sdpo")
    }


def test_trajectory_messages_split_and_clean(tok):
    ids, mask = [], []
    for text, m in _turns(1, 2):
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + seg, mask + [m] * len(seg)
    msgs = trajectory_messages(tok, ids, mask)
    assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"]
    assert "".join(m["content"] for m in msgs) == expected_shown(1, 2)
    with pytest.raises(ValueError, match="response_mask of 3 entries"):
        trajectory_messages(tok, ids, [1, 0, 1])


def test_teacher_prompt_is_the_siblings_rendered_trajectory(tok, routed):
    """The failed samples of mixed groups carry a teacher prompt whose user turn shows the first correct
    sibling's trajectory (hand-written above), through the solution template and the chat template."""
    cfg = TeacherConfig()
    seen = 0
    for s in routed["srpo"]:
        assert s.response_mask is not None and len(s.response_mask) == len(s.response_ids)
        if not s.needs_teacher:
            assert s.teacher_prompt_ids is None
            continue
        sib = next(j for j, r in enumerate(REWARDS[s.group]) if r == 1.0)
        user = cfg.solution_template.format(
            user_prompt=ROW.prompt, sibling_response=expected_shown(s.group, sib)
        )
        want = tok.apply_chat_template(
            [{"role": "system", "content": ROW.system}, {"role": "user", "content": user}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            enable_thinking=False,
        )["input_ids"]
        assert s.teacher_prompt_ids == list(want)[: cfg.max_prompt_tokens]
        seen += 1
    assert seen == 3, "groups [1,0,0] and [0,1,1]: three failed samples with a correct sibling"


# ------------------------------------------------------------------------------------ the losses


@dataclasses.dataclass
class Outputs:
    """The models' outputs at every response row: student logits x [T, V], π_old's logits, teacher's."""

    student: torch.Tensor
    old: torch.Tensor
    teacher: torch.Tensor


def _small(samples):
    return [dataclasses.replace(s, response_ids=[t % V for t in s.response_ids]) for s in samples]


def _outputs(t: int, seed: int = 0) -> Outputs:
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(t, V, generator=g, dtype=torch.float64)
    return Outputs(
        x,
        x + 0.6 * torch.randn(t, V, generator=g, dtype=torch.float64),
        x + torch.randn(t, V, generator=g, dtype=torch.float64),
    )


def _ours(samples, out: Outputs, cfg: LossConfig):
    """The trainer's flow in float64: ``sample_tokens`` (mask folded), the scoring pass's fills
    (π_old, top-K, teacher on the teacher samples' rows), rejections, sequence weights, ``routed_loss``."""
    tokens = sample_tokens(samples, cfg.top_k, torch.device("cpu"))
    tokens = dataclasses.replace(
        tokens,
        advantages=tokens.advantages.double(),
        rollout_logp=tokens.rollout_logp.double(),
        teacher_logp=tokens.teacher_logp.double(),
        teacher_entropy=tokens.teacher_entropy.double(),
        teacher_token_logp=tokens.teacher_token_logp.double(),
    )
    offsets = row_offsets(samples)
    tokens.old_logp = ref_log_softmax(out.old).gather(1, tokens.response_ids[:, None]).squeeze(1)
    tokens.topk_ids = score_student(out.student, tokens.response_ids, tokens.sdpo, cfg.top_k, None).topk_ids
    rows = torch.tensor(
        [r for i, s in enumerate(samples) if s.needs_teacher for r in range(offsets[i], offsets[i + 1])]
    )
    if rows.numel():
        ts = score_teacher(out.teacher[rows], tokens.topk_ids[rows], None, 1.0, tokens.response_ids[rows])
        tokens.teacher_logp[rows] = ts.logp
        tokens.teacher_entropy[rows] = ts.entropy
        tokens.teacher_token_logp[rows] = ts.token_logp
        tokens.teacher[rows] = True
    if cfg.rejects_tokens:
        apply_rejections(tokens, cfg, offsets)
    if cfg.aggregation == "seq_mean_token_mean":
        tokens.seq_weight = sequence_weights(tokens.mask, offsets)
    x = out.student.clone().requires_grad_()
    loss, metrics = routed_loss(x, tokens, global_normalizers([tokens], cfg.beta), cfg)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g, {k: v.detach() for k, v in metrics.items()}


def _tool_rows(samples) -> torch.Tensor:
    return torch.tensor([m == 0 for s in samples for m in s.response_mask])


def _perturbed(out: Outputs, tool: torch.Tensor) -> Outputs:
    g = torch.Generator().manual_seed(99)

    def noise(x: torch.Tensor) -> torch.Tensor:
        return x + torch.where(tool[:, None], 5.0 * torch.randn(x.shape, generator=g, dtype=x.dtype), 0.0)

    return Outputs(noise(out.student), noise(out.old), noise(out.teacher))


CASES = [
    ("grpo", "token_mean", "tis"),
    ("sdpo", "token_mean", "tis"),
    ("srpo", "token_mean", "tis"),
    ("srpo", "seq_mean_token_mean", "tis"),
    ("srpo", "token_mean", "mis"),
]


def _cfg(mode, aggregation, correction):
    extra = (
        dict(is_correction="mis", is_level="token", is_low=0.05, is_high=20.0) if correction == "mis" else {}
    )
    return LossConfig(mode=mode, top_k=4, aggregation=aggregation, **extra)


def _check_tool_rows_inert(samples, cfg) -> None:
    tool = _tool_rows(samples)
    assert tool.any() and (~tool).any()
    out = _outputs(len(tool))
    loss, grad, metrics = _ours(samples, out, cfg)
    loss2, grad2, metrics2 = _ours(samples, _perturbed(out, tool), cfg)
    assert float(loss) != 0.0
    assert torch.equal(loss, loss2), f"the loss moved with the tool rows: {float(loss)} → {float(loss2)}"
    assert torch.equal(grad, grad2), "a gradient moved with the tool rows"
    assert not grad[tool].any(), "a tool row has a gradient"
    assert metrics.keys() == metrics2.keys()
    for k in metrics:
        assert torch.equal(metrics[k], metrics2[k]), f"metric {k} moved with the tool rows"
    if not cfg.rejects_tokens:  # MIS drops some assistant rows from the count as well
        assert float(metrics["tokens"]) == float((~tool).sum())


@pytest.mark.parametrize("mode,aggregation,correction", CASES)
def test_tool_tokens_take_no_loss_no_gradient_no_count(routed, mode, aggregation, correction):
    _check_tool_rows_inert(_small(routed[mode]), _cfg(mode, aggregation, correction))


@pytest.mark.parametrize(
    "mode,aggregation",
    [("srpo", "token_mean"), ("srpo", "seq_mean_token_mean"), ("grpo", "token_mean"), ("sdpo", "token_mean")],
)
def test_trajectory_srpo_matches_float64_reference(routed, mode, aggregation):
    samples = _small(routed[mode])
    cfg = _cfg(mode, aggregation, "tis")
    out = _outputs(sum(len(s.response_ids) for s in samples), seed=1)
    loss, grad, _ = _ours(samples, out, cfg)
    mask = ~_tool_rows(samples)
    x = out.student.clone().requires_grad_()
    ref = ref_routed_loss(
        x,
        out.teacher,
        REWARDS,
        [i for i, s in enumerate(samples) for _ in s.response_ids],
        torch.tensor([t for s in samples for t in s.response_ids]),
        mask,
        ref_log_softmax(out.old)
        .gather(1, torch.tensor([t for s in samples for t in s.response_ids])[:, None])
        .squeeze(1),
        torch.tensor([v for s in samples for v in s.rollout_logp], dtype=torch.float32).double(),
        ref_cfg(cfg),
    )
    (ref_g,) = torch.autograd.grad(ref, x)
    assert abs(float(loss) - float(ref)) <= 1e-6 * abs(float(ref))
    assert rel_err(grad, ref_g) < 1e-6
    assert not ref_g[~mask].any()


def test_planted_single_turn_mask_is_caught(routed, monkeypatch):
    """Planted: the batch mask built as if single-turn (``response_mask`` ignored) — the inert-rows check
    and the reference both fail."""
    monkeypatch.setattr(batches, "assistant_rows", lambda s: [True] * len(s.response_ids))
    with pytest.raises(AssertionError):
        _check_tool_rows_inert(_small(routed["srpo"]), _cfg("srpo", "token_mean", "tis"))
    with pytest.raises(AssertionError):
        test_trajectory_srpo_matches_float64_reference(routed, "srpo", "token_mean")


def test_a_mask_of_the_wrong_length_is_refused(routed):
    bad = dataclasses.replace(routed["srpo"][0], response_mask=[1, 0])
    with pytest.raises(ValueError, match="response_mask of 2 entries"):
        sample_tokens([bad], 4, torch.device("cpu"))
