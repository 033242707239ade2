"""Benchmark: one CPU-demo step, phase by phase, against a plain transformers forward+backward on the same
tokens, in the same process, so the next drift in the demo's wall time shows as a ratio.

The demo's recipe (``examples/smollm2_arith_cpu.yaml``) with the demo's prepared model (``tools/demo.sh``
writes ``.cache/smollm2-hf`` and ``.cache/smollm2-mcore``), built as ``srpo train`` builds it
(``srpo_megatron/train.py``), then one step timed by the trainer's own phases: ``generate`` and ``reward``
(``rollouts.next_batch``), ``score`` and ``teacher`` (``scoring_pass``), ``train`` (``learn``), ``ema``
(``update_teacher``), ``sync`` (weight sync into the transformers engine), and ``save``: the checkpoint the
demo writes once after its last step (``save_checkpoint``; its parts ``save/dist_checkpointing_s``,
``save/extras_s``, ``save/digest_s`` (fsync + SHA-256 of every file) and ``save/finalize_s``).

The reference: ``transformers``' own model from the same HF folder, fp32, fed the step's sequences (prompt
+ response) in the trainer's micro-batches (``train.micro_batch_size`` rows, right-padded to the batch's
longest sequence rounded up to 8, as ``trainer/microbatches/batches.py`` pads), a forward+backward of the
summed response-token log-probs, timed ``--repeats`` times (median); and the same forward under ``no_grad``.
``ratio_train_vs_hf`` = ``train_s`` / HF forward+backward; ``ratio_score_vs_hf`` = ``score_s`` / HF forward.
The training pass also runs a top-K divergence and the routed loss, so a ratio near 1-1.5 is expected; a
ratio that grows between commits is the drift this tool exists to show. The machine's load average is
printed before and after: other processes share these cores, so compare ratios within one run, never
seconds across runs.

Usage: ``python tools/bench_demo_step.py [--hf-dir .cache/smollm2-hf --mcore-dir .cache/smollm2-mcore
--repeats 2 --no-save --profile step.prof]``; the last line is one JSON object (``bench``, the phase
seconds, ``hf_fwd_bwd_s``, ``hf_fwd_s``, the ratios, ``load_before``/``load_after``). ``--profile``
writes a cProfile of the step's training phases and prints its 25 most expensive calls (cumulative).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "smollm2_arith_cpu.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", default=str(ROOT / ".cache" / "smollm2-hf"))
    p.add_argument("--mcore-dir", default=str(ROOT / ".cache" / "smollm2-mcore"))
    p.add_argument("--repeats", type=int, default=2, help="HF forward+backward repetitions (median)")
    p.add_argument("--no-save", action="store_true", help="skip the checkpoint save phase")
    p.add_argument("--profile", default=None, help="write a cProfile of score+teacher+train here")
    p.add_argument("-o", "--override", action="append", default=[], help="extra recipe KEY=VALUE")
    return p.parse_args(argv)


def padded_batches(seqs, micro_batch_size: int) -> list[tuple[list[list[int]], list[tuple[int, int]]]]:
    """The trainer's right-padded micro-batches of ``seqs`` (``trainer/microbatches/batches.py``): rows of
    ``micro_batch_size`` sequences, each padded to the longest sequence of the whole batch rounded up to 8.
    Returns per micro-batch (token rows, per row (first kept logit row, response length))."""
    from srpo_megatron.trainer.microbatches.batches import padded_len

    width = padded_len(seqs)
    out = []
    for i in range(0, len(seqs), micro_batch_size):
        group = seqs[i : i + micro_batch_size]
        rows = [list(s.ids) + [0] * (width - len(s.ids)) for s in group]
        spans = [(s.first, s.num_rows) for s in group]
        out.append((rows, spans))
    return out


def hf_times(hf_dir: str, batches, repeats: int) -> tuple[float, float]:
    """Median seconds of a plain HF forward+backward (and of the no-grad forward) over ``batches``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()  # dropout is 0 in SmolLM2's config; train mode as the trainer's pass

    def one(grad: bool) -> float:
        t0 = time.perf_counter()
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx:
            for rows, spans in batches:
                ids = torch.tensor(rows, dtype=torch.long, device="cpu")
                logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
                total = logp.new_zeros(())
                for r, (start, length) in enumerate(spans):
                    targets = ids[r, start + 1 : start + 1 + length]
                    total = total + logp[r, start : start + length].gather(-1, targets[:, None]).sum()
                if grad:
                    total.backward()
        if grad:
            model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    one(False)  # warm-up (allocator, first-call dispatch)
    fwd_bwd = statistics.median(one(True) for _ in range(repeats))
    fwd = statistics.median(one(False) for _ in range(repeats))
    return fwd_bwd, fwd


