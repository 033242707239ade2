"""``weights.fused_experts``: the SGLang-bound stream carries gpt-oss's fused expert tensors whole, built
from the trainer's per-expert slices (EP rank order) at each slice's index, every expert exactly once;
equal to the checkpoint's tensors, and what the SGLang engine's gate (manifest: the file names) accepts."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.buckets import bucketize_pending, flat_buckets
from srpo_megatron.conversion.manifest import hf_manifest
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.rollout.base import EngineError
from srpo_megatron.weights.fused_experts import SliceOrderError, fuse_expert_slices
from tests.helpers.conversion import read_hf_tensors
from tests.helpers.fused_experts import export_stream
from tests.helpers.sglang import sync_through_gate

pytestmark = pytest.mark.moe


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    from srpo_megatron.testing.tiny import tiny_gpt_oss_model

    folder = tmp_path_factory.mktemp("oss") / "gpt_oss"
    tiny_gpt_oss_model(seed=0).save_pretrained(folder)
    return folder, ConversionTable(Architecture.from_hf(folder)), read_hf_tensors(folder)


def _stream(pending) -> list[tuple[str, torch.Tensor]]:
    return [t for p in pending for t in p.fetch()]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_fused_stream_is_the_checkpoint(oss, ep):
    folder, table, files = oss
    sliced = _stream(export_stream(table, files, ep))
    assert any(n.endswith("gate_up_proj[3]") for n, _ in sliced)  # the table's slices go in
    fused = _stream(fuse_expert_slices(export_stream(table, files, ep), table))
    names = [n for n, _ in fused]
    assert sorted(names) == sorted(n for n, _ in table.hf_file_plan()) and len(set(names)) == len(names)
    x = "model.layers.0.mlp.experts."
    assert [n for n in names if n.startswith(x)] == [x + k for k in ("gate_up_proj", "gate_up_proj_bias")] + [
        x + k for k in ("down_proj", "down_proj_bias")
    ]  # one fused tensor after the other, where the layer's experts were
    for name, t in fused:
        assert torch.equal(t, files[name]), name  # an expert at the wrong index differs here
    assert sync_through_gate(folder, iter(fused)).weight_version == 1
    with pytest.raises(
        EngineError, match=r"unexpected tensor model\.layers\.0\.mlp\.experts\.gate_up_proj\["
    ):
        sync_through_gate(folder, iter(sliced))  # the slices: refused by the SGLang manifest


def test_flat_buckets_write_the_slices_in_place(oss):
    folder, table, files = oss
    small = 1024  # every fused tensor alone in its bucket: a bucket exceeds this by up to one fused tensor
    for bucket in flat_buckets(fuse_expert_slices(export_stream(table, files, 2), table), small):
        views = bucket.views()
        if any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n, _ in views):
            assert len(views) == 1, [n for n, _ in views]  # a fused tensor goes alone (it exceeds ``small``)
        for name, t in views:
            assert torch.equal(t, files[name]), name
    got = [
        n
        for b in bucketize_pending(fuse_expert_slices(export_stream(table, files, 2), table), small)
        for n, _ in b
    ]
    assert sorted(got) == sorted(hf_manifest(str(folder)))


def test_dense_stream_passes_through(tmp_path):
    from srpo_megatron.testing.tiny import write_tiny_qwen3_moe

    folder = write_tiny_qwen3_moe(tmp_path / "moe")
    table = ConversionTable(Architecture.from_hf(folder))
    pending = export_stream(table, read_hf_tensors(folder), 2)
    assert list(fuse_expert_slices(pending, table)) == pending


@pytest.mark.parametrize("planted", ["missing", "repeated"])
def test_a_lost_or_repeated_slice_is_refused_before_any_gather(oss, planted):
    _, table, files = oss
    pending = export_stream(table, files, 2)
    k = next(i for i, p in enumerate(pending) if ".local_experts.1.linear_fc1.weight" in p.name)
    if planted == "missing":
        del pending[k]
    else:
        pending[k] = pending[k - 4 if k >= 4 else k + 4]  # expert 0's fc1 twice, expert 1's never
    fetched = []
    for p in pending:
        p.fetch = (lambda f, n: lambda: fetched.append(n) or f())(p.fetch, p.name)
    with pytest.raises(
        SliceOrderError, match=r"gate_up_proj: the stream announces experts .*missing \[1, 3\]"
    ):
        list(fuse_expert_slices(pending, table))
    assert not any(".experts." in n for n in fetched)


def test_a_fetch_that_returns_other_slices_than_announced_is_refused(oss):
    _, table, files = oss
    pending = export_stream(table, files, 2)
    p = next(p for p in pending if p.name.endswith("local_experts.0.linear_fc2.weight"))
    right = p.fetch
    p.fetch = lambda: list(reversed(right()))  # experts 2, 0 where 0, 2 were announced
    with pytest.raises(SliceOrderError, match=r"fetch returned .*down_proj\[2\].*announced"):
        _stream(fuse_expert_slices(pending, table))
