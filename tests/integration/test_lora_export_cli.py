"""``tools/convert_megatron_to_hf.py`` on a LoRA checkpoint: ``--lora-adapter-out`` writes a PEFT folder that
peft loads onto the HF base, ``--out-dir`` the merged model; both give the logits of an independent float64
``W + (alpha/r) B A`` (fp32, <= 1e-5). A checkpoint without LoRA refuses ``--lora-adapter-out`` in one line.

The checkpoint is hand-made, as the trainer will save one (the model-side adapters live on another branch):
the converter's torch_dist checkpoint of a tiny Qwen3, re-saved with the adapters added under
``model.<adapter name>`` at full shape, and a ``recipe.yaml`` with the ``lora`` section."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.testing.tiny import tiny_hf_model
from tests.helpers.lora_adapters import random_adapters, reference_logits

REPO = Path(__file__).resolve().parents[2]
peft = pytest.importorskip("peft")


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / name), *args], capture_output=True, text=True, timeout=600
    )


def _with_adapters(src: Path, dst: Path, adapters: dict[str, torch.Tensor], lora: LoraConfig) -> None:
    """``src``'s tensors and the adapters (``model.`` + name) re-saved as one torch_dist checkpoint."""
    import torch.distributed.checkpoint as dcp

    from srpo_megatron.conversion.dist_reader import TorchDistReader

    reader = TorchDistReader(src)
    state = {}
    for key, md in reader.metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            state[key] = reader.read(key, (0,) * len(md.size), tuple(md.size)).clone()
    reader.close()
    state.update({f"model.{n}": t for n, t in adapters.items()})
    dst.mkdir()
    for f in src.iterdir():  # hf_config.json, megatron's metadata.json and common.pt (not the converter's
        # srpo_conversion.json: its sizes are the converter's files)
        if f.is_file() and f.suffix != ".distcp" and f.name not in (".metadata", "srpo_conversion.json"):
            shutil.copy2(f, dst / f.name)
    dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    recipe = {"lora": {"rank": lora.rank, "alpha": lora.alpha, "target_modules": lora.target_modules}}
    (dst / "recipe.yaml").write_text(yaml.safe_dump(recipe))


def test_tool_writes_a_peft_folder_and_a_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tiny_hf_model("qwen3", num_layers=2)
    base.save_pretrained(tmp_path / "hf")
    done = _tool(
        "convert_hf_to_megatron.py", "--hf-dir", str(tmp_path / "hf"), "--out-dir", str(tmp_path / "mg")
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    adapters = random_adapters(base, lora)
    _with_adapters(tmp_path / "mg", tmp_path / "ckpt", adapters, lora)
    out = _tool(
        "convert_megatron_to_hf.py", "--megatron-dir", str(tmp_path / "ckpt"),
        "--out-dir", str(tmp_path / "merged"), "--lora-adapter-out", str(tmp_path / "adapter"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "merging 8 LoRA adapters" in out.stderr
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    want = reference_logits(base, adapters, lora, ids)
    with torch.no_grad():
        got_peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        got_merged = merged(ids).logits
    torch.testing.assert_close(got_peft.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_merged.double(), want, rtol=0, atol=1e-5)

    refused = _tool(
        "convert_megatron_to_hf.py", "--megatron-dir", str(tmp_path / "mg"), "--lora-adapter-out",
        str(tmp_path / "none"),
    )  # fmt: skip
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()[-1:]
    assert "was not trained with LoRA" in line and "--out-dir" in line
