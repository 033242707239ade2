"""What precision the rollout engines serve, read from the served folder, and the start-up refusals.

SGLang builds its model from the served folder's ``config.json``: a ``quantization_config`` there makes it
create quantized parameters (block FP8: ``weight`` e4m3 + ``weight_scale_inv`` fp32 per 128x128 block,
``sglang/srt/layers/quantization/fp8.py::Fp8LinearMethod.create_weights``), whatever the trainer sends. So
the served folder decides what a weight sync must produce, and a sync that cannot produce it must not
start: SGLang's loaders drop names they do not know without an error (gpt-oss's MXFP4 experts), or copy
bf16 into FP8 parameters next to stale scales (DeepSeek-V3's hub folder).

=========================  ====================  =================================================
served folder              rollout.precision     what happens
=========================  ====================  =================================================
no quantization_config     bf16                  bf16 sync (default)
no quantization_config     fp8, engine=hf        the CPU engine emulates FP8: dequantize(quantize(W))
no quantization_config     fp8, engine=sglang    refused: serve a blockwise FP8 folder (below)
fp8, e4m3, 2-D blocks      fp8                   FP8 blockwise sync (``weights.fp8_sync``)
fp8 (blockwise)            bf16                  refused: set rollout.precision: fp8
mxfp4 (gpt-oss hub)        any                   refused: serve a bf16 export (ARCHITECTURE.md)
any other quant_method     any                   refused (known to SGLang, not producible here)
unknown quant_method       any                   refused
=========================  ====================  =================================================

Why not SGLang's ``--quantization fp8`` on a bf16 folder: with no FP8 checkpoint SGLang's ``Fp8Config`` is
not ``is_checkpoint_fp8_serialized``, refuses block quantization ("only supports fp8-serialized
checkpoint") and quantizes per tensor once after loading; it has no ``weight_scale_inv`` a sync could
write. slime serves an FP8 folder for the same reason. The FP8 folder of a bf16 policy is the converter's
FP8 export or the hub's ``-FP8`` release of the same model.

Also refused: a folder that stores a weight in FP8 (a ``weight_scale_inv`` beside it) that
``conversion.fp8_layout.Fp8Layout`` keeps in bf16, or the reverse (the folder's ``modules_to_not_convert``
disagreeing with the rule the sync quantizes by). Torch-free: ``srpo launch`` runs this before it submits.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from srpo_megatron.config import ConfigError
from srpo_megatron.conversion.fp8_layout import SCALE_SUFFIX, Fp8Layout

# SGLang's quantization methods (sglang/srt/layers/quantization/__init__.py, 0.5.23): known, so refused as
# "cannot be produced by the sync" rather than "unknown".
KNOWN_METHODS = frozenset(
    "fp8 mxfp8 mxfp4 blockwise_int8 modelopt modelopt_fp8 modelopt_fp4 modelopt_mixed nvfp4_online w8a8_int8 "  # noqa: SIM905
    "w8a8_fp8 awq awq_marlin bitsandbytes gguf gptq gptq_marlin moe_wna16 compressed-tensors w4afp8 "
    "petit_nvfp4 quark quark_mxfp4 auto-round auto-round-int8 modelslim quark_int4fp8_moe fbgemm_fp8 "
    "marlin qoq".split()
)
FIX_BF16 = "serve a bf16 export of the policy (tools/convert_megatron_to_hf.py) as rollout.sglang.model_path"


def served_folder(cfg: Any) -> str:
    """The HF folder the rollout engines load: ``rollout.sglang.model_path``, else ``model.hf_dir``."""
    sglang = getattr(cfg.rollout, "sglang", None)
    if cfg.rollout.engine == "sglang" and sglang is not None and sglang.model_path:
        return sglang.model_path
    return cfg.model.hf_dir


def quantization_config(folder: str | Path) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` of ``folder`` (None: none, or no readable config.json)."""
    path = Path(folder).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    qc = data.get("quantization_config") if isinstance(data, dict) else None
    return qc if isinstance(qc, dict) else None


def served_fp8_layout(folder: str | Path) -> Fp8Layout | None:
    """The blockwise FP8 layout the engines serving ``folder`` hold (None: bf16)."""
    qc = quantization_config(folder)
    if qc is None:
        return None
    return Fp8Layout.from_quantization_config(qc, f"{folder}/config.json")


