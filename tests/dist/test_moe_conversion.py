"""Qwen3-MoE conversion: HF -> megatron -> HF is bit-exact (per-expert hub names), transformers loads the
export, the converted checkpoint loads at EP2 and PP2xEP2 with the HF logits, and a checkpoint saved at EP2
(as the trainer saves) loads at EP1 with logits identical to EP1 built from the same HF weights.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_moe_model
from tests.helpers.conversion import assert_bit_exact, read_hf_tensors, round_trip_worker
from tests.helpers.moe import batches_for, run_moe_layout

pytestmark = pytest.mark.moe


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe") / "qwen3_moe"
    tiny_moe_model(seed=3).save_pretrained(folder)
    return folder


def test_round_trip_is_bit_exact_and_loads_in_transformers(moe_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    mg, back = tmp_path / "mg", tmp_path / "back"
    run_distributed(round_trip_worker, 1, [(str(moe_folder), str(mg), str(back))], 20_000, timeout=300)
    names = read_hf_tensors(moe_folder)
    assert (
        "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    )
    assert_bit_exact(moe_folder, back)
    assert len(list(back.glob("*.safetensors"))) > 1  # the small shard bound splits the export
    ids = batches_for(5)[0]
    src = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(src(ids).logits, exported(ids).logits)


def ep_save_worker(rank, world, src, out):
    """Save like the trainer (policy sharded_state_dict under "model.") at EP2."""
    from megatron.core import dist_checkpointing

    from srpo_megatron.conversion.checkpoint import POLICY_PREFIX
    from srpo_megatron.conversion.safetensors_io import HFCheckpointReader
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1, ep=2)
    arch = Architecture.from_hf(src)
    model = build_policy(arch)
    reader = HFCheckpointReader(src)
    load_hf_weights(model, ConversionTable(arch), reader.get)
    dist_checkpointing.save({"model": model.sharded_state_dict(prefix=POLICY_PREFIX), "iteration": 3}, out)


def _reference(moe_folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32).eval()
    batches = batches_for(7)
    with torch.no_grad():
        ref = [hf(ids).logits for ids in batches]
    return hf.config.to_dict(), batches, ref


def test_converted_checkpoint_loads_at_ep2_with_the_hf_logits(moe_folder, tmp_path):
    """The converter's checkpoint (written from a TP1/EP1 skeleton) resharded by megatron onto EP2."""
    config, batches, ref = _reference(moe_folder)
    mg = tmp_path / "mg"
    run_distributed(round_trip_worker, 1, [(str(moe_folder), str(mg), str(tmp_path / "unused"))], 10**9)
    case = (config, "alltoall", batches, None, str(mg))
    [(logits, _)] = run_moe_layout((1, 1, 2, 1), [case], backward=False)
    for got, want in zip(logits, ref, strict=True):
        assert (got[..., : want.shape[-1]] - want).abs().max().item() <= 1e-5


def test_checkpoint_saved_at_ep2_loads_at_ep1_with_identical_logits(moe_folder, tmp_path):
    """Saved at EP2 as the trainer saves, loaded at EP1: identical to EP1 loaded from the HF weights."""
    from srpo_megatron.conversion.checkpoint import HF_CONFIG_NAME

    config, batches, _ = _reference(moe_folder)
    state = read_hf_tensors(moe_folder)
    ckpt = tmp_path / "ep2"
    ckpt.mkdir()
    run_distributed(ep_save_worker, 2, str(moe_folder), str(ckpt), timeout=300)
    shutil.copy(moe_folder / "config.json", ckpt / HF_CONFIG_NAME)
    [(from_ckpt, _), (from_hf, _)] = run_moe_layout(
        (1, 1, 1, 1),
        [(config, "alltoall", batches, None, str(ckpt)), (config, "alltoall", batches, state, None)],
        backward=False,
    )
    for a, b in zip(from_ckpt, from_hf, strict=True):
        assert torch.equal(a, b)
