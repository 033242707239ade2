#!/usr/bin/env python3
"""Export the policy of a megatron-core checkpoint (from tools/convert_hf_to_megatron.py or the trainer)
to an HF folder: sharded safetensors + index, config.json, tokenizer and generation config.

    tools/convert_megatron_to_hf.py --megatron-dir DIR --out-dir DIR [--dtype bf16|fp32]
                                    [--max-shard-size 5GB] [--force] [--mtp-from HF_DIR]

GLM-4.5 / DeepSeek-V3 MTP layers are re-emitted unchanged from --mtp-from, or by default from the HF folder
the checkpoint was converted or trained from (``hf_source.json``), when that folder has them.

Expected input layout: ``srpo_megatron/conversion/checkpoint.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.conversion.checkpoint import DTYPES, megatron_to_hf
from srpo_megatron.conversion.safetensors_io import parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-dir", required=True, help="dist_checkpointing dir with hf_config.json")
    p.add_argument("--out-dir", required=True, help="output HF model folder")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the checkpoint's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 5GB, 500MB)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out-dir")
    p.add_argument("--mtp-from", help="HF folder whose MTP layers to copy (default: the recorded source)")
    args = p.parse_args(argv)
    megatron_to_hf(
        args.megatron_dir,
        args.out_dir,
        dtype=DTYPES.get(args.dtype),
        max_shard_bytes=parse_size(args.max_shard_size),
        force=args.force,
        mtp_from=args.mtp_from,
    )
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns a manager process: keep the guard
    sys.exit(main())
