"""A full sync of the tiny Qwen3-MoE policy (megatron, EP 2, gloo) passes the SGLang engine's gate.

The stream is the trainer's own (``weights.export.iter_stage_params`` at EP 2: experts gathered over EP
onto the stage sender, per-expert file names); the engine builds its manifest from the model folder as
in production (``conversion.manifest.hf_manifest``). The manifest transformers' in-memory model gives (fused
experts, the defect of issue 24 D5) rejects the same stream.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.moe


def stream_worker(rank, world, hf_dir):
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.weights.export import iter_stage_hf_tensors
    from tests.helpers.conversion import read_hf_tensors

    groups = initialize_model_parallel(1, 1, ep=2, etp=1)
    arch = Architecture.from_hf(hf_dir)
    table = ConversionTable(arch)
    model = build_policy(arch)
    load_hf_weights(model, table, read_hf_tensors(hf_dir).__getitem__)
    return list(iter_stage_hf_tensors(model, table, groups))  # the stage sender's stream, [] elsewhere


def test_ep2_policy_stream_passes_the_sglang_gate(tmp_path):
    import torch

    from srpo_megatron.rollout.base import EngineError
    from srpo_megatron.testing.tiny import write_tiny_qwen3_moe
    from tests.helpers.conversion import read_hf_tensors
    from tests.helpers.sglang import in_memory_manifest, sync_through_gate

    hf_dir = write_tiny_qwen3_moe(tmp_path / "moe")
    sender, other = run_distributed(stream_worker, 2, hf_dir, timeout=600)
    assert other == []
    names = [n for n, _ in sender]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names  # expert 3 lives on EP rank 1
    files = read_hf_tensors(hf_dir)
    assert sorted(names) == sorted(files) and all(torch.equal(t, files[n]) for n, t in sender)
    assert sync_through_gate(hf_dir, iter(sender)).weight_version == 1
    with pytest.raises(EngineError, match=r"unexpected tensor model\.layers\.0\.mlp\.experts\."):
        sync_through_gate(hf_dir, iter(sender), manifest=in_memory_manifest(str(hf_dir)))
