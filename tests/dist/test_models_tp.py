"""Policies built from HF configs give the HF model's logits and gradients at TP1, TP2, PP2 and TP2xPP2.

One forward/backward through megatron's real schedules (``get_forward_backward_func``, several
micro-batches, 1F1B under PP) on gloo ranks; the reference is the independent transformers model in
fp32 (its gradients mapped into HF names through the conversion table). Matching the HF reference at
every layout implies the layouts match each other.
"""

from __future__ import annotations

import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import TINY_VOCAB, tiny_hf_model
from tests.helpers.megatron import hf_reference, merge_rank_results, run_policy

VOCAB = TINY_VOCAB
SEQ = 9
MICRO_BATCHES = 3
MICRO_BATCH_SIZE = 2
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)


def policy_worker(rank, world, tp, pp, cases, backward):
    """Run every case (hf_config, batches, hf_state, ckpt_dir) at one layout: one launch per layout."""
    return [run_policy(c, tp, pp, b, hf_state=st, ckpt_dir=ck, backward=backward) for c, b, st, ck in cases]


def run_layout(tp: int, pp: int, cases: list[tuple], *, backward: bool = True):
    """Per case: logits per micro-batch and all gradients (HF names) of one layout."""
    return merge_rank_results(run_distributed(policy_worker, tp * pp, tp, pp, cases, backward, timeout=600))


def test_logits_and_grads_match_hf_at_every_layout():
    types = ["llama", "qwen2", "qwen3"]
    cases, refs = [], []
    for i, model_type in enumerate(types):
        hf = tiny_hf_model(model_type, seed=i)
        gen = torch.Generator().manual_seed(10 + i)
        batches = [
            torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ), generator=gen) for _ in range(MICRO_BATCHES)
        ]
        refs.append(hf_reference(hf, batches))
        state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        cases.append((hf.config.to_dict(), batches, state, None))
    for tp, pp in LAYOUTS:
        for model_type, (logits, grads), (ref_logits, ref_grads) in zip(
            types, run_layout(tp, pp, cases), refs, strict=True
        ):
            for got, want in zip(logits, ref_logits, strict=True):
                diff = (got[..., :VOCAB] - want).abs().max().item()
                assert diff <= 1e-5, f"{model_type} TP{tp}xPP{pp} logits differ by {diff}"
            assert sorted(grads) == sorted(ref_grads), f"{model_type} TP{tp}xPP{pp} gradient names"
            for name, want in ref_grads.items():
                diff = (grads[name] - want).abs().max().item()
                assert diff <= 1e-5, f"{model_type} TP{tp}xPP{pp} grad {name} differs by {diff}"


def _convert(rank, world, src, out):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron

    hf_to_megatron(src, out, progress=lambda _: None)


def test_uneven_pipeline_stages_match_hf(tmp_path):
    """Layer counts PP does not divide, as the 235B anchors' layouts need (94 layers at PP4 or PP8): 3 layers
    at PP2 (1 / 2) and 4 at PP3 (1 / 2 / 1), weights from HF tensors and, at PP2, from a converted
    checkpoint. Logits and every gradient (named through megatron's stage layer offset) equal HF's."""
    for layers, pp in [(3, 2), (4, 3)]:
        hf = tiny_hf_model("qwen3", seed=layers, num_layers=layers)
        gen = torch.Generator().manual_seed(layers)
        batches = [torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ), generator=gen) for _ in range(2)]
        ref_logits, ref_grads = hf_reference(hf, batches)
        state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        cases = [(hf.config.to_dict(), batches, state, None)]
        if pp == 2:
            hf.save_pretrained(tmp_path / "hf")
            run_distributed(_convert, 1, str(tmp_path / "hf"), str(tmp_path / "mg"), timeout=300)
            cases.append((hf.config.to_dict(), batches, None, str(tmp_path / "mg")))
        for i, (logits, grads) in enumerate(run_layout(1, pp, cases)):
            for got, want in zip(logits, ref_logits, strict=True):
                diff = (got[..., :VOCAB] - want).abs().max().item()
                assert diff <= 1e-5, f"{layers} layers PP{pp} case {i}: logits differ by {diff}"
            assert sorted(grads) == sorted(ref_grads), f"{layers} layers PP{pp} case {i}: gradient names"
            for name, want in ref_grads.items():
                diff = (grads[name] - want).abs().max().item()
                assert diff <= 1e-5, f"{layers} layers PP{pp} case {i}: grad {name} differs by {diff}"
