#!/usr/bin/env python3
"""Convert an HF checkpoint (Llama/SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, GLM-4.5; safetensors) to a
megatron-core ``dist_checkpointing`` policy checkpoint that loads at any TP/PP layout. Hub MTP layers
(GLM-4.5, DeepSeek-V3) are skipped with one line of notice (``srpo_megatron/conversion/mtp.py``).

    tools/convert_hf_to_megatron.py --hf-dir DIR --out-dir DIR [--dtype bf16|fp32] [--force]

Layout of the output and the design choices: ``srpo_megatron/conversion/checkpoint.py``. --force replaces
only a previous conversion (its srpo_conversion.json), never the input, and prints what it removes
(``srpo_megatron/conversion/output_guard.py``). Bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.compat.fallbacks import hide_fallback_warnings
from srpo_megatron.conversion.checkpoint import DTYPES, hf_to_megatron


def input_errors() -> tuple[type[Exception], ...]:
    """What a bad input raises (refused outputs, unreadable inputs, unsupported models, bad checkpoints)."""
    from srpo_megatron.config import ConfigError
    from srpo_megatron.conversion.checkpoint_files import CheckpointError
    from srpo_megatron.conversion.table import ConversionError
    from srpo_megatron.models.architecture import UnsupportedModelError

    return (ConfigError, CheckpointError, ConversionError, UnsupportedModelError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--out-dir", required=True, help="output dist_checkpointing directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="parameter dtype (default: the HF tensors')")
    p.add_argument("--force", action="store_true", help="replace a previous conversion in --out-dir")
    args = p.parse_args(argv)
    hide_fallback_warnings()  # megatron's expected TE/Apex fallbacks: one line instead (compat/fallbacks.py)
    try:
        hf_to_megatron(args.hf_dir, args.out_dir, dtype=DTYPES.get(args.dtype), force=args.force)
    except input_errors() as e:  # bad input: one line naming the path and the fix, exit status 2
        print(f"{p.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # dist_checkpointing.save spawns a manager process: keep the guard
    sys.exit(main())
