"""MoE policies in the trainer's passes: expert replay (rollout routing replay, R3) and the router metrics.

(Named ``moe_replay``, not "routing": in this project *routing* is SRPO's sample routing, GRPO vs SDPO,
in ``losses/routing.py``; the recipe key keeps its established name, ``rollout.routing_replay``.)

Rollout routing replay (``rollout.routing_replay: true``). MoE RL has a failure mode of its own: the engine
and the trainer route a token to different experts (bf16 vs fp32, other kernels, batch shapes), the
trainer-vs-engine log-prob gap grows and runs collapse. With replay on, the policy's scoring pass (π_old)
and training passes route every token to the experts the engine used when it generated the rollout
(``Sample.routed_experts``, ``rollout/routed_experts.py``), through megatron-core's own
``moe_enable_routing_replay``: each ``TopKRouter`` then holds a ``RouterReplay``; before each micro-batch's
forward :meth:`MoEReplay.before_forward` gives every router of this pipeline stage its layer's expert ids
for this rank's tokens (``set_target_indices``) under ``RouterReplayAction.REPLAY_FORWARD``, whose top-k
is those ids and whose gate probabilities are the trainer's own scores gathered at them (so gradients
still reach the router). The same ids are replayed when activation recompute re-runs the router in the
micro-batch's backward, under every pipeline schedule: ``compat/router_replay.py`` (``ReplayRouters``)
keeps them per (micro-batch, router) until then and switches megatron's router to ``REPLAY_BACKWARD``,
which megatron itself never does; the pass checks that nothing is left. The used API
(``router.router_replay``, ``set_target_indices``, ``set_router_replay_action``, ``clear_indices``,
``clear_router_replay_action``, ``replay_backward_list``) is the same in megatron-core 0.16.1 and 0.19.2;
``tests/unit/test_moe_replay.py`` fails if it changes.

The EMA teacher is never replayed: it scores the response under a different context (the sibling's
solution in its prompt, method §1.4), so the engine's expert choice for the student's context does not apply
to it; the trust-region teacher's student forward on the teacher prompt is not replayed either.

GLM-4.5 / DeepSeek-V3 (sigmoid router, expert bias, groups): megatron's ``REPLAY_FORWARD`` takes the
engine's experts as the selection, so neither the bias nor the group rule of the trainer enters, and weights
them with the trainer's sigmoid scores WITHOUT the bias gathered at them, normalised over the k and scaled
by ``routed_scaling_factor``: HF's (and SGLang's) weights for those experts
(``tests/dist/test_glm_moe_replay.py``). Dense first layers have no router: their (zero) rows of the
engine's report are never read. A report with SGLang's fused shared experts (``top_k + n_shared`` ids per
layer) keeps its routed columns (``as_token_layer_topk``).

Token order: megatron's router sees its micro-batch as ``[s, b]`` flattened (sequence-major), and under
sequence parallelism (MoE at TP > 1) only this TP rank's contiguous chunk of ``s``; packed micro-batches
are ``[T, 1]`` with sequences at ``cu_seqlens_q_padded``. :func:`router_token_map` says which (sequence,
position) each router token is. Positions the engine did not forward (each sequence's last token, whose
output predicts nothing kept) and padding get experts ``0..k-1``: causal attention means no kept row
depends on them.

Metrics (every step, from the scoring pass; ``models/moe_metrics.py``): expert load, router entropy
(over real tokens, each sequence's last token excluded) and, on response rows (the positions whose
logits give each response token's log-prob), the share of (token, layer) pairs whose trainer top-k
differs from the engine's. The DP, CP (each CP rank routes its chunks of every sequence), TP (under
sequence parallelism) and PP groups are summed explicitly.
"""

from __future__ import annotations

import contextlib

import torch

from srpo_megatron.compat.router_replay import ReplayRouters
from srpo_megatron.models.moe_metrics import RouterRecorder
from srpo_megatron.rollout.routed_experts import as_token_layer_topk
from srpo_megatron.trainer.microbatches.batches import MicroBatch, Sequence
from srpo_megatron.trainer.microbatches.packing import cp_index


