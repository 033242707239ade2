"""DeepSeek-V3 Multi-head Latent Attention policies match transformers' ``DeepseekV3ForCausalLM`` (fp32):
logits and every gradient at TP1, TP2 (with and without sequence parallelism) and PP2, and HF -> megatron
-> HF is bit-exact with the converted checkpoint loading at TP2.

Three tiny dense models cover MLA's switches (``srpo_megatron.testing.tiny.tiny_deepseek_config``): q
compression with HF's ``rope_interleave=True`` and YaRN whose cos/sin factor and softmax scale both differ
from 1 (``mscale`` 1, ``mscale_all_dim`` 0.8); one q projection (``q_lora_rank=None``) with
``rope_interleave=False`` and HF's other YaRN branch (``mscale`` unset: cos/sin by ``m(f)``, softmax by
``m(f, mscale_all_dim)**2``); q compression with plain RoPE. Every layer is dense
(``first_k_dense_replace = num_hidden_layers``); the MoE DeepSeek is ``test_deepseek_moe``. Same harness
as ``test_models_tp``: megatron's real schedules on gloo ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import TINY_VOCAB, tiny_deepseek_model
from tests.helpers.conversion import assert_bit_exact, round_trip_worker
from tests.helpers.megatron import hf_reference, merge_rank_results, run_policy

VOCAB = TINY_VOCAB
SEQ = 12
MICRO_BATCHES = 2
MICRO_BATCH_SIZE = 2
VARIANTS = {
    "q_lora+interleave": dict(q_lora_rank=24, rope_interleave=True, mscale=1.0, mscale_all_dim=0.8),
    "q_proj+halves": dict(q_lora_rank=None, rope_interleave=False, mscale=None, mscale_all_dim=1.0),
    "q_lora+plain_rope": dict(q_lora_rank=24, yarn=False),
}


def _batches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ), generator=gen) for _ in range(MICRO_BATCHES)]


def _worker(rank, world, tp, pp, cases, sp=False):
    overrides = {"sequence_parallel": True} if sp else None
    return [
        run_policy(c, tp, pp, b, hf_state=st, ckpt_dir=ck, config_overrides=overrides)
        for c, b, st, ck in cases
    ]


def _assert_matches(tag, logits, grads, ref_logits, ref_grads):
    for got, want in zip(logits, ref_logits, strict=True):
        diff = (got[..., :VOCAB] - want).abs().max().item()
        assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
    assert sorted(grads) == sorted(ref_grads), f"{tag}: gradient names {set(grads) ^ set(ref_grads)}"
    for name, want in ref_grads.items():
        diff = (grads[name] - want).abs().max().item()
        assert diff <= 1e-5, f"{tag}: grad {name} differs by {diff}"


@pytest.fixture(scope="module")
def references():
    """Per variant: (HF config dict, batches, HF state, HF logits, HF gradients)."""
    out = {}
    for i, (name, kw) in enumerate(VARIANTS.items()):
        hf = tiny_deepseek_model(seed=i, **kw)
        batches = _batches(20 + i)
        logits, grads = hf_reference(hf, batches)
        state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        out[name] = (hf.config.to_dict(), batches, state, logits, grads)
    return out


@pytest.mark.parametrize(
    "layout",
    [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)],
    ids=lambda lay: "tp{}pp{}sp{:d}".format(*lay),
)
def test_deepseek_mla_logits_and_grads_match_hf(references, layout):
    """TP2 with and without sequence parallelism: the shared RoPE key's gradient sums every head's
    (``models/mla.py``'s ``_KVDownProjection``; megatron's own column-parallel path misses the other ranks')."""
    tp, pp, sp = layout
    cases = [(cfg, b, st, None) for cfg, b, st, _, _ in references.values()]
    results = merge_rank_results(run_distributed(_worker, tp * pp, tp, pp, cases, sp, timeout=600))
    for name, (logits, grads) in zip(references, results, strict=True):
        _, _, _, ref_logits, ref_grads = references[name]
        _assert_matches(f"{name} TP{tp}xPP{pp} SP={sp}", logits, grads, ref_logits, ref_grads)


def test_deepseek_round_trip_is_bit_exact_and_loads_at_tp2(references, tmp_path):
    pairs, cases = [], []
    for i, (name, kw) in enumerate(VARIANTS.items()):
        src = tmp_path / f"hf{i}"
        tiny_deepseek_model(seed=i, **kw).save_pretrained(src)
        pairs.append((str(src), str(tmp_path / f"mg{i}"), str(tmp_path / f"back{i}")))
        cfg, batches, _, _, _ = references[name]
        cases.append((cfg, batches, None, str(tmp_path / f"mg{i}")))
    run_distributed(round_trip_worker, 1, pairs, 40_000, timeout=300)
    for src, _, dst in pairs:
        assert_bit_exact(Path(src), Path(dst))
    results = merge_rank_results(run_distributed(_worker, 2, 2, 1, cases, timeout=600))
    for name, (logits, grads) in zip(references, results, strict=True):
        _, _, _, ref_logits, ref_grads = references[name]
        _assert_matches(f"{name} from the converted checkpoint at TP2", logits, grads, ref_logits, ref_grads)
