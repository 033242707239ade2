"""tools/prepare_smollm2.py: the prepared HF folder loads in plain transformers (no GGUF) and its logits
equal those of the GGUF-dequantized model that transformers loads directly; a second call is a no-op."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from srpo_megatron.data.assets import AssetMissing, smollm2_gguf_path

ROOT = Path(__file__).resolve().parents[2]


def _load_tool():
    spec = importlib.util.spec_from_file_location("prepare_smollm2", ROOT / "tools" / "prepare_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepared_folder_matches_gguf_logits(tmp_path):
    try:
        gguf = smollm2_gguf_path()
    except AssetMissing as e:
        pytest.skip(str(e))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tool = _load_tool()
    out = tmp_path / "smollm2-hf"
    tool.prepare(out)
    assert tool.is_prepared(out)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    tool.prepare(out)  # cached: nothing rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"

    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt").input_ids

    prepared = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not hasattr(prepared.config, "quantization_config")
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        got = prepared(ids).logits
        want = reference(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
