"""The streamed megatron -> HF export (tensor by tensor, ``TorchDistReader`` + ``PlannedSafetensorsWriter``)
writes exactly the files the whole-model export wrote (load the policy with ``dist_checkpointing.load``,
then ``ShardedSafetensorsWriter``; kept below as the reference), for dense and MoE checkpoints, a converted
bf16 one exported to fp32, and a trainer checkpoint saved at TP2xPP2; and its peak memory is a few of the
largest tensors where the whole-model export's is the model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_hf_model, tiny_moe_model
from tests.helpers.conversion import trainer_save_worker


def whole_model_export(ckpt_dir, out_dir, max_shard_bytes, dtype=None):
    """The export as it was before streaming: the whole policy loaded, then written shard by shard."""
    import json

    from srpo_megatron.conversion.checkpoint import (
        HF_CONFIG_NAME,
        load_policy_checkpoint,
        stored_policy_dtype,
    )
    from srpo_megatron.conversion.safetensors_io import ShardedSafetensorsWriter
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.models.architecture import Architecture, load_hf_config_dict
    from srpo_megatron.models.policy import build_policy

    arch = Architecture.from_hf(load_hf_config_dict(Path(ckpt_dir) / HF_CONFIG_NAME))
    table = ConversionTable(arch)
    stored = stored_policy_dtype(ckpt_dir)
    model = build_policy(arch, params_dtype=stored, perform_initialization=False)
    load_policy_checkpoint(model, ckpt_dir)
    Path(out_dir).mkdir()
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes)
    params = dict(model.named_parameters())
    for name in table.megatron_names():
        for hf_name, tensor in table.to_hf(name, params[name].detach()):
            writer.add(hf_name, tensor.to(dtype or stored))
    writer.close()
    return json.loads((Path(ckpt_dir) / HF_CONFIG_NAME).read_text())


def export_pair_worker(rank, world, cases):
    """Per case (src HF dir or None, megatron dir, streamed out, reference out, max shard, dtype name)."""
    from srpo_megatron.conversion.checkpoint import DTYPES, hf_to_megatron, megatron_to_hf
    from srpo_megatron.conversion.checkpoint import single_process_megatron as megatron

    for src, mg, streamed, ref, max_shard, dtype in cases:
        if src is not None:
            hf_to_megatron(src, mg, progress=lambda _: None)
        megatron_to_hf(
            mg, streamed, dtype=DTYPES.get(dtype), max_shard_bytes=max_shard, progress=lambda _: None
        )
        with megatron():
            whole_model_export(mg, ref, max_shard, DTYPES.get(dtype))


def convert_worker(rank, world, src, mg):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron

    hf_to_megatron(src, mg, progress=lambda _: None)


def weight_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if "safetensors" in p.name}


def test_streamed_export_writes_the_whole_model_exports_files(tmp_path):
    cases = []
    for name, model, dtype in [
        ("llama", tiny_hf_model("llama", seed=0), None),  # tied embeddings
        ("qwen2_bf16_to_fp32", tiny_hf_model("qwen2", seed=1).to(torch.bfloat16), "fp32"),
        ("qwen3", tiny_hf_model("qwen3", seed=2), "bf16"),
        ("qwen3_moe", tiny_moe_model(seed=3), None),
    ]:
        model.save_pretrained(tmp_path / name)
        for max_shard in (20_000, 5 * 10**9):  # sharded with an index, and one file
            case = tmp_path / f"{name}_{max_shard}"
            cases.append(
                (str(tmp_path / name), str(case / "mg"), str(case / "s"), str(case / "r"), max_shard, dtype)
            )
    # A trainer checkpoint saved at TP2 x PP2: every parameter is assembled from several stored chunks.
    trainer = tmp_path / "trainer_ckpt"
    trainer.mkdir()
    run_distributed(trainer_save_worker, 4, 2, 2, str(tmp_path / "llama"), str(trainer), timeout=300)
    shutil.copy(tmp_path / "llama" / "config.json", trainer / "hf_config.json")
    cases.append((None, str(trainer), str(tmp_path / "trainer_s"), str(tmp_path / "trainer_r"), 20_000, None))
    run_distributed(export_pair_worker, 1, cases, timeout=600)
    for *_, streamed, ref, max_shard, _ in cases:
        got, want = weight_files(Path(streamed)), weight_files(Path(ref))
        assert got.keys() == want.keys(), streamed
        assert ("model.safetensors.index.json" in got) == (max_shard == 20_000), streamed
        for name in want:
            assert got[name] == want[name], (streamed, name)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def peak_memory_worker(rank, world, mg, streamed, ref):
    """Peak RSS above the RSS before each export (the kernel's high-water mark, restarted before each):
    the streamed export, then the whole-model one."""
    from srpo_megatron.conversion.checkpoint import megatron_to_hf
    from srpo_megatron.conversion.checkpoint import single_process_megatron as megatron

    def whole() -> None:
        with megatron():
            whole_model_export(mg, ref, 5 * 10**9)

    # Warm-up: the first export imports the model code and sets up megatron state, which stay resident.
    megatron_to_hf(mg, streamed + "_warm", progress=lambda _: None)
    peaks = []
    for export in (lambda: megatron_to_hf(mg, streamed, progress=lambda _: None), whole):
        base = _rss()
        Path("/proc/self/clear_refs").write_text("5")
        export()
        peaks.append(_peak_rss() - base)
    return peaks


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's VmHWM reset")
def test_streamed_export_peak_memory_is_a_few_tensors_not_the_model(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    total, largest = sum(sizes), max(sizes)
    model.save_pretrained(tmp_path / "hf")
    del model
    mg = tmp_path / "mg"
    run_distributed(convert_worker, 1, str(tmp_path / "hf"), str(mg))
    [(streamed, whole)] = run_distributed(
        peak_memory_worker, 1, str(mg), str(tmp_path / "s"), str(tmp_path / "r")
    )
    assert total > 15 * largest  # the bound below separates the two exports
    # Measured: below 4x on megatron-core 0.16.1, 4.1x on 0.19.2 (the extra is not analysed yet).
    assert streamed <= 6 * largest, (streamed / largest, total / largest)
    assert whole >= total, (whole / largest, total / largest)  # the check can fail: the model-sized peak
