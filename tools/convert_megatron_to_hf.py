#!/usr/bin/env python3
"""Export the policy of a megatron-core checkpoint (from tools/convert_hf_to_megatron.py or the trainer)
to an HF folder: sharded safetensors + index, config.json, tokenizer and generation config (a trainer
checkpoint's from the model.hf_dir it records).

    tools/convert_megatron_to_hf.py --megatron-dir DIR --out-dir DIR [--dtype bf16|fp32]
                                    [--max-shard-size 5GB] [--force] [--mtp-from HF_DIR] [--fp8]
                                    [--lora-adapter-out DIR]

LoRA runs (a checkpoint whose recipe.yaml has lora.rank > 0): --out-dir writes the merged model (every
adapted weight W + (alpha/r) * B @ A, a plain HF folder), --lora-adapter-out DIR the adapters alone as a PEFT
folder (adapter_config.json + adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the
base model; give either or both. A Qwen3-MoE run with lora.experts: true exports its per-expert adapters
through peft's target_parameters (transformers 5 fuses the experts); other families' expert adapters are
refused (use --out-dir). Details: srpo_megatron/conversion/lora_export.py.

GLM-4.5 / DeepSeek-V3 MTP layers are re-emitted unchanged from --mtp-from, or by default from the HF folder
the checkpoint was converted or trained from (``hf_source.json``), when that folder has them.

--fp8 writes a blockwise-FP8 folder (DeepSeek-V3's format, what SGLang serves with its fp8 linear method):
every projection of the decoder layers as float8_e4m3fn + weight_scale_inv (128x128 blocks, or the source
folder's weight_block_size and modules_to_not_convert when the checkpoint was converted from an FP8 folder),
the rest in --dtype, and config.json's quantization_config. Without it the export is dense, with no
quantization_config. Details: srpo_megatron/conversion/fp8_folder.py.

--megatron-dir may be a run directory: its newest checkpoint that verifies is exported, as `srpo train`
would resume it. A trainer checkpoint is checked against its manifest.json first. --force replaces only a
previous conversion (its srpo_conversion.json), never the input or a run directory, and prints what it
removes (srpo_megatron/conversion/output_guard.py). Bad input: one line, exit status 2.

Expected input layout: ``srpo_megatron/conversion/checkpoint.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.conversion.checkpoint import DTYPES, megatron_lora_to_peft, megatron_to_hf
from srpo_megatron.conversion.safetensors_io import parse_size


def input_errors() -> tuple[type[Exception], ...]:
    """What a bad input raises (refused outputs, unreadable inputs, unsupported models, bad checkpoints)."""
    from srpo_megatron.config import ConfigError
    from srpo_megatron.conversion.checkpoint_files import CheckpointError
    from srpo_megatron.conversion.table import ConversionError
    from srpo_megatron.models.architecture import UnsupportedModelError

    return (ConfigError, CheckpointError, ConversionError, UnsupportedModelError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--megatron-dir",
        required=True,
        help="checkpoint with hf_config.json, or a run directory (its newest complete checkpoint)",
    )
    p.add_argument("--out-dir", help="output HF model folder (a LoRA run: the merged model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the checkpoint's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 5GB, 500MB)")
    p.add_argument("--force", action="store_true", help="replace a previous conversion in --out-dir")
    p.add_argument("--mtp-from", help="HF folder whose MTP layers to copy (default: the recorded source)")
    p.add_argument("--fp8", action="store_true", help="write blockwise FP8 (weight + weight_scale_inv)")
    p.add_argument("--lora-adapter-out", help="a LoRA run: write its adapters as a PEFT folder here")
    args = p.parse_args(argv)
    if args.out_dir is None and args.lora_adapter_out is None:
        p.error("give --out-dir (the model) and/or --lora-adapter-out (a LoRA run's PEFT adapter folder)")
    try:
        if args.lora_adapter_out is not None:
            megatron_lora_to_peft(args.megatron_dir, args.lora_adapter_out, force=args.force)
        if args.out_dir is None:
            return 0
        megatron_to_hf(
            args.megatron_dir,
            args.out_dir,
            dtype=DTYPES.get(args.dtype),
            max_shard_bytes=parse_size(args.max_shard_size),
            force=args.force,
            mtp_from=args.mtp_from,
            fp8=args.fp8,
        )
    except input_errors() as e:  # bad input: one line naming the path and the fix, exit status 2
        print(f"{p.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns a manager process: keep the guard
    sys.exit(main())
