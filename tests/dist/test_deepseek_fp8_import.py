"""FP8 import is exact: a blockwise-FP8 tiny DeepSeek-V3 folder, made from known bf16 weights by an
independent per-block quantizer (``tests/helpers/fp8.py``; 16x24 blocks, so most weights end in partial edge
blocks and a transposed block size would show), converts to a checkpoint whose every parameter, loaded at
TP1, TP2 (x ETP2) and EP2, equals bit for bit the one loaded from the reference bf16 folder (each FP8 weight
replaced by its per-block reference dequantization). The same checkpoint exports back to that reference
folder bit for bit, and with ``--fp8`` to the FP8 folder's bytes (weights, scales and quantization_config).

The tiny model: ``tiny_deepseek_model(num_layers=3, first_k_dense_replace=1)`` (layer 0 dense, MLA with q
compression, 8 routed experts in 2 groups + a shared expert), weights in bf16 as the hub's, the router bias
in fp32. Megatron's real policy on gloo ranks (``srpo_megatron/testing/distributed.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_deepseek_model
from tests.helpers.conversion import assert_bit_exact, read_hf_tensors
from tests.helpers.fp8 import save_bf16, write_fp8_folder

pytestmark = pytest.mark.moe

BLOCK = (16, 24)


def _convert_worker(rank, world, fp8_dir, mg, dense, fp8_back):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron, megatron_to_hf

    hf_to_megatron(fp8_dir, mg, progress=lambda _: None)
    megatron_to_hf(mg, dense, max_shard_bytes=60_000, progress=lambda _: None)
    megatron_to_hf(mg, fp8_back, fp8=True, progress=lambda _: None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8_import")
    save_bf16(
        tiny_deepseek_model(seed=0, num_layers=3, first_k_dense_replace=1, q_lora_rank=24), work / "bf16"
    )
    write_fp8_folder(work / "bf16", work / "fp8", work / "ref", BLOCK)
    run_distributed(
        _convert_worker, 1, *(str(work / n) for n in ("fp8", "mg", "dense", "fp8_back")), timeout=300
    )
    return work


def _compare_worker(rank, world, layout, ref_dir, mg):
    """At ``layout``: the policy loaded from the converted checkpoint vs the one loaded from the reference
    bf16 folder; the names of the local parameters that differ (empty: bit for bit)."""
    from srpo_megatron.conversion.checkpoint import load_policy_checkpoint
    from srpo_megatron.conversion.safetensors_io import HFCheckpointReader
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights, policy_named_tensors
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    tp, pp, ep, etp = layout
    initialize_model_parallel(tp, pp, ep=ep, etp=etp)
    arch = Architecture.from_hf(ref_dir)
    imported, reference = build_policy(arch), build_policy(arch)
    load_policy_checkpoint(imported, mg)
    reader = HFCheckpointReader(ref_dir)
    load_hf_weights(reference, ConversionTable(arch), reader.get)
    ours, theirs = dict(policy_named_tensors(imported)), dict(policy_named_tensors(reference))
    assert sorted(ours) == sorted(theirs)
    return [n for n in ours if not torch.equal(ours[n], theirs[n])], len(ours)


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (2, 1, 1, 2), (1, 1, 2, 1)], ids=["tp1", "tp2", "ep2"])
def test_fp8_import_is_the_reference_dequantization_bit_for_bit(folders, layout):
    tp, pp, ep, etp = layout
    world = max(tp, etp * ep) * pp
    results = run_distributed(_compare_worker, world, layout, str(folders / "ref"), str(folders / "mg"))
    for rank, (differ, count) in enumerate(results):
        assert count > 0 and differ == [], f"rank {rank} at {layout}: {differ}"


def test_fp8_import_exports_to_the_reference_and_back_to_the_fp8_bytes(folders):
    assert_bit_exact(folders / "ref", folders / "dense")
    assert "quantization_config" not in json.loads((folders / "dense" / "config.json").read_text())
    src, back = read_hf_tensors(folders / "fp8"), read_hf_tensors(folders / "fp8_back")
    assert sorted(src) == sorted(back)
    scales = [n for n in src if n.endswith("_scale_inv")]
    assert len(scales) > 20
    for name, t in src.items():
        got = back[name]
        assert got.dtype == t.dtype, name
        if t.dtype == torch.float8_e4m3fn:
            t, got = t.view(torch.uint8), got.view(torch.uint8)
        assert torch.equal(got, t), name
    qc = json.loads((folders / "fp8" / "config.json").read_text())["quantization_config"]
    assert json.loads((folders / "fp8_back" / "config.json").read_text())["quantization_config"] == qc
    assert _partial_edges(folders / "fp8")


def _partial_edges(folder: Path) -> bool:
    """Some FP8 weight of the folder has a partial edge block on each dimension."""
    tensors = read_hf_tensors(folder)
    rows = any(t.shape[0] % BLOCK[0] for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    cols = any(t.shape[1] % BLOCK[1] for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    return rows and cols
