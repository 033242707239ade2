"""The live SGLang check on a blockwise FP8 folder: what a ``rollout.precision: fp8`` run serves and syncs.

The random bf16 Qwen3 of :mod:`.engine_model` is written again as a blockwise FP8 folder the way the
converter's FP8 export writes one (``conversion.fp8_folder.Fp8Export``: DeepSeek-V3's
``quantization_config`` {quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size
[128, 128]}; every projection of the layers as ``float8_e4m3fn`` + ``weight_scale_inv``, the rest bf16).
The folder must pass the start-up check a training run makes (``rollout.served_precision``). One SGLang
server starts on it; the sequence of :mod:`.sglang_live` runs with the update sent through the training
sync's own FP8 stream (``weights.fp8_sync.quantize_named``: the bf16 weights x2, each FP8-layout weight
quantized per block on the sender, its scale first), so what SGLang's block-FP8 linear method loads is
what a training step sends. A sync that sent bf16 under the dense names (no scales) is refused by the
engine's manifest of the served folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from srpo_megatron.doctor.acceptance.engine_model import load_weights, scaled, write_random_model
from srpo_megatron.doctor.acceptance.registry import AcceptanceCheck, Context, Outcome, failed, needs_cuda
from srpo_megatron.doctor.acceptance.sglang_live import serve_and_exercise


def write_fp8_folder(bf16_folder: Path, out: Path) -> Path:
    """``bf16_folder`` (config.json + safetensors) as a blockwise FP8 folder at ``out`` (reused if there)."""
    import torch
    from safetensors.torch import save_file

    from srpo_megatron.conversion.fp8_folder import Fp8Export

    if (out / "config.json").is_file():
        return out
    config = json.loads((bf16_folder / "config.json").read_text(encoding="utf-8"))
    export = Fp8Export.of(config, str(bf16_folder / "config.json"), progress=lambda _: None)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in load_weights(bf16_folder, device="cpu").items():
        quantized = export.tensors(name, t)  # [(name, e4m3), (scale name, fp32)] or [] (kept bf16)
        tensors.update(quantized or [(name, t)])
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    config["quantization_config"] = export.quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


def fp8_update(layout: Any):
    """The update an FP8 engine takes: the bf16 weights x2 through the sync's FP8 stream."""

    def update(weights: dict) -> Iterable[tuple[str, Any]]:
        from srpo_megatron.weights.fp8_sync import quantize_named

        return quantize_named(scaled(weights, 2.0).items(), layout)

    return update


def served_precision_problem(folder: Path) -> str:
    """'' when a ``rollout.precision: fp8`` SGLang run may serve ``folder``; else the start-up refusal."""
    from srpo_megatron.config import ConfigError
    from srpo_megatron.rollout.served_precision import check_served_precision

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(
            engine="sglang", precision="fp8", sglang=SimpleNamespace(model_path=str(folder))
        ),
        model=SimpleNamespace(hf_dir=str(folder)),
    )
    try:
        check_served_precision(cfg)
    except ConfigError as e:
        return str(e)
    return ""


def check_sglang_live_fp8(ctx: Context) -> Outcome:
    if not ctx.probes.cuda_available():
        return needs_cuda("an SGLang server runs on a GPU (block FP8 needs compute capability >= 8.9)")
    if not ctx.probes.has_module("sglang"):
        return failed("sglang is not installed")
    from srpo_megatron.rollout.served_precision import served_fp8_layout

    bf16 = write_random_model(Path(ctx.work_dir) / "random_bf16")
    folder = write_fp8_folder(bf16, Path(ctx.work_dir) / "random_fp8")
    why = served_precision_problem(folder)
    if why:
        return failed(f"the FP8 folder fails the start-up precision check: {why}")
    update = fp8_update(served_fp8_layout(folder))
    return serve_and_exercise(ctx, folder, load_weights(bf16), update, "sglang_server_fp8.log")


CHECKS = (
    AcceptanceCheck(
        "sglang_live_fp8",
        "a live SGLang server on a blockwise FP8 folder pauses (aborted samples keep their log-probs), takes "
        "the FP8 sync's update (e4m3 weights + weight_scale_inv) and continues with outputs that changed",
        "read the server log the detail names (sglang_server_fp8.log); FP8 blocks need an H100-class GPU",
        check_sglang_live_fp8,
    ),
)
