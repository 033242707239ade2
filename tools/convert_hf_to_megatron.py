#!/usr/bin/env python3
"""Convert an HF checkpoint (Llama/SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, GLM-4.5; safetensors) to a
megatron-core ``dist_checkpointing`` policy checkpoint that loads at any TP/PP layout. Hub MTP layers
(GLM-4.5, DeepSeek-V3) are skipped with one line of notice (``srpo_megatron/conversion/mtp.py``).

    tools/convert_hf_to_megatron.py --hf-dir DIR --out-dir DIR [--dtype bf16|fp32] [--force]

Layout of the output and the design choices: ``srpo_megatron/conversion/checkpoint.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.compat.fallbacks import hide_fallback_warnings
from srpo_megatron.conversion.checkpoint import DTYPES, hf_to_megatron


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--out-dir", required=True, help="output dist_checkpointing directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="parameter dtype (default: the HF tensors')")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out-dir")
    args = p.parse_args(argv)
    hide_fallback_warnings()  # megatron's expected TE/Apex fallbacks: one line instead (compat/fallbacks.py)
    hf_to_megatron(args.hf_dir, args.out_dir, dtype=DTYPES.get(args.dtype), force=args.force)
    return 0


if __name__ == "__main__":  # dist_checkpointing.save spawns a manager process: keep the guard
    sys.exit(main())
