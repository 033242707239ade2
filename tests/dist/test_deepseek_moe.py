"""The full tiny DeepSeek-V3 (MLA + the DeepSeek MoE) matches transformers' ``DeepseekV3ForCausalLM`` (fp32):
logits and every gradient at TP1, TP2, PP2, EP2 and TP2xEP2.

The tiny model (``testing/tiny.py`` ``tiny_deepseek_model(num_layers=3, first_k_dense_replace=1)``): layer 0
dense, layers 1-2 MoE with 8 routed experts in 2 groups (``n_group=2, topk_group=1``, top-2), one shared
expert, the sigmoid router with a nonzero ``e_score_correction_bias`` and ``routed_scaling_factor`` 2.5;
MLA with q compression, YaRN with both mscales, HF's ``rope_interleave``. A second variant without q
compression and with ``rope_interleave=False`` runs at TP1 and EP2. Harness: ``tests/helpers/moe.py``
(megatron's real schedules on gloo ranks; gradients gathered over TP/ETP and EP into HF names).
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.tiny import tiny_deepseek_model
from tests.helpers.megatron import hf_reference
from tests.helpers.moe import VOCAB, batches_for, hf_file_state, hf_grads_in_file_names, run_moe_layout

pytestmark = pytest.mark.moe

MOE = dict(num_layers=3, first_k_dense_replace=1)
VARIANTS = {
    "q_lora+interleave": dict(MOE, q_lora_rank=24),
    "q_proj+halves": dict(MOE, q_lora_rank=None, rope_interleave=False, mscale=None, mscale_all_dim=1.0),
}
# (tp, pp, ep, etp); "TP2" is TP2 x ETP2 (megatron's default ETP = TP), as in test_glm_moe
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1)]
BOTH_AT = {(1, 1, 1, 1), (1, 1, 2, 1)}


def _choices(model, ids: torch.Tensor, use_bias: bool) -> list[torch.Tensor]:
    """Per MoE layer, the experts HF's router picks for ``ids`` (sorted), with or without the bias."""
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    saved = [g.e_score_correction_bias.clone() for g in gates]
    out: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda m, a, o: out.append(o[2].sort(-1).values)) for g in gates]
    try:
        if not use_bias:
            for g in gates:
                g.e_score_correction_bias.zero_()
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
        for g, b in zip(gates, saved, strict=True):
            g.e_score_correction_bias.copy_(b)
    return out


