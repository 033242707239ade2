"""The SGLang engine's weight manifest is the checkpoint's FILE names (per-expert for MoE), from the
conversion table: what the trainer streams and what SGLang's ``load_weights`` reads. transformers >= 5
holds Qwen3-MoE experts fused in memory (``mlp.experts.gate_up_proj``), so a manifest read off the
in-memory model rejects every MoE sync (issue 24, D5; planted below as ``in_memory_manifest``)."""

from __future__ import annotations

import pytest

from srpo_megatron.conversion.manifest import hf_manifest
from srpo_megatron.rollout.base import EngineError
from tests.helpers.conversion import read_hf_tensors
from tests.helpers.sglang import in_memory_manifest, sync_through_gate


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_dense"))


@pytest.mark.moe
def test_moe_manifest_is_the_per_expert_file_names(tiny_moe):
    files = read_hf_tensors(tiny_moe)
    manifest = hf_manifest(str(tiny_moe))
    assert manifest == {n: tuple(t.shape) for n, t in files.items()}
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in manifest
    assert not [n for n in manifest if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]


def test_dense_manifest_is_the_file_names(tiny_dense):
    files = read_hf_tensors(tiny_dense)
    assert hf_manifest(str(tiny_dense)) == {n: tuple(t.shape) for n, t in files.items()}


@pytest.mark.moe
def test_moe_file_stream_passes_the_gate_and_the_in_memory_manifest_rejects_it(tiny_moe):
    files = read_hf_tensors(tiny_moe)  # what the trainer streams (tests/dist/test_sglang_moe_sync.py)
    assert sync_through_gate(tiny_moe, files.items()).weight_version == 1
    with pytest.raises(EngineError, match=r"unexpected tensor model\.layers\.0\.mlp\.experts\.0\."):
        sync_through_gate(tiny_moe, files.items(), manifest=in_memory_manifest(str(tiny_moe)))
