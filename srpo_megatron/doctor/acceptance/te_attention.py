"""Which attention backend Transformer Engine actually picks for gpt-oss and MLA layers, and its speed.

TE chooses FlashAttention, FusedAttention (cuDNN) or its unfused PyTorch attention per call in
``get_attention_backend`` and, with ``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2``, logs why it dropped each one
("Disabling FusedAttention as ...") and what it kept ("Selected backend = FusedAttention (sub-backend 1)")
(TransformerEngine ``pytorch/attention/dot_product_attention/utils.py``, 2.x). A child process
(``python -m srpo_megatron.doctor.acceptance.te_attention``, the variables set before TE is imported) runs
one ``DotProductAttention`` per case in bf16 at s = 8k, forward + backward, and marks each case in its log;
the parent parses the log. Cases: gpt-oss's two layer kinds (sliding window (127, 0), full causal), both
with learnable softmax sinks, and an MLA layer (q/k head 192, v head 128), each on bshd (one sequence) and
thd (two packed sequences). Anything but FusedAttention fails, naming the cuDNN the case needs: unfused
attention materialises ``[h, s, s]`` scores (gigabytes per layer at 8k) and ignores no mask.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from srpo_megatron.doctor.acceptance.registry import (
    AcceptanceCheck,
    Context,
    Outcome,
    failed,
    needs_cuda,
    passed,
)
from srpo_megatron.doctor.acceptance.versions import CUDNN_SINKS, CUDNN_SINKS_PACKED, cudnn_tuple

SEQ = 8192
MARK = "@@srpo-case "
SELECTED = re.compile(r"Selected backend = (.+?)\s*$")
DISABLING = re.compile(r"(Disabling FusedAttention[^\n]*)")


@dataclass(frozen=True)
class AttnCase:
    name: str  # e.g. "gpt_oss_sliding.thd"
    heads: int
    kv_heads: int
    d_qk: int
    d_v: int
    sinks: bool  # learnable softmax offset per head (gpt-oss)
    window: tuple[int, int] | None  # (left, right); None = full causal
    fmt: str  # "bshd" (one sequence of SEQ) or "thd" (two packed sequences of SEQ / 2)

    def cudnn_needed(self) -> tuple[int, ...] | None:
        if not self.sinks:
            return None
        return CUDNN_SINKS_PACKED if self.fmt == "thd" else CUDNN_SINKS


def _cases() -> tuple[AttnCase, ...]:
    out = []
    for fmt in ("bshd", "thd"):
        # gpt-oss-20b attention per TP1 rank: 64 query heads, 8 KV heads, head dim 64, alternating layers
        out.append(AttnCase(f"gpt_oss_sliding.{fmt}", 64, 8, 64, 64, True, (127, 0), fmt))
        out.append(AttnCase(f"gpt_oss_full.{fmt}", 64, 8, 64, 64, True, None, fmt))
        # DeepSeek-V3 MLA at TP8: 16 heads, q/k 192 (128 nope + 64 rope), v 128
        out.append(AttnCase(f"mla.{fmt}", 16, 16, 192, 128, False, None, fmt))
    return tuple(out)


CASES = _cases()


def parse_backend_log(log: str) -> tuple[str | None, list[str]]:
    """(the last "Selected backend" of TE's debug log, every "Disabling FusedAttention" reason in it)."""
    selected = None
    for line in log.splitlines():
        m = SELECTED.search(line)
        if m:
            selected = m.group(1)
    return selected, sorted(set(DISABLING.findall(log)))


def split_case_logs(stderr: str) -> dict[str, str]:
    """The child's stderr cut at its case markers: case name -> that case's TE log."""
    logs: dict[str, str] = {}
    name = None
    for line in stderr.splitlines():
        if line.startswith(MARK):
            name = line[len(MARK) :].strip()
            logs[name] = ""
        elif name is not None:
            logs[name] += line + "\n"
    return logs


def case_outcome(case: AttnCase, selected: str | None, reasons: list[str], row: dict, cudnn: str) -> Outcome:
    """FusedAttention: ok with the timing; anything else fails with the cuDNN the case needs."""
    if row.get("error"):
        return failed(f"{case.name}: {row['error']}")
    if selected is None:
        return failed(f"{case.name}: TE logged no backend choice (NVTE_DEBUG log empty; is TE 2.x?)")
    ms = {"fwd_bwd_ms": row.get("ms"), "backend": selected}
    if selected.startswith("FusedAttention"):
        return passed(f"{case.name}: {selected}, fwd+bwd {row.get('ms')} ms at s={SEQ}", **ms)
    need = case.cudnn_needed()
    why = "; ".join(reasons) or "no reason logged"
    want = f"it needs cuDNN >= {'.'.join(map(str, need))} (this node: {cudnn})" if need else f"cuDNN {cudnn}"
    return failed(f"{case.name}: TE fell back to {selected}, not FusedAttention: {want}; TE: {why}", **ms)


def _run_child(ctx: Context) -> dict:
    """Run every case once (cached on ``ctx``): {case name: (row, log)} or {"error": message}."""
    if "te_attention" in ctx.cache:
        return ctx.cache["te_attention"]
    env = {**os.environ, "NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"}
    cmd = [sys.executable, "-m", "srpo_megatron.doctor.acceptance.te_attention"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=ctx.timeout_s)
    except subprocess.TimeoutExpired:
        ctx.cache["te_attention"] = {"error": f"the attention cases did not finish in {ctx.timeout_s:.0f} s"}
        return ctx.cache["te_attention"]
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[row["case"]] = row
    logs = split_case_logs(proc.stderr)
    result = {name: (row, logs.get(name, "")) for name, row in rows.items()}
    if not result:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        result = {"error": f"the attention child exited {proc.returncode} with no result: {tail}"}
    ctx.cache["te_attention"] = result
    return result


def _checker(case: AttnCase):
    def run(ctx: Context) -> Outcome:
        if not ctx.probes.cuda_available():
            return needs_cuda("TE picks its attention backend on a GPU (cuDNN FusedAttention)")
        if not ctx.probes.has_module("transformer_engine"):
            return failed("transformer_engine is not installed")
        result = _run_child(ctx)
        if "error" in result:
            return failed(str(result["error"]))
        if case.name not in result:
            return failed(f"{case.name}: the child reported nothing for this case")
        row, log = result[case.name]
        selected, reasons = parse_backend_log(log)
        raw = ctx.probes.cudnn_version()
        cudnn = "?" if raw is None else ".".join(map(str, cudnn_tuple(int(raw))))
        return case_outcome(case, selected, reasons, row, cudnn)

    return run


CHECKS = tuple(
    AcceptanceCheck(
        f"te_attention.{c.name}",
        f"TE runs this {'gpt-oss' if c.sinks else 'MLA'} attention ({c.fmt}) on FusedAttention at s={SEQ}",
        "use the image's cuDNN (>= 9.18) and TE; NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 shows TE's reasons",
        _checker(c),
    )
    for c in CASES
)


# ----------------------------------------------------------------------------------------- child process


def _time_case(case: AttnCase) -> float:
    """One DotProductAttention of ``case`` in bf16: ms of forward + backward (median of 3 after 1 warm-up)."""
    import torch
    from transformer_engine.pytorch import DotProductAttention

    kv = case.d_qk if case.d_qk == case.d_v else (case.d_qk, case.d_v)
    thd = case.fmt == "thd"
    attn = DotProductAttention(
        case.heads,
        kv,
        num_gqa_groups=case.kv_heads,
        attention_dropout=0.0,
        qkv_format=case.fmt,
        attn_mask_type="padding_causal" if thd else "causal",
        window_size=case.window,
        softmax_type="learnable" if case.sinks else "vanilla",
    ).cuda()
    lead = (SEQ,) if thd else (1, SEQ)
    q = torch.randn(*lead, case.heads, case.d_qk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(*lead, case.kv_heads, case.d_qk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(*lead, case.kv_heads, case.d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kwargs = {}
    if thd:
        cu = torch.tensor([0, SEQ // 2, SEQ], device="cuda", dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ // 2, max_seqlen_kv=SEQ // 2)
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = attn(q, k, v, **kwargs)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return round(sorted(times[1:])[1], 2)


def child_main() -> int:
    for case in CASES:
        print(MARK + case.name, file=sys.stderr, flush=True)
        try:
            row = {"case": case.name, "ms": _time_case(case)}
        except Exception as e:  # reported as this case's failure by the parent
            row = {"case": case.name, "error": f"{type(e).__name__}: {e}"[:500]}
        sys.stderr.flush()
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