def test_tiny_deepseek_bias_and_groups_change_the_choice():
    """The parity tests only catch a bias ignored in the selection if the bias changes it; with one group
    of two chosen, both experts of every token are in one group."""
    hf = tiny_deepseek_model(seed=0, **VARIANTS["q_lora+interleave"])
    ids = torch.cat(batches_for(20))
    with_bias, without = _choices(hf, ids, True), _choices(hf, ids, False)
    assert len(with_bias) == 2
    assert sum(int((a != b).any(-1).sum()) for a, b in zip(with_bias, without, strict=True)) > 0
    for chosen in with_bias:
        assert bool(((chosen // 4)[:, 0] == (chosen // 4)[:, 1]).all()), "top-2 spans both groups"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "tp{}pp{}ep{}etp{}".format(*lay))
def test_deepseek_moe_logits_and_grads_match_hf(layout):
    names = list(VARIANTS) if layout in BOTH_AT else ["q_lora+interleave"]
    cases, refs = [], []
    for i, name in enumerate(names):
        hf = tiny_deepseek_model(seed=i, **VARIANTS[name])
        batches = batches_for(20 + i)
        logits, grads = hf_reference(hf, batches)
        refs.append((logits, hf_grads_in_file_names(grads)))
        cases.append((hf.config.to_dict(), "alltoall", batches, hf_file_state(hf), None))
    for name, (logits, grads), (ref_logits, ref_grads) in zip(
        names, run_moe_layout(layout, cases), refs, strict=True
    ):
        tag = f"{name} {layout}"
        for got, want in zip(logits, ref_logits, strict=True):
            diff = (got[..., :VOCAB] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
        assert sorted(grads) == sorted(ref_grads), f"{tag}: gradient names {set(grads) ^ set(ref_grads)}"
        for gname, want in ref_grads.items():
            diff = (grads[gname] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: grad {gname} differs by {diff}"


@pytest.mark.parametrize("layout", [(1, 1, 2, 1), (2, 1, 2, 1)], ids=["ep2", "tp2ep2"])
def test_deepseek_moe_round_trip_is_bit_exact_and_loads_at_ep(tmp_path, layout):
    """HF -> megatron -> HF is bit-exact for the full tiny DeepSeek (both variants), and the converted
    checkpoint loads at EP2 / TP2xEP2 with HF's logits and gradients."""
    from pathlib import Path

    from srpo_megatron.testing.distributed import run_distributed
    from tests.helpers.conversion import assert_bit_exact, round_trip_worker

    pairs, cases, refs = [], [], []
    for i, (name, kw) in enumerate(VARIANTS.items()):
        hf = tiny_deepseek_model(seed=i, **kw)
        hf.save_pretrained(tmp_path / f"hf{i}")
        pairs.append((str(tmp_path / f"hf{i}"), str(tmp_path / f"mg{i}"), str(tmp_path / f"back{i}")))
        batches = batches_for(30 + i)
        logits, grads = hf_reference(hf, batches)
        refs.append((name, logits, hf_grads_in_file_names(grads)))
        cases.append((hf.config.to_dict(), "alltoall", batches, None, str(tmp_path / f"mg{i}")))
    run_distributed(round_trip_worker, 1, pairs, 60_000, timeout=300)
    for src, _, dst in pairs:
        assert_bit_exact(Path(src), Path(dst))
    for (name, ref_logits, ref_grads), (logits, grads) in zip(
        refs, run_moe_layout(layout, cases), strict=True
    ):
        tag = f"{name} from the converted checkpoint at {layout}"
        for got, want in zip(logits, ref_logits, strict=True):
            diff = (got[..., :VOCAB] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
        assert sorted(grads) == sorted(ref_grads), f"{tag}: gradient names"
        for gname, want in ref_grads.items():
            diff = (grads[gname] - want).abs().max().item()
            assert diff <= 1e-5, f"{tag}: grad {gname} differs by {diff}"


def test_round_trip_with_the_hubs_mtp_layer_is_bit_exact(tmp_path):
    """A DeepSeek folder as the hub ships it, with one MTP layer (``model.layers.3``: an MLA + MoE layer and
    NextN's ``enorm``/``hnorm``/``eh_proj``/``shared_head``): the MTP tensors are not table rows, the import
    skips them with one notice and the export re-emits them, so the round trip is bit-exact."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from srpo_megatron.testing.distributed import run_distributed
    from tests.helpers.conversion import assert_bit_exact, read_hf_tensors

    src = tmp_path / "hf"
    tiny_deepseek_model(seed=3, **VARIANTS["q_lora+interleave"]).save_pretrained(src)
    state = read_hf_tensors(src)
    gen = torch.Generator().manual_seed(7)
    mtp = {
        k.replace("model.layers.2.", "model.layers.3."): torch.randn(v.shape, generator=gen)
        for k, v in state.items()
        if k.startswith("model.layers.2.")
    }
    h = state["model.norm.weight"].shape[0]
    for name, shape in (("enorm", (h,)), ("hnorm", (h,)), ("eh_proj", (h, 2 * h)), ("shared_head.norm", (h,))):
        mtp[f"model.layers.3.{name}.weight"] = torch.randn(shape, generator=gen)
    for f in src.glob("model*.safetensors*"):
        f.unlink()
    save_file({**state, **mtp}, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(config))
    log = tmp_path / "log.txt"
    run_distributed(_convert_worker, 1, str(src), str(tmp_path / "mg"), str(tmp_path / "back"), str(log))
    assert_bit_exact(Path(src), tmp_path / "back")
    skipped = [line for line in log.read_text().splitlines() if line.startswith("skipping") and "MTP" in line]
    assert len(skipped) == 1 and "[3]" in skipped[0]


def _convert_worker(rank, world, src, mg, dst, log_file):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron, megatron_to_hf

    lines: list[str] = []
    hf_to_megatron(src, mg, progress=lines.append)
    megatron_to_hf(mg, dst, max_shard_bytes=40_000, progress=lines.append)
    with open(log_file, "w") as f:
        f.write("\n".join(lines))