def with_fp8_scales(
    manifest: dict[str, tuple[int, ...]], layout: Fp8Layout | None
) -> dict[str, tuple[int, ...]]:
    """The names and shapes an FP8 engine loads: ``manifest`` (bf16 names) plus ``<name>_scale_inv``
    ``[ceil(rows/br), ceil(cols/bc)]`` after every FP8 weight. Unchanged for ``layout`` None."""
    if layout is None:
        return manifest
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in manifest.items():
        out[name] = shape
        if layout.is_fp8(name) and len(shape) == 2:
            br, bc = layout.block
            out[layout.scale_name(name)] = (-(-shape[0] // br), -(-shape[1] // bc))
    return out


def folder_tensor_names(folder: str | Path) -> list[str] | None:
    """The tensor names a safetensors folder stores (its index, else each file's header); None if none."""
    folder = Path(folder).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        except (OSError, ValueError, KeyError):
            return None
    names: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            names += [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
    return names or None


def check_served_precision(cfg: Any) -> None:
    """Refuse, in one line, a served folder whose quantization the recipe's sync cannot produce (module
    docstring's table). Skipped when the folder's config.json is not readable here (a launch machine)."""
    folder = served_folder(cfg)
    if not (Path(folder).expanduser() / "config.json").is_file():
        return  # not readable on this machine (srpo launch off-cluster): the job's own start-up checks it
    precision = getattr(cfg.rollout, "precision", "bf16")
    qc = quantization_config(folder)
    key = "rollout.sglang.model_path" if cfg.rollout.engine == "sglang" else "model.hf_dir"
    where = f"{key} {folder}"
    if qc is None:
        if precision == "fp8" and cfg.rollout.engine == "sglang":
            raise ConfigError(
                f"rollout.precision=fp8 but {where} has no quantization_config: SGLang then builds no "
                "weight_scale_inv for a sync to write (its --quantization fp8 on a bf16 folder quantizes per "
                "tensor once, at load); serve a blockwise FP8 folder (quant_method fp8, weight_block_size "
                "[128, 128]: the converter's FP8 export or the hub's -FP8 release) or set "
                "rollout.precision: bf16"
            )
        return
    method = qc.get("quant_method")
    if method not in KNOWN_METHODS:
        raise ConfigError(
            f"{where}/config.json: unknown quantization_config.quant_method {method!r}; neither SGLang nor "
            f"the weight sync knows it; {FIX_BF16}, or a blockwise FP8 folder with rollout.precision: fp8"
        )
    if method == "mxfp4":
        raise ConfigError(
            f"{where}/config.json: quant_method mxfp4 (gpt-oss's hub folder) cannot be fed by the weight "
            "sync: SGLang's MXFP4 loader takes only *_blocks/*_scales expert tensors and drops the bf16 "
            f"experts the trainer has, without an error; {FIX_BF16}"
        )
    if method != "fp8" or cfg.rollout.engine != "sglang":
        engine = "the CPU engine loads bf16 only" if cfg.rollout.engine != "sglang" else "the sync sends bf16"
        raise ConfigError(
            f"{where}/config.json: quant_method {method!r} cannot be produced by the weight sync ({engine}; "
            f"blockwise FP8 into SGLang is the one quantized sync); {FIX_BF16}"
        )
    try:
        layout = Fp8Layout.from_quantization_config(qc, f"{where}/config.json")
    except ValueError as e:  # per-tensor or non-e4m3 FP8: not the layout the sync writes
        raise ConfigError(str(e)) from None
    if precision != "fp8":
        raise ConfigError(
            f"{where}/config.json is a blockwise FP8 folder (quant_method fp8): SGLang serves it in FP8 with "
            "weight_scale_inv beside each projection, which a bf16 sync leaves stale; set rollout.precision: "
            f"fp8 (the sync then quantizes per block), or {FIX_BF16}"
        )
    check_fp8_names(folder, layout, where)


def check_fp8_names(folder: str | Path, layout: Fp8Layout, where: str) -> None:
    """Every FP8 weight of the folder is FP8 by ``layout`` and the reverse (module docstring)."""
    names = folder_tensor_names(folder)
    if names is None:
        return
    stored = set(names)
    scaled = {n[: -len(SCALE_SUFFIX)] for n in stored if n.endswith(".weight" + SCALE_SUFFIX)}
    wrong = sorted(n for n in scaled if not layout.is_fp8(n))
    if wrong:
        raise ConfigError(
            f"{where}: the folder stores {wrong[0]} in FP8 (a weight_scale_inv beside it; {len(wrong)} such) "
            "but SGLang keeps that layer in bf16 under this quantization_config, so the sync would send it "
            "bf16; re-export the folder with that layer in bf16 (or list it in modules_to_not_convert)"
        )
    missing = sorted(n for n in stored if layout.is_fp8(n) and n not in scaled)
    if missing:
        raise ConfigError(
            f"{where}: the folder stores {missing[0]} in bf16 ({len(missing)} such) but its "
            "quantization_config makes SGLang build it as FP8; list that module in "
            "quantization_config.modules_to_not_convert or re-export the folder with it in FP8"
        )
