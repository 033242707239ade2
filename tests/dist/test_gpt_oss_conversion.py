"""gpt-oss conversion: HF -> megatron -> HF is bit-exact (the fused per-layer expert tensors), transformers
loads the export with identical logits, the converted checkpoint loads at TP2, EP2 and TP2xEP2 with the HF
logits, and an MXFP4 hub-style folder (hand-made blocks and scales) imports to exactly the dequantized
values, exported as bf16 without its quantization_config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_gpt_oss_model
from tests.helpers.conversion import assert_bit_exact, read_hf_tensors, round_trip_worker
from tests.helpers.moe import batches_for, run_moe_layout

pytestmark = pytest.mark.moe


@pytest.fixture(scope="module")
def oss_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oss") / "gpt_oss"
    tiny_gpt_oss_model(seed=3).save_pretrained(folder)
    return folder


def test_round_trip_is_bit_exact_and_loads_in_transformers(oss_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    mg, back = tmp_path / "mg", tmp_path / "back"
    run_distributed(round_trip_worker, 1, [(str(oss_folder), str(mg), str(back))], 20_000, timeout=300)
    names = read_hf_tensors(oss_folder)
    assert names["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 96)  # fused [E, H, 2F]
    assert "model.layers.0.self_attn.sinks" in names and "model.layers.0.mlp.router.bias" in names
    assert_bit_exact(oss_folder, back)
    assert len(list(back.glob("*.safetensors"))) > 1  # the small shard bound splits the export
    ids = batches_for(5)[0]
    src = AutoModelForCausalLM.from_pretrained(oss_folder, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(src(ids).logits, exported(ids).logits)


@pytest.mark.parametrize("layout", [(2, 1, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1)], ids=["tp2", "ep2", "tp2ep2"])
def test_converted_checkpoint_loads_with_the_hf_logits(oss_folder, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(oss_folder, dtype=torch.float32).eval()
    batches = batches_for(7)
    with torch.no_grad():
        ref = [hf(ids).logits for ids in batches]
    mg = tmp_path / "mg"
    run_distributed(round_trip_worker, 1, [(str(oss_folder), str(mg), str(tmp_path / "unused"))], 10**9)
    case = (hf.config.to_dict(), "alltoall", batches, None, str(mg))
    [(logits, _)] = run_moe_layout(layout, [case], backward=False)
    for got, want in zip(logits, ref, strict=True):
        assert (got[..., : want.shape[-1]] - want).abs().max().item() <= 1e-5


def _e2m1(code: int) -> float:
    return (-1 if code & 8 else 1) * [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][code & 7]


def _hand_made_mxfp4(shape_out_in: tuple[int, int, int], seed: int):
    """Blocks/scales [E, out, in/32, (16)] from chosen codes and exponents, and their values as the bf16
    checkpoint lays them out, [E, in, out], computed element by element from the format."""
    e, out, inn = shape_out_in
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (e, out, inn), generator=gen)
    exps = torch.randint(124, 131, (e, out, inn // 32), generator=gen)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).reshape(e, out, inn // 32, 16)
    table = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
    scale = 2.0 ** (exps.double().repeat_interleave(32, dim=-1) - 127)  # each block's exponent, per element
    values = (table[codes] * scale).transpose(1, 2).float()
    return blocks, exps.to(torch.uint8), values


def test_mxfp4_folder_imports_to_the_dequantized_values(tmp_path):
    from srpo_megatron.conversion.checkpoint import HF_CONFIG_NAME

    hf = tiny_gpt_oss_model(seed=4, intermediate_size=64)  # MXFP4 blocks: input widths multiples of 32
    src = tmp_path / "mxfp4"
    hf.save_pretrained(src)
    state = {k: v.to(torch.bfloat16) for k, v in read_hf_tensors(src).items()}
    cfg = hf.config
    experts, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    want = {}
    for i in range(cfg.num_hidden_layers):
        for j, (proj, out, inn) in enumerate(
            (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter))
        ):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales, values = _hand_made_mxfp4((experts, out, inn), seed=10 * i + j)
            del state[name]
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
            want[name] = values.to(torch.bfloat16)
    for f in src.glob("*.safetensors*"):
        f.unlink()
    save_file(state, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (src / "config.json").write_text(json.dumps(config))
    mg, back = tmp_path / "mg", tmp_path / "back"
    run_distributed(round_trip_worker, 1, [(str(src), str(mg), str(back))], 10**9, timeout=300)
    assert "quantization_config" not in json.loads((mg / HF_CONFIG_NAME).read_text())
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    exported = read_hf_tensors(back)
    for name, values in want.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], values), name
    for name, t in state.items():  # everything else unchanged
        if t.dtype != torch.uint8:
            assert torch.equal(exported[name], t), name


@pytest.mark.parametrize("layout", [(1, 1, 2, 1), (2, 1, 2, 1)], ids=["ep2", "tp2ep2"])
def test_policy_sync_installs_in_the_hf_engine(layout):
    """The trainer's weight export (``weights.export``: experts gathered over EP, TP shards merged) sends the
    table's names (``x[e]`` expert slices) bit-exact; the transformers engine installs them into its fused
    experts and then gives the source model's logits exactly."""
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.rollout.hf_engine import HFEngine
    from tests.helpers.moe import export_worker

    tp, pp, ep, etp = layout
    source = tiny_gpt_oss_model(seed=6)
    state = read_state(source)
    results = run_distributed(
        export_worker, max(tp, ep) * pp, layout, source.config.to_dict(), state, timeout=600
    )
    received = {name: t for buckets, _, _ in results for bucket in buckets for name, t in bucket}
    table = ConversionTable(Architecture.from_hf(source.config))
    assert sorted(received) == sorted(table.hf_names())
    for name, got in received.items():
        assert torch.equal(got, table.hf_tensor(name, state.__getitem__)), name
    engine = HFEngine(tiny_gpt_oss_model(seed=99), initial_version=1)
    engine.update_weights(received.items(), version=2)
    ids = batches_for(3)[0]
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, source(ids).logits)


@pytest.mark.parametrize("layout", [(1, 1, 2, 1), (2, 1, 2, 1)], ids=["ep2", "tp2ep2"])
def test_policy_sync_for_sglang_sends_the_fused_expert_tensors(layout, tmp_path):
    """The SGLang-bound export (``weights.fused_experts`` over ``weights.export``'s EP gather): the fused
    expert tensors whole, bit-exact (each expert at its index), the checkpoint's file names, each once,
    which the SGLang engine's gate (manifest from the served folder) accepts."""
    from srpo_megatron.conversion.manifest import hf_manifest
    from tests.helpers.moe import export_worker
    from tests.helpers.sglang import sync_through_gate

    tp, pp, ep, etp = layout
    source = tiny_gpt_oss_model(seed=6)
    source.save_pretrained(tmp_path / "oss")
    state = read_state(source)
    world = max(tp, ep) * pp
    results = run_distributed(
        export_worker, world, layout, source.config.to_dict(), state, 40_000, True, timeout=600
    )
    stream = [(name, t) for buckets, _, _ in results for bucket in buckets for name, t in bucket]
    assert sorted(n for n, _ in stream) == sorted(hf_manifest(str(tmp_path / "oss")))
    for name, got in stream:
        assert torch.equal(got, state[name]), name
    assert sync_through_gate(tmp_path / "oss", iter(stream)).weight_version == 1


def read_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
