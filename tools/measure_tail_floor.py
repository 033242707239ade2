"""How much the tail bucket's floor changes the SDPO loss (issue 28, D2), on a real model's distributions.

``ops.vocab_parallel.append_tail`` floors the tail mass 1 − Σ_K p at 1e-30; SDPO's code
(``compute_self_distillation_loss``, ``add_tail``) clamps log Σ_K p ≤ −1e-7 instead, i.e. the tail mass at
≥ ~1e-7. The two differ only on tokens whose top-K holds more than 1 − 1e-7 of the mass, which a
confident LM produces often. This runs SmolLM2-135M-Instruct (``tools/prepare_smollm2.py``) on arithmetic
prompts: the student sees the question, the teacher the question plus a worked answer (SRPO's reprompt),
both score the student's sampled response; the top-K buckets (K = 100, the paper's) are built both ways,
and the batch-mean divergence (the SDPO loss at ratio 1, unit weights) is compared at α = 0.5 and α = 0.

    .venv/bin/python tools/measure_tail_floor.py --hf-dir .cache/smollm2-hf --questions 8 --new-tokens 40

Measured 2026-12-02 (8 questions, 225 response tokens, 0.9% with a tail mass < 1e-7): the batch-mean loss
differs by 0 (α 0.5) and 9.4e-8 (α 0) relative in fp32, 3.9e-10 and 7.0e-11 in fp64; the largest per-token
relative difference is 1.8e-5 (α 0.5) and 7.1e-4 (α 0) in fp32, 1.5e-5 and 5.1e-5 in fp64.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.losses import topk_divergence
from srpo_megatron.ops.vocab_parallel import append_tail

QUESTIONS = [(a, b) for a in (7, 12, 23, 38, 41, 56, 64, 89) for b in (5, 9, 17)]


def sdpo_tail(logp: torch.Tensor) -> torch.Tensor:
    """SDPO's add_tail: log Σ_K p clamped at −1e-7 before log(1 − Σ_K p)."""
    log_s = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp, torch.log(-torch.expm1(log_s))], dim=-1)


def prompt_ids(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok(chat, add_special_tokens=False).input_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    student_rows, teacher_rows = [], []
    for a, b in QUESTIONS[: args.questions]:
        q = f"What is {a} + {b}? Answer with the number."
        hint = f"{q}\nA correct solution: {a} + {b} = {a + b}. The answer is {a + b}."
        s_ids, t_ids = (prompt_ids(tok, text) for text in (q, hint))
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([s_ids]), do_sample=True, temperature=1.0, max_new_tokens=args.new_tokens
            )[0, len(s_ids) :].tolist()
            for prompt, out in ((s_ids, student_rows), (t_ids, teacher_rows)):
                logits = model(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1 : -1]
                out.append(torch.log_softmax(logits.float(), dim=-1))
    p_full, q_full = torch.cat(student_rows), torch.cat(teacher_rows)
    ids = p_full.topk(args.top_k, dim=-1).indices
    p_k, q_k = p_full.gather(1, ids), q_full.gather(1, ids)
    tail_p = -torch.expm1(torch.logsumexp(p_k.double(), dim=-1))
    tail_q = -torch.expm1(torch.logsumexp(q_k.double(), dim=-1))
    below = ((tail_p < 1e-7) | (tail_q < 1e-7)).double().mean().item()
    print(f"{p_full.shape[0]} response tokens, K = {args.top_k}; tokens with a tail mass < 1e-7: {below:.1%}")
    for dtype in (torch.float32, torch.float64):
        for alpha in (0.5, 0.0):
            ours = topk_divergence(
                append_tail(p_k.to(dtype)), append_tail(q_k.to(dtype)), alpha, add_tail=False
            )
            theirs = topk_divergence(
                sdpo_tail(p_k.to(dtype)), sdpo_tail(q_k.to(dtype)), alpha, add_tail=False
            )
            rel = abs(ours.mean().item() - theirs.mean().item()) / abs(theirs.mean().item())
            tok_rel = ((ours - theirs).abs() / theirs.abs().clamp_min(1e-12)).max().item()
            print(
                f"{str(dtype).removeprefix('torch.'):8s} α = {alpha}: mean loss {theirs.mean().item():.6g} "
                f"(SDPO's clamp) vs {ours.mean().item():.6g} (floor 1e-30): relative difference {rel:.2e}; "
                f"largest per-token |Δ| {(ours - theirs).abs().max().item():.2e} (relative {tok_rel:.2e})"
            )


if __name__ == "__main__":
    main()
