"""The converters and Python's cyclic GC.

1. The collector is off from the first safetensors header read to the return. A header's JSON is
   thousands of new dicts; parsed with the collector on, in a process that has imported torch, megatron
   and transformers, one full collection can land in it (0.28 s of a 1.4 s FP8 import in
   ``tools/bench_conversion.py``). The workers record ``gc.isenabled()`` at every header parse
   (``_MappedShard.__init__``) and check the collector is back on after the call; the planted case runs
   the undecorated function (``__wrapped__``, what the converters were before ``gc_paused`` covered the
   whole call) and must see it on.
2. The skeleton is gone before its process groups are destroyed (``single_process_megatron``): parts of
   it are in reference cycles (MLA attention, layers with state-dict hooks), and a gloo group whose last reference goes after
   ``destroy_process_group`` costs ~10 ms to destroy (torch 2.13, measured below), ~20 of them per
   conversion. The planted case leaves out the youngest-generation collection that frees it.
"""

from __future__ import annotations

import json
from pathlib import Path

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_hf_model


def gc_at_header_reads_worker(rank, world, src, work, planted):
    import gc

    from srpo_megatron.conversion import checkpoint, safetensors_io

    seen: dict[str, list[bool]] = {"import": [], "export": []}
    stage = ["import"]
    parse = safetensors_io._MappedShard.__init__  # reads and parses the header

    def recording_parse(*args, **kwargs):
        seen[stage[0]].append(gc.isenabled())
        return parse(*args, **kwargs)

    safetensors_io._MappedShard.__init__ = recording_parse
    to_megatron, to_hf = checkpoint.hf_to_megatron, checkpoint.megatron_to_hf
    if planted:
        to_megatron, to_hf = to_megatron.__wrapped__, to_hf.__wrapped__
    try:
        gc.enable()
        to_megatron(src, f"{work}/megatron", progress=lambda _: None)
        after_import = gc.isenabled()
        stage[0] = "export"
        to_hf(f"{work}/megatron", f"{work}/exported", progress=lambda _: None)
        after_export = gc.isenabled()
    finally:
        safetensors_io._MappedShard.__init__ = parse
    Path(f"{work}/seen.json").write_text(json.dumps({**seen, "after": [after_import, after_export]}))


def _run(tmp_path, planted: bool) -> dict:
    src = tmp_path / "hf"
    tiny_hf_model("qwen2").save_pretrained(src)
    run_distributed(gc_at_header_reads_worker, 1, str(src), str(tmp_path), planted, timeout=300)
    return json.loads((tmp_path / "seen.json").read_text())


def test_no_collection_can_land_in_a_converters_header_parse(tmp_path):
    seen = _run(tmp_path, planted=False)
    assert seen["import"], "the import parsed no safetensors header through safetensors_io"
    assert not any(seen["import"]), seen
    assert seen["after"] == [True, True], "the converters must restore the collector"


def test_planted_gc_on_during_the_header_reads_is_caught(tmp_path):
    seen = _run(tmp_path, planted=True)
    assert any(seen["import"]), seen


def skeleton_gone_before_groups_worker(rank, world, src, work, planted):
    """Per converter: how many of the skeleton's modules were still alive when ``destroy_process_group``
    ran. As the tools run them: a plain process, no torchrun world (the converter makes and ends its own)."""
    import gc
    import os
    import weakref

    import torch.distributed as dist

    from srpo_megatron.conversion import checkpoint

    dist.destroy_process_group()
    os.environ.pop("RANK")

    skeletons: list[list] = []
    alive_at_destroy: list[int] = []
    build, destroy = checkpoint._skeleton, dist.destroy_process_group

    def recording_build(*args, **kwargs):
        model = build(*args, **kwargs)
        skeletons.append([weakref.ref(m) for m in model.modules()])
        return model

    def recording_destroy(group=None):
        if group is None:  # the world's (megatron destroys its gloo groups one by one before)
            alive_at_destroy.append(sum(ref() is not None for ref in skeletons[-1]))
        return destroy(group)

    checkpoint._skeleton, dist.destroy_process_group = recording_build, recording_destroy
    collect = checkpoint.gc.collect
    if planted:
        checkpoint.gc.collect = lambda generation=2: 0
    try:
        checkpoint.hf_to_megatron(src, f"{work}/megatron", progress=lambda _: None)
        checkpoint.megatron_to_hf(f"{work}/megatron", f"{work}/exported", progress=lambda _: None)
    finally:
        checkpoint._skeleton, dist.destroy_process_group = build, destroy
        checkpoint.gc.collect = collect
    gc.collect()
    Path(f"{work}/alive.json").write_text(json.dumps(alive_at_destroy))


def _run_skeleton(tmp_path, planted: bool) -> list[int]:
    from srpo_megatron.testing.tiny import tiny_deepseek_model

    src = tmp_path / "hf"
    tiny_deepseek_model(num_layers=2, first_k_dense_replace=1).save_pretrained(src)
    run_distributed(skeleton_gone_before_groups_worker, 1, str(src), str(tmp_path), planted, timeout=300)
    return json.loads((tmp_path / "alive.json").read_text())


def test_the_skeleton_is_gone_before_its_process_groups_are_destroyed(tmp_path):
    assert _run_skeleton(tmp_path, planted=False) == [0, 0]  # modules alive at import's, export's destroy


def test_planted_no_collection_leaves_skeleton_modules_alive_at_destroy(tmp_path):
    # Parts of the skeleton (MLA attention, linear layers with state-dict hooks) are in reference cycles:
    # dropping the names alone does not free them, and they hold the groups.
    alive = _run_skeleton(tmp_path, planted=True)
    assert all(n > 0 for n in alive), alive


def group_teardown_worker(rank, world, work):
    import time

    import torch.distributed as dist

    groups = [dist.new_group([0]) for _ in range(8)]
    start = time.perf_counter()
    dist.destroy_process_group()
    in_destroy = time.perf_counter() - start
    start = time.perf_counter()
    del groups
    after = time.perf_counter() - start
    Path(f"{work}/teardown.json").write_text(json.dumps([in_destroy, after]))


def test_why_groups_released_after_destroy_are_avoided(tmp_path):
    """The measurement behind ``single_process_megatron``'s collection, printed; asserts no timing."""
    run_distributed(group_teardown_worker, 1, str(tmp_path), timeout=300)
    in_destroy, after = json.loads((tmp_path / "teardown.json").read_text())
    print(
        f"8 gloo groups: destroy_process_group {in_destroy:.4f} s, their last references after it {after:.4f} s"
    )
