"""gpt-oss policies match the HF model (transformers' GptOssForCausalLM, eager attention, fp32): logits and
every gradient at TP1, TP2, PP2, EP2 and TP2xEP2 (ETP 1: megatron's MoE biases need it).

The tiny model (``testing.tiny.tiny_gpt_oss_model``) switches every gpt-oss feature on where it matters on
random data: a sliding window (3) shorter than the 8-token sequences, random sinks and biases, SwiGLU
clamps that cut (the test checks they do), YaRN with factor 4 and ``truncate=False``. Gradients come back
through the conversion table under its names (expert e of a fused HF tensor ``x`` is ``x[e]``), so the
interleaved gate/up split, the transposes, the sink (``softmax_offset``) TP split and the per-layer windows
under PP are all checked against HF.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.tiny import TINY_GPT_OSS_LIMIT, tiny_gpt_oss_model
from tests.helpers.megatron import hf_reference
from tests.helpers.moe import VOCAB, batches_for, hf_file_state, run_moe_layout

pytestmark = pytest.mark.moe

# (tp, pp, ep, etp)
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1)]
FUSED = (
    "mlp.experts.gate_up_proj",
    "mlp.experts.gate_up_proj_bias",
    "mlp.experts.down_proj",
    "mlp.experts.down_proj_bias",
)


def in_table_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF gradients with each fused expert tensor ``x`` [E, ...] as the table's slices ``x[e]``."""
    out = {}
    for name, g in grads.items():
        if name.endswith(FUSED):
            out.update({f"{name}[{e}]": g[e] for e in range(g.shape[0])})
        else:
            out[name] = g
    return out


def test_tiny_gpt_oss_clamps_are_active():
    """The SwiGLU clamps cut on the tiny model's data (else a clamp on the wrong side would pass)."""
    hf = tiny_gpt_oss_model(seed=0)
    seen = {}

    def hook(module, args, kwargs):
        x = args[0]
        gate_up = x @ module.gate_up_proj[0] + module.gate_up_proj_bias[0]
        seen["gate"] = (gate_up[..., ::2] > TINY_GPT_OSS_LIMIT).float().mean().item()
        seen["up_hi"] = (gate_up[..., 1::2] > TINY_GPT_OSS_LIMIT).float().mean().item()
        seen["up_lo"] = (gate_up[..., 1::2] < -TINY_GPT_OSS_LIMIT).float().mean().item()

    hf.model.layers[0].mlp.experts.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        hf(batches_for(10)[0])
    assert all(v > 0.05 for v in seen.values()), seen


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "tp{}pp{}ep{}etp{}".format(*lay))
def test_gpt_oss_logits_and_grads_match_hf(layout):
    hf = tiny_gpt_oss_model(seed=0)
    batches = batches_for(10)
    ref_logits, ref_grads = hf_reference(hf, batches)
    ref_grads = in_table_names(ref_grads)
    case = (hf.config.to_dict(), "alltoall", batches, hf_file_state(hf), None)
    [(logits, grads)] = run_moe_layout(layout, [case])
    for got, want in zip(logits, ref_logits, strict=True):
        diff = (got[..., :VOCAB] - want).abs().max().item()
        assert diff <= 1e-5, f"{layout}: logits differ by {diff}"
    assert sorted(grads) == sorted(ref_grads), f"{layout}: gradient names {set(grads) ^ set(ref_grads)}"
    for name, want in ref_grads.items():
        diff = (grads[name] - want).abs().max().item()
        assert diff <= 1e-5, f"{layout}: grad {name} differs by {diff}"


@pytest.mark.parametrize("cp", [1, 2], ids=["thd", "thd-cp2"])
def test_gpt_oss_packed_sequences_match_hf_run_alone(cp):
    """Packed THD micro-batches (and CP2: load-balanced chunks, K/V gathered) through the gpt-oss policy equal
    HF on every sequence alone: sinks and windows per packed sequence, never across a boundary."""
    from tests.helpers.packing import assert_close, hf_reference, packed_sequences, run_packed

    hf = tiny_gpt_oss_model(seed=5)
    seqs = packed_sequences(seed=7)
    (got,) = run_packed(1, 1, cp, hf, [(seqs, 32)])
    rows, grads = hf_reference(hf, seqs)
    assert_close(f"packed CP{cp}", got, (rows, in_table_names(grads)))
