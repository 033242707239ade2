"""GLM-4.5 conversion: HF -> megatron -> HF is bit-exact (the routers' e_score_correction_bias and the hub's
MTP layer included: skipped on import with one notice, re-emitted unchanged on export), transformers loads
the export, and the converted checkpoint loads at TP2xETP2 and at EP2 with the HF logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_glm_moe_model
from tests.helpers.conversion import assert_bit_exact, read_hf_tensors
from tests.helpers.moe import batches_for, run_moe_layout

pytestmark = pytest.mark.moe

NUM_LAYERS = 3  # tiny_glm_moe_config: the MTP layer is model.layers.3


def _mtp_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A hub-like MTP layer: layer 2's tensors renamed to layer 3, plus NextN's own projections."""
    gen = torch.Generator().manual_seed(7)
    out = {
        k.replace("model.layers.2.", f"model.layers.{NUM_LAYERS}."): torch.randn(v.shape, generator=gen)
        for k, v in state.items()
        if k.startswith("model.layers.2.")
    }
    h = state["model.norm.weight"].shape[0]
    out[f"model.layers.{NUM_LAYERS}.enorm.weight"] = torch.randn(h, generator=gen)
    out[f"model.layers.{NUM_LAYERS}.hnorm.weight"] = torch.randn(h, generator=gen)
    out[f"model.layers.{NUM_LAYERS}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen)
    out[f"model.layers.{NUM_LAYERS}.shared_head.norm.weight"] = torch.randn(h, generator=gen)
    return out


@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory):
    """A tiny GLM folder as the hub ships it: one MTP layer after the model's layers."""
    folder = tmp_path_factory.mktemp("glm") / "glm4_moe"
    tiny_glm_moe_model(seed=5, grouped=True).save_pretrained(folder)
    state = read_hf_tensors(folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({**state, **_mtp_tensors(state)}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def convert_worker(rank, world, src, mg, dst, log_file):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron, megatron_to_hf

    lines: list[str] = []
    hf_to_megatron(src, mg, progress=lines.append)
    megatron_to_hf(mg, dst, max_shard_bytes=20_000, progress=lines.append)
    with open(log_file, "w") as f:
        f.write("\n".join(lines))


def test_round_trip_is_bit_exact_with_bias_and_mtp(glm_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    mg, back, log = tmp_path / "mg", tmp_path / "back", tmp_path / "log.txt"
    run_distributed(convert_worker, 1, str(glm_folder), str(mg), str(back), str(log), timeout=300)
    names = read_hf_tensors(glm_folder)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
    assert f"model.layers.{NUM_LAYERS}.eh_proj.weight" in names
    assert names["model.layers.2.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert_bit_exact(glm_folder, back)
    lines = log.read_text().splitlines()
    skipped = [line for line in lines if line.startswith("skipping") and "MTP" in line]
    assert len(skipped) == 1 and f"[{NUM_LAYERS}]" in skipped[0], lines
    ids = batches_for(5)[0]
    src = AutoModelForCausalLM.from_pretrained(glm_folder, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(src(ids).logits, exported(ids).logits)


def test_export_without_the_source_folder_says_so(glm_folder, tmp_path):
    """A checkpoint whose source folder is gone exports the policy alone, with one line saying so."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(glm_folder, src)
    mg, back, log = tmp_path / "mg", tmp_path / "back", tmp_path / "log.txt"
    run_distributed(convert_worker, 1, str(src), str(mg), str(tmp_path / "first"), str(log), timeout=300)
    shutil.rmtree(src)

    run_distributed(export_worker, 1, str(mg), str(back), str(log), timeout=300)
    exported = read_hf_tensors(back)
    assert not [n for n in exported if n.startswith(f"model.layers.{NUM_LAYERS}.")]
    assert "no MTP layers exported" in log.read_text()


def export_worker(rank, world, mg, dst, log_file):
    from srpo_megatron.conversion.checkpoint import megatron_to_hf

    lines: list[str] = []
    megatron_to_hf(mg, dst, progress=lines.append)
    with open(log_file, "w") as f:
        f.write("\n".join(lines))


@pytest.mark.parametrize("layout", [(2, 1, 1, 2), (1, 1, 2, 1)], ids=["tp2etp2", "ep2"])
def test_converted_checkpoint_loads_with_the_hf_logits(glm_folder, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(glm_folder, dtype=torch.float32).eval()
    batches = batches_for(7)
    with torch.no_grad():
        ref = [hf(ids).logits for ids in batches]
    mg = tmp_path / "mg"
    run_distributed(convert_worker, 1, str(glm_folder), str(mg), str(tmp_path / "x"), str(tmp_path / "l"))
    case = (hf.config.to_dict(), "alltoall", batches, None, str(mg))
    [(logits, _)] = run_moe_layout(layout, [case], backward=False)
    for got, want in zip(logits, ref, strict=True):
        assert (got[..., : want.shape[-1]] - want).abs().max().item() <= 1e-5


def bf16_worker(rank, world, src, mg, dst):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron, megatron_to_hf

    hf_to_megatron(src, mg, dtype=torch.bfloat16, progress=lambda _: None)
    megatron_to_hf(mg, dst, progress=lambda _: None)


def test_bf16_round_trip_keeps_the_expert_bias_and_mtp_exact(glm_folder, tmp_path):
    """A bf16 checkpoint and its export: the fp32 e_score_correction_bias and the MTP layer come back bit
    for bit (never through bf16), every other tensor is the source cast to bf16."""
    mg, back = tmp_path / "mg", tmp_path / "back"
    run_distributed(bf16_worker, 1, str(glm_folder), str(mg), str(back), timeout=300)
    src, got = read_hf_tensors(glm_folder), read_hf_tensors(back)
    assert sorted(src) == sorted(got)
    for name, want in src.items():
        keep = name.endswith("e_score_correction_bias") or name.startswith(f"model.layers.{NUM_LAYERS}.")
        want = want if keep else want.to(torch.bfloat16)
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