def _load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for d, what in ((args.hf_dir, "--hf-dir"), (args.mcore_dir, "--mcore-dir")):
        if not Path(d).is_dir():
            sys.exit(f"bench_demo_step: {what} {d} does not exist; run tools/demo.sh once (it prepares both)")
    load_before = _load()
    from srpo_megatron.compat.fallbacks import hide_fallback_warnings

    hide_fallback_warnings()  # as srpo train: megatron's expected TE/Apex fallbacks as one line
    run_dir = Path(tempfile.mkdtemp(prefix="srpo-bench-demo-"))
    overrides = [
        f"model.hf_dir={args.hf_dir}",
        f"model.megatron_checkpoint={args.mcore_dir}",
        f"run.dir={run_dir}",
        "run.tensorboard=false",
        "run.progress_bar=false",
        "train.steps=1",
        *args.override,
    ]
    from srpo_megatron.config import load_recipe

    cfg = load_recipe(str(RECIPE), overrides)
    from srpo_megatron.data.dataset import EpochSampler, build_datasets
    from srpo_megatron.parallel import destroy_model_parallel, initialize_model_parallel
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.collect.rollout_service import RolloutService
    from srpo_megatron.trainer.microbatches.batches import student_sequences
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.run import checkpoint as ckpt_mod
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.step_types import TrainerState

    t_setup = time.perf_counter()
    p = cfg.parallel
    groups = initialize_model_parallel(p.tp, p.pp, seed=cfg.run.seed, ep=p.ep, etp=p.etp, cp=p.cp)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    train_set, _ = build_datasets(cfg.data, tokenizer)
    sampler = EpochSampler(len(train_set), cfg.data.seed, cfg.data.shuffle)
    policy = Policy(cfg, groups)
    rollouts = RolloutService(cfg, tokenizer, policy, groups)
    st = TrainerState()
    rollouts.sync(st.weight_version)
    setup_s = time.perf_counter() - t_setup

    phases: dict[str, float] = {"setup_s": setup_s}
    draw = lambda n: [train_set[i] for i in sampler.next_indices(n)]  # noqa: E731
    t0 = time.perf_counter()
    mine = rollouts.next_batch(draw, st.step, st.weight_version)
    phases["rollout_s"] = time.perf_counter() - t0
    phases["generate_s"] = mine.metrics.get("time/generate_s", float("nan"))
    phases["reward_s"] = mine.metrics.get("time/reward_s", float("nan"))
    prof = cProfile.Profile() if args.profile else None
    with prof if prof is not None else contextlib.nullcontext():
        scored = scoring_pass(policy, mine.samples, trainer_version=st.weight_version)
        learned = learn(policy, scored, cfg.train.mini_batches)
    phases["score_s"] = scored.stats.score_s
    phases["teacher_s"] = scored.stats.teacher_s
    phases["train_s"] = learned.train_s
    t0 = time.perf_counter()
    policy.update_teacher()
    phases["ema_s"] = time.perf_counter() - t0
    phases["sync_s"] = rollouts.sync(st.weight_version + 1)
    if not args.no_save:
        t0 = time.perf_counter()
        parts: dict[str, float] = {}
        ckpt_mod.save_checkpoint(policy, run_dir, 1, {"step": 1}, keep_last=1, timings=parts)
        phases["save_s"] = time.perf_counter() - t0
        phases.update({f"save/{k}": v for k, v in parts.items()})
    seqs = student_sequences(mine.samples)
    tokens = sum(len(s.ids) for s in seqs)
    rollouts.close()
    destroy_model_parallel()
    if prof is not None:
        prof.dump_stats(args.profile)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)

    batches = padded_batches(seqs, cfg.train.micro_batch_size)
    hf_fwd_bwd, hf_fwd = hf_times(cfg.model.hf_dir, batches, args.repeats)
    step = sum(phases[k] for k in ("rollout_s", "score_s", "teacher_s", "train_s", "ema_s", "sync_s"))
    result = {
        "bench": "demo_step",
        "sequences": len(seqs),
        "tokens": tokens,
        **{k: round(v, 3) for k, v in phases.items()},
        "step_s": round(step, 3),
        "hf_fwd_bwd_s": round(hf_fwd_bwd, 3),
        "hf_fwd_s": round(hf_fwd, 3),
        "ratio_train_vs_hf": round(phases["train_s"] / hf_fwd_bwd, 3),
        "ratio_score_vs_hf": round(phases["score_s"] / hf_fwd, 3),
        "ratio_step_vs_hf": round(step / hf_fwd_bwd, 3),
        "load_before": round(load_before, 2),
        "load_after": round(_load(), 2),
        "threads": __import__("torch").get_num_threads(),
    }
    for k, v in result.items():
        if k != "bench":
            print(f"{k:>28}  {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
