"""The LoRA export against peft itself: an adapter folder written from megatron-named tensors loads with
``peft.PeftModel.from_pretrained`` onto the HF base and gives the logits of an independent float64
``W + (alpha/r) B A``; the merged export, loaded as a plain HF model, gives the same logits.

Tiny Qwen3 (dense, all seven projections adapted) and tiny Qwen3-MoE (attention adapted; its routed experts
are fused 3-D parameters in transformers 5, which a PEFT folder cannot name: refused in one line, while the
merged export covers the experts)."""

from __future__ import annotations

import copy

import pytest
import torch

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_export import (
    merge_lora,
    read_peft_config,
    read_peft_folder,
    write_peft_folder,
)
from srpo_megatron.conversion.lora_table import LoraTable, LoraTableError
from srpo_megatron.models.architecture import Architecture
from tests.helpers.lora import random_adapters, reference_logits

peft = pytest.importorskip("peft")


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def dense():
    from srpo_megatron.testing.tiny import tiny_hf_model

    return tiny_hf_model("qwen3", num_layers=2)


def _load_peft(base, folder):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()


def test_dense_qwen3_adapter_folder_loads_with_peft_and_merges(dense, tmp_path):
    lora = LoraConfig(rank=4, alpha=16.0)  # scaling 4: a swapped r/alpha (0.25) is far off
    table = LoraTable(Architecture.from_hf(dense.config), lora)
    adapters = random_adapters(dense, lora)
    assert set(adapters) == set(table.megatron_names())  # the table speaks the contract's names
    write_peft_folder(tmp_path / "adapter", table, adapters, base_model="tiny-qwen3")
    ids = _ids(dense.config.vocab_size)
    with torch.no_grad():
        got = _load_peft(dense, tmp_path / "adapter")(ids).logits
        base = dense(ids).logits
    want = reference_logits(dense, adapters, lora, ids)
    assert (base.double() - want).abs().max() > 1e-2  # the adapters matter at this tolerance
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    # merged export (pure math on HF names) loaded as a plain HF model gives peft's logits
    peft_tensors = dict(table.to_peft(n, t) for n, t in adapters.items())
    merged = merge_lora(dense.state_dict(), peft_tensors, lora.scaling)
    plain = copy.deepcopy(dense)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, got, rtol=0, atol=1e-5)
    # and the folder reads back to the same megatron tensors and config
    back = read_peft_folder(tmp_path / "adapter", table)
    assert set(back) == set(adapters) and all(torch.equal(back[n], adapters[n]) for n in adapters)
    cfg = read_peft_config(tmp_path / "adapter")
    assert (cfg.rank, cfg.alpha, sorted(cfg.target_modules)) == (4, 16.0, sorted(lora.target_modules))


def test_planted_bugs_fail(dense, tmp_path, monkeypatch):
    """The checks above can fail: k/v adapters written under each other's names (same shapes), a merge
    scaled r/alpha instead of alpha/r, and r/lora_alpha exchanged in adapter_config.json."""
    lora = LoraConfig(rank=4, alpha=16.0, target_modules=["k_proj", "v_proj"])
    table = LoraTable(Architecture.from_hf(dense.config), lora)
    adapters = random_adapters(dense, lora)
    ids = _ids(dense.config.vocab_size)
    want = reference_logits(dense, adapters, lora, ids)
    swapped = {  # planted: the k adapter saved as v's and v's as k's
        n.replace("k_proj", "TMP").replace("v_proj", "k_proj").replace("TMP", "v_proj"): t
        for n, t in adapters.items()
    }
    with torch.no_grad():
        got = _load_peft(dense, write_peft_folder(tmp_path / "kv", table, swapped))(ids).logits
    assert (got.double() - want).abs().max() > 1e-3
    peft_tensors = dict(table.to_peft(n, t) for n, t in adapters.items())
    merged = merge_lora(dense.state_dict(), peft_tensors, lora.rank / lora.alpha)  # planted: r/alpha
    plain = copy.deepcopy(dense)
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert (plain(ids).logits.double() - want).abs().max() > 1e-3
    import srpo_megatron.conversion.lora_export as export

    real = export.peft_adapter_config
    monkeypatch.setattr(  # planted: r and lora_alpha exchanged
        export, "peft_adapter_config",
        lambda lora, t, b: {**real(lora, t, b), "r": int(lora.alpha), "lora_alpha": lora.rank},
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="size mismatch"):  # r=16 does not fit the rank-4 tensors
        _load_peft(dense, write_peft_folder(tmp_path / "swapped", table, adapters))


@pytest.fixture(scope="module")
def moe():
    from srpo_megatron.testing.tiny import tiny_moe_model

    return tiny_moe_model()


def test_qwen3_moe_attention_adapters_load_with_peft_and_experts_merge(moe, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0)
    table = LoraTable(Architecture.from_hf(moe.config), lora)
    adapters = random_adapters(moe, lora)  # transformers 5: only q/k/v/o are nn.Linear targets
    assert set(adapters) == set(table.megatron_names())
    write_peft_folder(tmp_path / "adapter", table, adapters)
    ids = _ids(moe.config.vocab_size)
    with torch.no_grad():
        got = _load_peft(moe, tmp_path / "adapter")(ids).logits
    torch.testing.assert_close(got.double(), reference_logits(moe, adapters, lora, ids), rtol=0, atol=1e-5)

    # experts: a PEFT folder is refused in one line; the merged export folds them in per expert
    lora_x = LoraConfig(rank=2, alpha=4.0, target_modules=["gate_proj", "up_proj", "down_proj"], experts=True)
    table_x = LoraTable(Architecture.from_hf(moe.config), lora_x)
    g = torch.Generator().manual_seed(5)
    experts = {n: torch.randn(table_x.row(n).shape, generator=g) * 0.3 for n in table_x.megatron_names()}
    with pytest.raises(LoraTableError, match="routed-expert adapters") as e:
        write_peft_folder(tmp_path / "experts", table_x, experts)
    assert "\n" not in str(e.value)
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.lora.up_proj.lora_B"
    assert table_x.row(name).peft == "base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight"
    w = torch.randn(32, 64, generator=g)
    peft_x = dict(table_x.to_peft(n, t) for n, t in experts.items())
    hf = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight": w for i in range(2) for e in range(4)
          for p in ("gate_proj", "up_proj")}  # fmt: skip
    hf |= {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight": w.T for i in range(2) for e in range(4)}
    merged = merge_lora(hf, peft_x, lora_x.scaling)
    a = experts[name.replace("lora_B", "lora_A")].double()
    want = w.double() + 2.0 * experts[name].double() @ a
    torch.testing.assert_close(merged["model.layers.1.mlp.experts.3.up_proj.weight"].double(), want)
