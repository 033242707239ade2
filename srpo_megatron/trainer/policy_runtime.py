"""The Megatron side of a training step: policy + EMA teacher, scoring pass, training pass, optimizer.

Both passes go through megatron's real schedules (``get_forward_backward_func``: no-pipelining or 1F1B),
so TP/PP/DP behave exactly as in Megatron-LM. Sequences are ``prompt + response`` right-padded to one
length per step (PP needs fixed p2p shapes); row t of a sample is the logit position that predicts
response token t. Rows are taken from the ``[b, S, V/TP]`` logits shard with a ``[b, S]`` mask, in sample
then position order, which is the order of the flat per-token tensors of ``losses.TokenBatch``.

Loss scaling: ``routed_loss`` returns each micro-batch's share of the global objective (global token
denominator), so gradients must be *summed* over micro-batches and DP ranks. Megatron divides the loss by
the number of micro-batches and DDP averages over DP, hence the ``num_microbatches · dp_size`` factor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from srpo_megatron.conversion.checkpoint import load_policy_checkpoint
from srpo_megatron.conversion.safetensors_io import HFCheckpointReader
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.conversion.weights import load_hf_weights
from srpo_megatron.losses import (
    Normalizers,
    TokenBatch,
    global_normalizers,
    routed_loss,
    score_student,
    score_teacher,
)
from srpo_megatron.models import performance as perf_choice
from srpo_megatron.models.architecture import Architecture, padded_vocab_size
from srpo_megatron.models.performance import Accelerators
from srpo_megatron.models.policy import build_policy
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.trainer.config import TrainConfig
from srpo_megatron.trainer.rollouts import Sample

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class MicroBatch:
    """Input of one forward: tokens [b, S], row mask [b, S] and which samples (None = padding) it holds."""

    tokens: torch.Tensor
    rows: torch.Tensor
    samples: list[int | None]


def make_micro_batches(
    seqs: list[tuple[list[int], int, int]], micro_batch_size: int, seq_len: int
) -> list[MicroBatch]:
    """``seqs[k] = (tokens, first_row, num_rows)`` → micro-batches of exactly ``micro_batch_size`` rows."""
    out = []
    for start in range(0, len(seqs), micro_batch_size):
        tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        rows = torch.zeros(micro_batch_size, seq_len, dtype=torch.bool)
        members: list[int | None] = []
        for b in range(micro_batch_size):
            k = start + b
            if k >= len(seqs):
                members.append(None)
                continue
            ids, first, n = seqs[k]
            tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            rows[b, first : first + n] = True
            members.append(k)
        out.append(MicroBatch(tokens, rows, members))
    return out


def student_seqs(samples: list[Sample]) -> list[tuple[list[int], int, int]]:
    # Logits at position p predict token p+1: response token t sits at len(prompt)+t, its row is one earlier.
    return [(s.prompt_ids + s.response_ids, len(s.prompt_ids) - 1, len(s.response_ids)) for s in samples]


def teacher_seqs(samples: list[Sample]) -> list[tuple[list[int], int, int]]:
    out = []
    for s in samples:
        assert s.teacher_prompt_ids is not None
        out.append(
            (s.teacher_prompt_ids + s.response_ids, len(s.teacher_prompt_ids) - 1, len(s.response_ids))
        )
    return out


def padded_len(seqs: list[tuple[list[int], int, int]], multiple: int = 8) -> int:
    longest = max((len(t) for t, _, _ in seqs), default=1)
    return int(math.ceil(longest / multiple) * multiple)


class PolicyRuntime:
    """Owns the policy (DDP-wrapped), its optimizer and LR schedule, and the self-teacher."""

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.cfg, self.groups = cfg, groups
        self.arch = Architecture.from_hf(cfg.model.hf_dir)
        self.table = ConversionTable(self.arch)
        # GPU defaults (bf16 + fp32 main params, TE spec, SP, fusions, overlap, recompute): see performance.py
        acc, perf = Accelerators.detect(), cfg.performance
        dtype = perf_choice.params_dtype(cfg.model.params_dtype, acc)
        sp = perf_choice.sequence_parallel(cfg.parallel.sequence_parallel, groups.tp_size, acc)
        overrides = perf_choice.transformer_overrides(perf, sequence_parallel=sp, acc=acc)
        use_te = perf_choice.use_transformer_engine(perf, acc)
        build = lambda: build_policy(  # noqa: E731
            self.arch,
            params_dtype=dtype,
            max_sequence_length=cfg.model.max_sequence_length,
            use_te=use_te,
            **overrides,
        )
        torch.manual_seed(cfg.run.seed)
        self.model = build()
        self._load_initial(self.model)
        self.tconfig = self.model.config
        ddp_config = perf_choice.ddp_config(
            perf, distributed_optimizer=cfg.parallel.distributed_optimizer, acc=acc
        )
        self.ddp = DistributedDataParallel(self.tconfig, ddp_config, self.model)
        # Megatron's schedules reduce grads over DP (and tied embeddings over PP) only via this hook.
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        perf_choice.wire_overlap(self.tconfig, self.ddp)
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            perf_choice.optimizer_config(o, dtype=dtype, ddp=ddp_config), [self.ddp]
        )
        total = max(cfg.train.steps * cfg.train.mini_batches, o.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=total,
            lr_decay_style="constant",
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=total,
            wd_incr_style="constant",
        )
        self.teacher: torch.nn.Module | None = None
        if cfg.loss.mode != "grpo":
            self.teacher = build()
            self.teacher.load_state_dict(self.model.state_dict())
            self.teacher.requires_grad_(False)
            self.teacher.eval()
        # Padded vocabulary rows (TP·128 multiple) are not tokens: mask them out of every softmax.
        v_pad = padded_vocab_size(self.arch.vocab_size, groups.tp_size)
        shard = v_pad // groups.tp_size
        ids = torch.arange(groups.tp_rank * shard, (groups.tp_rank + 1) * shard)
        self._vocab_pad = ids >= self.arch.vocab_size
        self._fb = None

    # ------------------------------------------------------------------------------------------ set-up

    def _load_initial(self, model: torch.nn.Module) -> None:
        ckpt = self.cfg.model.megatron_checkpoint
        with torch.no_grad():
            if ckpt:
                load_policy_checkpoint(model, ckpt)
            else:
                reader = HFCheckpointReader(self.cfg.model.hf_dir)
                try:
                    load_hf_weights(model, self.table, reader.get)
                finally:
                    reader.close()

    @property
    def forward_backward(self) -> Callable:
        if self._fb is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            self._fb = get_forward_backward_func()
        return self._fb

    def _logits_rows(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[b, S, V/TP] logits → [T, V/TP] rows (padded vocabulary ids masked to a huge negative)."""
        out = logits[rows]
        if bool(self._vocab_pad.any()):
            out = out.masked_fill(self._vocab_pad.to(out.device), torch.finfo(out.dtype).min / 4)
        return out

    def _run(
        self,
        model: torch.nn.Module,
        micro_batches: list[MicroBatch],
        seq_len: int,
        on_rows: Callable[[torch.Tensor, int], torch.Tensor | None],
        forward_only: bool,
    ) -> None:
        """Run the schedule; ``on_rows(row_logits, mb_index)`` is called on the last stage per micro-batch."""
        index = iter(range(len(micro_batches)))
        positions = torch.arange(seq_len).unsqueeze(0)

        def forward_step(data_iterator, m):
            k = next(data_iterator)
            mb = micro_batches[k]
            out = m(mb.tokens, positions, None)

            def loss_func(logits):
                loss = on_rows(self._logits_rows(logits, mb.rows), k)
                if loss is None:
                    loss = logits.sum() * 0.0
                return loss, {}

            return out, loss_func

        self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=index,
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=micro_batches[0].tokens.shape[0],
            forward_only=forward_only,
        )

    # -------------------------------------------------------------------------------------- scoring pass

    @torch.no_grad()
    def score(self, samples: list[Sample]) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """method §3 scoring pass. Returns per-sample stored tensors (last stage only) and teacher forwards run.

        Student (all samples): old log-probs [R] and, for SDPO samples, top-K ids [R, K]. Teacher (only
        samples that need it): top-K+tail log-probs [R, K+1], entropy [R], sampled-token log-prob [R].
        """
        t0 = time.monotonic()
        cfg, g = self.cfg, self.groups
        mbs = cfg.train.micro_batch_size
        stored: list[dict[str, torch.Tensor]] = [{} for _ in samples]
        seqs = student_seqs(samples)
        seq_len = padded_len(seqs)
        micro = make_micro_batches(seqs, mbs, seq_len)
        k_top = cfg.loss.top_k

        def on_student(rows_logits: torch.Tensor, k: int) -> None:
            members = [i for i in micro[k].samples if i is not None]
            resp = torch.cat([torch.tensor(samples[i].response_ids) for i in members])
            topk_rows = torch.cat(
                [torch.full((len(samples[i].response_ids),), samples[i].sdpo) for i in members]
            )
            score = score_student(
                rows_logits, resp, topk_rows, k_top, g.tp, cfg.loss.temperature, cfg.loss.chunk_tokens or None
            )
            start = 0
            for i in members:
                n = len(samples[i].response_ids)
                stored[i]["old_logp"] = score.old_logp[start : start + n].float()
                if samples[i].sdpo:
                    stored[i]["topk_ids"] = score.topk_ids[start : start + n]
                start += n

        self.ddp.eval()
        self._run(self.ddp, micro, seq_len, on_student, forward_only=True)
        self.ddp.train()

        t_student = time.monotonic() - t0
        wanted = [i for i, s in enumerate(samples) if s.needs_teacher]
        if wanted and self.teacher is not None:
            t_samples = [samples[i] for i in wanted]
            t_seqs = teacher_seqs(t_samples)
            t_len = padded_len(t_seqs)
            t_micro = make_micro_batches(t_seqs, mbs, t_len)
            mix = cfg.teacher.kind == "trust_region"
            teacher_rows = [0]  # samples the teacher forward actually scored (checked by the tests)
            student_logits: dict[int, torch.Tensor] = {}
            if mix:  # log q = (1−α) log q_ref + α log q_θ  ⇔  logits mix (the log-normaliser is shared)
                self.ddp.eval()
                self._run(
                    self.ddp, t_micro, t_len, lambda r, k: student_logits.__setitem__(k, r), forward_only=True
                )
                self.ddp.train()

            def on_teacher(rows_logits: torch.Tensor, k: int) -> None:
                if mix:
                    a = cfg.teacher.ema_alpha
                    rows_logits = (1 - a) * rows_logits + a * student_logits[k]
                members = [wanted[j] for j in t_micro[k].samples if j is not None]
                teacher_rows[0] += len(members)
                resp = torch.cat([torch.tensor(samples[i].response_ids) for i in members])
                # Rows of samples that need a teacher but take no SDPO loss (advantage_mix) use the
                # student's top-1 id: only the sampled-token log-prob is used for them.
                ids = torch.cat(
                    [
                        stored[i].get(
                            "topk_ids", torch.zeros(len(samples[i].response_ids), k_top, dtype=torch.long)
                        )
                        for i in members
                    ]
                )
                ts = score_teacher(
                    rows_logits, ids, g.tp, cfg.loss.temperature, resp, cfg.loss.chunk_tokens or None
                )
                start = 0
                for i in members:
                    n = len(samples[i].response_ids)
                    stored[i]["teacher_logp"] = ts.logp[start : start + n].float()
                    stored[i]["teacher_entropy"] = ts.entropy[start : start + n].float()
                    stored[i]["teacher_token_logp"] = ts.token_logp[start : start + n].float()
                    start += n

            self._run(self.teacher, t_micro, t_len, on_teacher, forward_only=True)
        runs = teacher_rows[0] if wanted and self.teacher is not None else 0
        return stored, {
            "teacher_runs": float(runs),
            "score_s": t_student,
            "teacher_s": time.monotonic() - t0 - t_student,
        }

    # ------------------------------------------------------------------------------------- training pass

    def token_batch(self, samples: list[Sample], stored: list[dict], members: list[int]) -> TokenBatch:
        """Flat per-token tensors of ``members`` (indices into samples), in row order."""
        k = self.cfg.loss.top_k

        def cat(fn):
            return torch.cat([fn(i) for i in members]) if members else torch.zeros(0)

        n = lambda i: len(samples[i].response_ids)  # noqa: E731
        has_teacher = [i for i in members if "teacher_logp" in stored[i]]
        full = lambda i, key, shape, dtype=torch.float32: stored[i].get(key, torch.zeros(shape, dtype=dtype))  # noqa: E731
        return TokenBatch(
            response_ids=cat(lambda i: torch.tensor(samples[i].response_ids, dtype=torch.long)),
            mask=cat(lambda i: torch.ones(n(i), dtype=torch.bool)),
            advantages=cat(lambda i: torch.full((n(i),), samples[i].advantage, dtype=torch.float32)),
            grpo=cat(lambda i: torch.full((n(i),), samples[i].grpo, dtype=torch.bool)),
            sdpo=cat(lambda i: torch.full((n(i),), samples[i].sdpo, dtype=torch.bool)),
            old_logp=cat(lambda i: stored[i]["old_logp"]),
            rollout_logp=cat(lambda i: torch.tensor(samples[i].rollout_logp, dtype=torch.float32)),
            topk_ids=cat(lambda i: full(i, "topk_ids", (n(i), k), torch.long)),
            teacher_logp=cat(lambda i: full(i, "teacher_logp", (n(i), k + 1))),
            teacher_entropy=cat(lambda i: full(i, "teacher_entropy", (n(i),))),
            teacher_token_logp=cat(lambda i: full(i, "teacher_token_logp", (n(i),))),
            teacher=cat(lambda i: torch.full((n(i),), i in has_teacher, dtype=torch.bool)),
        )

    def train_step(self, samples: list[Sample], stored: list[dict]) -> dict[str, float]:
        """One optimizer step on ``samples`` (this DP rank's share): summed loss metrics and grad norm."""
        cfg, g = self.cfg, self.groups
        seqs = student_seqs(samples)
        seq_len = padded_len(seqs)
        micro = make_micro_batches(seqs, cfg.train.micro_batch_size, seq_len)
        last = g.is_last_stage
        batches = (
            [self.token_batch(samples, stored, [i for i in mb.samples if i is not None]) for mb in micro]
            if last
            else []
        )
        # Global normalisers: token count, |Ω_sdpo|, Σw̃ over all micro-batches and the DP group.
        normalizers = (
            global_normalizers(batches, cfg.loss.beta, g.dp if g.dp_size > 1 else None)
            if last
            else Normalizers(1.0, 0.0, 0.0)
        )
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        scale = len(micro) * g.dp_size

        def on_rows(rows_logits: torch.Tensor, k: int) -> torch.Tensor:
            loss, metrics = routed_loss(rows_logits, batches[k], normalizers, cfg.loss, g.tp)
            for key, v in metrics.items():
                if key.endswith("_max"):
                    maxes[key] = max(maxes.get(key, 0.0), float(v))
                else:
                    sums[key] = sums.get(key, 0.0) + float(v)
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            return loss * scale

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        if last and normalizers.num_tokens <= 0:
            raise RuntimeError("the training batch has no response tokens; check rollout.max_new_tokens")
        self._run(self.ddp, micro, seq_len, on_rows, forward_only=False)
        finite = self._grads_finite() and math.isfinite(sums.get("loss", 0.0))
        finite = _all_true(finite)
        skipped = 0.0
        grad_norm = float("nan")
        if finite or not cfg.train.skip_nonfinite:
            ok, grad_norm, _ = self.optimizer.step()
            perf_choice.finish_param_gather(self.ddp)  # full weights before EMA / sync / save read them
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if ok and math.isfinite(grad_norm):
                self.scheduler.step(1)
            else:
                skipped = 1.0
        else:
            skipped = 1.0
            self.optimizer.zero_grad()
        out = {**sums, **{k: v for k, v in maxes.items()}}
        if last:  # w~ = exp(−β·H) over this rank's SDPO tokens, for the logged mean and spread
            w = torch.cat(
                [torch.exp(-cfg.loss.beta * b.teacher_entropy[b.sdpo & b.mask].double()) for b in batches]
            )
            out["w_tilde_sum"], out["w_tilde_sq_sum"] = float(w.sum()), float((w**2).sum())
        out["grad_norm"] = grad_norm
        out["skipped"] = skipped
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        return out

    def _grads_finite(self) -> bool:
        for p in self.model.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is not None and not bool(torch.isfinite(grad).all()):
                return False
        return True

    @torch.no_grad()
    def update_teacher(self) -> None:
        """θ′ ← (1−α)θ′ + αθ (EMA); nothing for the frozen and trust-region teachers."""
        if self.teacher is None or self.cfg.teacher.kind != "ema":
            return
        a = self.cfg.teacher.ema_alpha
        for pt, ps in zip(self.teacher.parameters(), self.model.parameters(), strict=True):
            pt.mul_(1.0 - a).add_(ps.detach().to(pt.dtype), alpha=a)


def _all_true(flag: bool) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([0.0 if flag else 1.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0
