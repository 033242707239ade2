"""Colocated release/resume: three release -> update -> resume cycles with CUDA graphs on.

An offline SGLang engine (``SGLangEngine``, the colocated route) on a random bf16 folder with the
memory saver on (real ``torch_memory_saver``) and CUDA graphs captured. Each cycle releases every memory
type (KV cache, weights, CUDA graphs), measures the device's free memory (``torch.cuda.mem_get_info``:
the engine is another process), pushes weights scaled by a new factor (the engine resumes weights first
and the rest after the update) and generates: a replayed CUDA graph over resumed memory must serve the
new version. Passing means every release returned at least ``RETURNED`` of what the engine held.
"""

from __future__ import annotations

from pathlib import Path

from srpo_megatron.doctor.acceptance.engine_model import load_weights, scaled, write_random_model
from srpo_megatron.doctor.acceptance.registry import (
    AcceptanceCheck,
    Context,
    Outcome,
    failed,
    needs_cuda,
    passed,
)

CYCLES = 3
RETURNED = 0.7  # of the engine's memory; the rest is its CUDA context and allocator pools


def judge_cycles(held: int, returned: list[int], versions: list[int], want: list[int]) -> Outcome:
    """``held``: bytes the engine took; ``returned``: bytes each release gave back; versions served."""
    gib = [round(r / 2**30, 2) for r in returned]
    if held <= 0:
        return failed(f"the engine took no device memory ({held} bytes): mem_get_info cannot see it")
    low = [i + 1 for i, r in enumerate(returned) if r < RETURNED * held]
    if low:
        return failed(
            f"cycle(s) {low} returned {gib} GiB of the {held / 2**30:.2f} GiB the engine held "
            f"(< {RETURNED:.0%}): torch_memory_saver did not release it",
            returned_gib=gib,
        )
    if versions != want:
        return failed(
            f"after each resume the engine served versions {versions}, not {want}", returned_gib=gib
        )
    return passed(
        f"{CYCLES} cycles with CUDA graphs: released {gib} GiB of {held / 2**30:.2f} GiB each time, "
        f"then served versions {versions}",
        returned_gib=gib,
    )


def check_release_resume(ctx: Context) -> Outcome:
    if not ctx.probes.cuda_available():
        return needs_cuda("torch_memory_saver pauses CUDA memory of a GPU engine")
    missing = [m for m in ("sglang", "torch_memory_saver") if not ctx.probes.has_module(m)]
    if missing:
        return failed(f"{', '.join(missing)} not installed")
    import torch

    from srpo_megatron.config import SGLangEngineConfig
    from srpo_megatron.rollout.base import SamplingParams
    from srpo_megatron.rollout.sglang.engine import SGLangEngine

    folder = write_random_model(Path(ctx.work_dir) / "random_bf16")
    cfg = SGLangEngineConfig(
        model_path=str(folder),
        memory_saver=True,
        startup_timeout_s=ctx.timeout_s,
        request_timeout_s=120.0,
        engine_kwargs={"mem_fraction_static": 0.4, "cuda_graph_max_bs": 8},  # CUDA graphs on (default)
    )
    weights = load_weights(folder)
    free_start = torch.cuda.mem_get_info()[0]
    engine = SGLangEngine(cfg, colocated=True)
    try:
        engine.update_weights(weights.items(), version=1)
        held = free_start - torch.cuda.mem_get_info()[0]
        returned, versions = [], []
        for cycle in range(CYCLES):
            before = torch.cuda.mem_get_info()[0]
            engine.release_memory()
            returned.append(torch.cuda.mem_get_info()[0] - before)
            engine.update_weights(scaled(weights, 1.0 + 0.5 * (cycle + 1)).items(), version=cycle + 2)
            out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=16, seed=cycle))
            versions.append(out[0][0].weight_version)
        return judge_cycles(held, returned, versions, list(range(2, CYCLES + 2)))
    finally:
        engine.shutdown()


CHECKS = (
    AcceptanceCheck(
        "colocated_release_resume",
        f"{CYCLES} release -> update -> resume cycles with CUDA graphs on return the engine's memory "
        "each time and generate with the new weights after each",
        "check torch_memory_saver (versions.torch_memory_saver) and that SGLang has enable_memory_saver",
        check_release_resume,
    ),
)
