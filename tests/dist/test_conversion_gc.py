"""The converters keep Python's cyclic GC off from their first safetensors header read to their return.

A header's JSON is thousands of new dicts; parsed with the collector on, in a process that has imported
torch, megatron and transformers, one full collection can land in it (0.28 s of a 1.4 s FP8 import in
``tools/bench_conversion.py``). The workers record ``gc.isenabled()`` at every header parse and check the
collector is back on after the call; the planted case runs the undecorated function (``__wrapped__``,
what the converters were before ``gc_paused`` covered the whole call) and must see it on.
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
    loads = safetensors_io.json.loads

    def recording_loads(*args, **kwargs):
        seen[stage[0]].append(gc.isenabled())
        return loads(*args, **kwargs)

    safetensors_io.json.loads = recording_loads
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
        safetensors_io.json.loads = loads
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
