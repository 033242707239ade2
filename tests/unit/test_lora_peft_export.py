"""The LoRA export against peft itself: an adapter folder written from megatron-named tensors loads with
``peft.PeftModel.from_pretrained`` onto the HF base and gives the logits of an independent float64
``W + (alpha/r) B A`` (fp32, <= 1e-5); the merged export, loaded as a plain HF model, gives the same logits.

Tiny Qwen3 (dense, all seven projections adapted) and tiny Qwen3-MoE (attention, and the routed experts,
which transformers 5 fuses into 3-D parameters: peft's target_parameters, gate/up packed as one rank-2r
block-diagonal adapter). GLM-4.5's expert adapters are refused in one line. Planted bugs fail."""

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
from tests.helpers.lora_adapters import random_adapters, random_expert_adapters, reference_logits

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


def test_qwen3_moe_attention_and_expert_adapters_load_with_peft(moe, tmp_path):
    """Attention adapters as nn.Linear targets; the routed experts through peft's target_parameters (fused
    3-D parameters in transformers 5): gate/up as one rank-2r block-diagonal adapter per layer."""
    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(rank=2, alpha=4.0, target_modules=targets, experts=True)
    table = LoraTable(Architecture.from_hf(moe.config), lora)
    adapters = random_adapters(moe, lora) | random_expert_adapters(moe, lora)
    assert set(adapters) == set(table.megatron_names())
    write_peft_folder(tmp_path / "adapter", table, adapters)
    ids = _ids(moe.config.vocab_size)
    with torch.no_grad():
        got = _load_peft(moe, tmp_path / "adapter")(ids).logits
        base = moe(ids).logits
    want = reference_logits(moe, adapters, lora, ids)
    assert (base.double() - want).abs().max() > 1e-2
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    back = read_peft_folder(tmp_path / "adapter", table)
    assert set(back) == set(adapters) and all(torch.equal(back[n], adapters[n]) for n in adapters)
    cfg = read_peft_config(tmp_path / "adapter")
    assert cfg.experts and (cfg.rank, cfg.alpha) == (2, 4.0)
    # merged per expert (the hub file names the merged export writes): expert 3's up_proj of layer 1
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.lora.up_proj.lora_B"
    assert table.row(name).peft == "base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight"
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    peft_x = dict(table.to_peft(n, t) for n, t in adapters.items())
    hf = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight": w for i in range(2) for e in range(4)
          for p in ("gate_proj", "up_proj")}  # fmt: skip
    hf |= {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight": w.T for i in range(2) for e in range(4)}
    hf |= {f"model.layers.{i}.self_attn.q_proj.weight": torch.zeros(64, 64) for i in range(2)}
    merged = merge_lora(hf, peft_x, lora.scaling)
    a = adapters[name.replace("lora_B", "lora_A")].double()
    want_w = w.double() + 2.0 * adapters[name].double() @ a
    torch.testing.assert_close(merged["model.layers.1.mlp.experts.3.up_proj.weight"].double(), want_w)


def test_planted_expert_packing_bugs_fail(moe, tmp_path, monkeypatch):
    """Gate and up adapters exchanged inside the packed gate_up_proj adapter, or B's experts laid out
    expert-major (peft reads them expert-minor), move the logits far beyond 1e-5."""
    import srpo_megatron.conversion.lora_export as export

    lora = LoraConfig(rank=2, alpha=4.0, target_modules=["gate_proj", "up_proj", "down_proj"], experts=True)
    table = LoraTable(Architecture.from_hf(moe.config), lora)
    adapters = random_expert_adapters(moe, lora)
    ids = _ids(moe.config.vocab_size)
    want = reference_logits(moe, adapters, lora, ids)
    swapped = {  # planted: gate's adapter sent as up's and up's as gate's
        n.replace("gate_proj", "TMP").replace("up_proj", "gate_proj").replace("TMP", "up_proj"): t
        for n, t in adapters.items()
    }
    real = export.pack_experts

    def expert_major(table, adapters):  # planted: B as [out, E, r'] instead of [out, r', E]
        out = real(table, adapters)
        for k in [k for k in out if k.endswith("lora_B.weight")]:
            b = out[k]
            rr = b.shape[1] // 4
            out[k] = b.reshape(b.shape[0], rr, 4).transpose(1, 2).reshape(b.shape[0], -1).contiguous()
        return out

    for label, tensors in (("swap", swapped), ("major", adapters)):
        if label == "major":
            monkeypatch.setattr(export, "pack_experts", expert_major)
        folder = write_peft_folder(tmp_path / label, table, tensors)
        with torch.no_grad():
            got = _load_peft(moe, folder)(ids).logits
        assert (got.double() - want).abs().max() > 1e-3, label


def test_glm_expert_adapters_are_refused_in_one_line(tmp_path):
    from srpo_megatron.testing.tiny import tiny_glm_moe_config

    lora = LoraConfig(rank=2, target_modules=["gate_proj"], experts=True)
    table = LoraTable(Architecture.from_hf(tiny_glm_moe_config().to_dict()), lora)
    with pytest.raises(LoraTableError, match="glm4_moe's routed-expert adapters") as e:
        write_peft_folder(tmp_path / "x", table, {})
    assert "\n" not in str(e.value)


def test_stored_adapter_keys_of_the_trainers_stacked_checkpoint():
    """Where the exporter looks for an adapter: as named, stacked over layers, and (routed experts) stacked
    over layers and global experts, as megatron's SequentialMLP saves them."""
    from srpo_megatron.conversion.checkpoint import stored_adapter_keys

    attn = "model.decoder.layers.1.self_attention.linear_qkv.lora.k_proj.lora_B"
    assert stored_adapter_keys(attn) == [
        (attn, ()),
        ("model.decoder.layers.self_attention.linear_qkv.lora.k_proj.lora_B", (1,)),
    ]
    expert = "model.decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.lora.down_proj.lora_A"
    assert stored_adapter_keys(expert) == [
        (expert, ()),
        ("model.decoder.layers.mlp.experts.experts.linear_fc2.lora.down_proj.lora_A", (3, 5)),
    ]
    assert stored_adapter_keys("model.embedding.word_embeddings.weight") == [
        ("model.embedding.word_embeddings.weight", ())
    ]
