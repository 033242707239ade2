"""Is a task fit for the SRPO study? Student accuracy, mixed groups, and the retrospection check.

On ``--problems`` held-out arithmetic problems (``srpo_megatron.data.arithmetic``), with the prepared
SmolLM2-135M-Instruct HF folder (tools/prepare_smollm2.py) as both student and (initial) teacher:

1. Student: greedy accuracy, and G sampled responses per problem at temperature ``--temperature``:
   sampled accuracy and the share of *mixed* groups (some right, some wrong: the groups that carry
   both a GRPO signal and an SDPO teacher).
2. Retrospection check (method §1.4), on the mixed groups: the teacher is the same model with a
   correct sibling's solution in its context (the trainer's own ``teacher_prompt_ids``). It scores
   every other response of the group (j ≠ the sibling shown, so a correct response is never scored
   with itself in context). Reported: the mean per-token teacher log-prob of wrong vs correct
   responses, the same for the SDPO signal log q − log π (teacher minus student), the share of groups
   in which the wrong responses score lower than the correct ones, and the teacher's own greedy
   accuracy with the solution in context next to the student's greedy accuracy on the same problems.

It runs plain ``transformers`` generation (the CPU rollout engine's backend), no training, and prints
one JSON object per task option (also written to ``--out``).

    nice -n 10 .venv/bin/python tools/probe_task.py --levels 0 4 --reasoning --problems 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _generate(
    model, tok, prompts: list[list[int]], max_new: int, sample: bool, temp: float, n: int, seed: int
):
    """Responses (token id lists, cut after EOS) for each prompt, ``n`` each: [len(prompts)][n].

    Left-padded batches of up to 64 sequences (the prompts differ in length by a few tokens).
    """
    import torch

    torch.manual_seed(seed)
    flat = [ids for ids in prompts for _ in range(n)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kw = (
        {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    )
    responses: list[list[int]] = []
    for b in range(0, len(flat), 64):
        chunk = flat[b : b + 64]
        width = max(len(c) for c in chunk)
        x = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        y = model.generate(x, attention_mask=mask, max_new_tokens=max_new, pad_token_id=pad, **kw)
        for r in y[:, width:].tolist():
            if tok.eos_token_id in r:
                r = r[: r.index(tok.eos_token_id) + 1]
            responses.append(r)
    return [responses[i * n : (i + 1) * n] for i in range(len(prompts))]


def _token_logps(model, prompt: list[int], response: list[int]):
    """log p(response_t | prompt, response_<t) for each response token: [len(response)] float64."""
    import torch

    x = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(x).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def probe(model, tok, level: int, reasoning: bool, args) -> dict:
    from srpo_megatron.config import TeacherConfig
    from srpo_megatron.data.arithmetic import generate_arithmetic_rows
    from srpo_megatron.data.rows import Row
    from srpo_megatron.data.templating import encode_text, template_text
    from srpo_megatron.rewards.arithmetic import arithmetic_reward
    from srpo_megatron.trainer.collect.rollout_service import teacher_prompt_ids

    t0 = time.monotonic()
    rows = generate_arithmetic_rows("test", args.problems, level, args.seed, reasoning)
    prompts = [encode_text(tok, template_text(tok, r["prompt"], None)) for r in rows]
    dec = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    if args.samples:  # reuse an evaluation's samples (samples.jsonl) as the groups; no student sampling
        by_prompt: dict[str, list[str]] = {}
        for line in Path(args.samples).read_text().splitlines():
            rec = json.loads(line)
            by_prompt.setdefault(rec["prompt"], []).append(rec["response"])
        rows = [r for r in rows if r["prompt"] in by_prompt]
        prompts = [encode_text(tok, template_text(tok, r["prompt"], None)) for r in rows]
        groups = [[encode_text(tok, t) for t in by_prompt[r["prompt"]]] for r in rows]
    greedy = _generate(model, tok, prompts, args.max_new_tokens, False, 1.0, 1, args.seed)
    g_ok = [arithmetic_reward(dec(g[0]), r["answer"]) for g, r in zip(greedy, rows, strict=True)]
    if not args.samples:
        groups = _generate(
            model, tok, prompts, args.max_new_tokens, True, args.temperature, args.group_size, args.seed
        )
    ok = [[arithmetic_reward(dec(y), r["answer"]) for y in grp] for grp, r in zip(groups, rows, strict=True)]
    mixed = [i for i, o in enumerate(ok) if 0 < sum(o) < len(o)]

    tcfg = TeacherConfig()
    logq = {"wrong": [], "correct": []}  # mean per-token teacher log-prob per scored response
    signal = {"wrong": [], "correct": []}  # mean per-token log q − log π per scored response
    wrong_lower, comparable = 0, 0
    t_prompts = []
    for i in mixed:
        sib = ok[i].index(1.0)  # the first correct sample is the solution shown (route()'s sibling rule)
        row = Row(rows[i]["prompt"], None, rows[i]["answer"], "arithmetic", "probe", str(i))
        t_prompt = teacher_prompt_ids(tok, SimpleNamespace(row=row), dec(groups[i][sib]), tcfg)
        t_prompts.append(t_prompt)
        per = {"wrong": [], "correct": []}
        for j, y in enumerate(groups[i]):
            if j == sib or not y:
                continue
            q = _token_logps(model, t_prompt, y)
            p = _token_logps(model, prompts[i], y)
            kind = "correct" if ok[i][j] else "wrong"
            per[kind].append(float(q.mean()))
            logq[kind].append(float(q.mean()))
            signal[kind].append(float((q - p).mean()))
        if per["wrong"] and per["correct"]:
            comparable += 1
            wrong_lower += max(per["wrong"]) < min(per["correct"])
    t_ans = _generate(model, tok, t_prompts, args.max_new_tokens, False, 1.0, 1, args.seed) if mixed else []
    t_ok = [arithmetic_reward(dec(a[0]), rows[i]["answer"]) for a, i in zip(t_ans, mixed, strict=True)]
    s_ok = [g_ok[i] for i in mixed]
    mean = lambda v: round(sum(v) / len(v), 4) if v else None  # noqa: E731
    return {
        "level": level,
        "reasoning": reasoning,
        "problems": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "greedy_acc": mean(g_ok),
        "sampled_acc": mean([x for o in ok for x in o]),
        "temperature": args.temperature,
        "group_size": args.group_size,
        "groups_from": args.samples or "sampled here",  # with --samples: the file's own k and temperature
        "mixed_group_share": round(len(mixed) / len(rows), 4),
        "mean_response_tokens": mean([len(y) for grp in groups for y in grp]),
        "retrospection": {
            "mixed_groups": len(mixed),
            "teacher_logp_wrong": mean(logq["wrong"]),
            "teacher_logp_correct": mean(logq["correct"]),
            "signal_wrong": mean(signal["wrong"]),
            "signal_correct": mean(signal["correct"]),
            "scored_wrong": len(logq["wrong"]),
            "scored_correct": len(logq["correct"]),
            "groups_wrong_all_below_correct": f"{wrong_lower}/{comparable}",
            "teacher_greedy_acc_with_solution": mean(t_ok),
            "student_greedy_acc_same_problems": mean(s_ok),
        },
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", default=".cache/smollm2-hf")
    p.add_argument("--levels", nargs="+", type=int, default=[0, 4])
    p.add_argument(
        "--reasoning", action="store_true", help="'Think step by step, then give the final number.'"
    )
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="", help="also write the results here (JSON list)")
    p.add_argument(
        "--samples",
        default="",
        help="an evaluation's samples.jsonl (k samples per problem) to use as the groups instead of sampling",
    )
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    hf = Path(args.hf_dir)
    if not (hf / "config.json").is_file():
        raise SystemExit(f"--hf-dir {hf}: no HF model there; run tools/prepare_smollm2.py --out {hf} first")
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    results = []
    for level in args.levels:
        res = probe(model, tok, level, args.reasoning, args)
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