def router_token_map(
    mb: MicroBatch,
    lengths: list[int],
    tp_rank: int,
    tp_size: int,
    sequence_parallel: bool,
    cp_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(member [T], position [T]) of each router token of ``mb`` on this rank, host int64: the index into
    the pass's sequences (-1 = padding) and the position in that sequence; ``lengths`` [N] sequence
    lengths. Order: megatron's ``[s, b]`` flattened; under context parallelism (``mb.cp_size`` > 1, packed)
    this CP rank's chunks of every sequence (``packing.cp_index``), which is what ``mb.tokens`` holds; then
    this TP rank's chunk of ``s`` under SP."""
    b, s = mb.tokens.shape
    s *= mb.cp_size  # the whole packed micro-batch; this CP rank's chunks are taken below
    if mb.packed is None:
        member = torch.tensor([-1 if m is None else m for m in mb.members], dtype=torch.long).expand(s, b)
        position = torch.arange(s, dtype=torch.long).unsqueeze(1).expand(s, b)
    else:
        cu = mb.packed.cu_seqlens_q_padded
        cu = (mb.packed.cu_seqlens_q if cu is None else cu).tolist()
        member = torch.full((s, 1), -1, dtype=torch.long)
        position = torch.zeros(s, 1, dtype=torch.long)
        for j, m in enumerate(mb.members):
            if m is None:  # a filler (trainer/microbatches/lockstep.py): padding only
                continue
            member[cu[j] : cu[j + 1], 0] = m
            position[cu[j] : cu[j + 1], 0] = torch.arange(cu[j + 1] - cu[j])
        if mb.cp_size > 1:
            index = cp_index(torch.tensor(cu), mb.cp_size, cp_rank)
            member, position = member[index], position[index]
    member, position = member.reshape(-1).clone(), position.reshape(-1).clone()
    length = torch.tensor([*lengths, 0], dtype=torch.long)[member]  # member -1 -> the appended 0
    member[position >= length] = -1
    if sequence_parallel and tp_size > 1:
        n = member.numel() // tp_size
        member, position = member[tp_rank * n : (tp_rank + 1) * n], position[tp_rank * n : (tp_rank + 1) * n]
    return member, position


class MoEReplay(contextlib.AbstractContextManager):
    """One pass of the policy over ``micro``: replays the engine's experts (``replay``) and/or records the
    router metrics (``record``). Give :meth:`before_forward` to ``run_schedule``."""

    def __init__(
        self,
        policy,
        seqs: list[Sequence],
        routed: list[torch.Tensor | None],
        micro: list[MicroBatch],
        *,
        replay: bool,
        record: bool,
    ) -> None:
        g, arch = policy.groups, policy.arch
        self.policy, self.seqs, self.micro = policy, seqs, micro
        self.replay, self.num_layers, self.top_k = replay, arch.num_layers, arch.moe_top_k
        self.routers = [m for n, m in policy.model.named_modules() if n.endswith("mlp.router")]
        self.sp = bool(policy.tconfig.sequence_parallel)
        self.tp_rank, self.tp_size, self.cp_rank = g.tp_rank, g.tp_size, g.cp_rank
        missing = [i for i, r in enumerate(routed) if r is None]
        if replay and missing:
            raise RuntimeError(
                f"rollout.routing_replay=true but the engine reported no routed experts for {len(missing)} "
                "samples; SGLang servers need --enable-return-routed-experts (and an MoE model)"
            )
        # [P + R - 1, layers, k] per sequence (its forwarded positions), None where not reported.
        shared = arch.shared_expert_intermediate_size // max(arch.moe_intermediate_size, 1)
        self.routed = [
            None
            if r is None
            else as_token_layer_topk(r, self.num_layers, self.top_k, len(s.ids) - 1, fused_shared=shared)
            for r, s in zip(routed, seqs, strict=True)
        ]
        self.recorder = RouterRecorder(policy.model, self.num_layers, arch.num_experts) if record else None
        self._stack = contextlib.ExitStack()
        self._replay: ReplayRouters | None = None
        self._failed = False

    def __enter__(self) -> MoEReplay:
        if self.replay:
            self._replay = self._stack.enter_context(ReplayRouters(self.routers))
            self._stack.callback(self._check_consumed)  # runs first on exit: the FIFOs are still there
        if self.recorder is not None:
            self._stack.enter_context(self.recorder)
        return self

    def __exit__(self, *exc) -> None:
        self._failed = exc[0] is not None
        self._stack.close()

    def _check_consumed(self) -> None:
        if not self._failed:
            self._replay.check_consumed()

    def before_forward(self, k: int) -> None:
        """Set micro-batch ``k``'s replay targets and metric context (runs just before its forward)."""
        member, position = router_token_map(
            self.micro[k], [len(s.ids) for s in self.seqs], self.tp_rank, self.tp_size, self.sp, self.cp_rank
        )
        t = member.numel()
        # int16 on the host and over the copy (-1 = no report; ids < 32768), int64 only per layer on device.
        engine = torch.full((t, self.num_layers, self.top_k), -1, dtype=torch.int16)
        response = torch.zeros(t, dtype=torch.bool)
        last = torch.zeros(t, dtype=torch.bool)  # each sequence's last token: never forwarded by the engine
        for m in member.unique().tolist():
            if m < 0:
                continue
            here = member == m
            seq = self.seqs[m]
            last |= here & (position == len(seq.ids) - 1)
            if self.routed[m] is None:
                continue
            known = here & (position < self.routed[m].shape[0])
            engine[known] = self.routed[m][position[known]].to(torch.int16)
            response |= here & (position >= seq.first) & (position < seq.first + seq.num_rows)
        dev = self.policy.device
        engine = engine.to(dev)
        if self.replay:
            filler = torch.arange(self.top_k, dtype=torch.long, device=dev).expand(t, self.top_k)

            def ids(router) -> torch.Tensor:
                layer = engine[:, router.layer_number - 1].long()
                return torch.where(layer < 0, filler, layer)

            self._replay.set_targets(self.routers, ids)
        if self.recorder is not None:
            real = (member >= 0) & ~last
            has_engine = any(r is not None for r in self.routed)
            self.recorder.set_micro_batch(
                real.to(dev), response.to(dev) if has_engine else None, engine if has_engine else None
            )

    def summary(self) -> dict[str, float]:
        """The pass's router metrics, identical on every rank (collective over DP, CP, TP under SP, PP)."""
        assert self.recorder is not None
        g = self.policy.groups
        groups = [g.dp, g.cp, g.pp, *([g.tp] if self.sp else [])]
        return self.recorder.summary(groups)


def moe_replay_for(policy, seqs, samples, micro, *, record: bool) -> MoEReplay | None:
    """The pass's ``MoEReplay`` for an MoE policy (None for a dense one, or with nothing to do)."""
    replay = policy.cfg.rollout.routing_replay
    if not policy.arch.is_moe or not (replay or record):
        return None
    return MoEReplay(policy, seqs, [s.routed_experts for s in samples], micro, replay=replay, record=record)
