"""Packed (THD) micro-batches through the policy and the per-sequence HF reference (test_packing.py,
test_gpt_oss.py): megatron's schedules over token-budget micro-batches, rows and HF-named gradients back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import TINY_VOCAB
from tests.helpers.megatron import hf_named_grads

VOCAB = TINY_VOCAB

LENGTHS = [7, 3, 12, 5, 9, 2, 16, 4]  # long-tailed-ish, several per micro-batch


def packed_sequences(seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def hf_reference(model, seqs: list[list[int]]):
    """Per-sequence logits [n-1, V] at the predicting rows and grads of sum CE / all predicted tokens."""
    model.zero_grad()
    count = sum(len(s) - 1 for s in seqs)
    rows = []
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(ids).logits[0, :-1]
        (torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum") / count).backward()
        rows.append(logits.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return torch.cat(rows), grads


def packed_worker(rank, world, tp, pp, cp, hf_config, hf_state, cases):
    """Each case ``(seqs, budget)``: rows' logits in sample order (last stage, TP rank 0) and HF grads."""
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(tp, pp, cp=cp)
    return [_packed_case(tp, pp, cp, hf_config, hf_state, seqs, budget) for seqs, budget in cases]


def _packed_case(tp, pp, cp, hf_config, hf_state, seqs, budget):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights, stage_layer_offset
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.trainer.microbatches.packing import cp_shard, pack, pad_multiple, plan_micro_batches

    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch, parallel_output=False, context_parallel_size=cp)
    load_hf_weights(model, table, hf_state.__getitem__)
    offset = stage_layer_offset(model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func = model.no_sync

    multiple = pad_multiple(tp, cp, sequence_parallel=False)
    triples = [(s, 0, len(s) - 1) for s in seqs]  # row p predicts token p+1
    bins = plan_micro_batches([len(s) for s in seqs], budget, multiple)
    mbs = [pack(triples, b, multiple, total=budget if pp > 1 else None) for b in bins]
    count = sum(len(s) - 1 for s in seqs)
    cp_rank = ps.get_context_parallel_rank()
    shards = [cp_shard(mb, cp, cp_rank) for mb in mbs]
    labels = [torch.roll(mb.tokens, -1, dims=1)[:, sh.index] for mb, sh in zip(mbs, shards, strict=True)]

    def loss_func(k, logits):
        sh = shards[k]
        picked = logits[0][sh.rows[0]]
        ce = torch.nn.functional.cross_entropy(picked[:, :VOCAB], labels[k][0][sh.rows[0]], reduction="sum")
        # megatron divides by the number of micro-batches (and multiplies by CP; DDP averages over DP·CP)
        return ce / count * len(mbs), {"rows": picked.detach()[:, :VOCAB], "k": k}

    def forward_step(data_iterator, m):
        k = next(data_iterator)
        sh = shards[k]
        out = m(sh.tokens, sh.positions, None, packed_seq_params=mbs[k].packed_seq_params("cpu"))
        return out, lambda logits: loss_func(k, logits)

    max_total = max(mb.tokens.size(1) for mb in mbs)
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(range(len(mbs))),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=max_total,
        micro_batch_size=1,
        forward_only=False,
    )
    rows = None
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        # every CP rank holds some rows of each micro-batch: scatter them back into global row order
        per_mb = []
        for o in out:
            mb, sh = mbs[o["k"]], shards[o["k"]]
            full = torch.zeros(int(mb.rows.sum()), VOCAB)
            full[sh.row_index] = o["rows"]
            per_mb.append(full)
        rows = []
        for full in per_mb:
            if cp > 1:
                dist.all_reduce(full, group=ps.get_context_parallel_group())
            rows.append(full)
        # micro-batches hold members in bin order; return rows per sample
        by_sample = {}
        for mb, full in zip(mbs, rows, strict=True):
            start = 0
            for m in mb.members:
                n = len(seqs[m]) - 1
                by_sample[m] = full[start : start + n]
                start += n
        rows = torch.cat([by_sample[i] for i in range(len(seqs))])
    grads = hf_named_grads(model.module, table, offset) if cp_rank == 0 else {}
    return rows, grads


def run_packed(tp, pp, cp, hf, cases):
    """One launch of ``tp·pp·cp`` ranks for all ``cases``; per case (rows, grads)."""
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    results = run_distributed(
        packed_worker, tp * pp * cp, tp, pp, cp, hf.config.to_dict(), state, cases, timeout=600
    )
    out = []
    for i in range(len(cases)):
        rows = next(r[i][0] for r in results if r[i][0] is not None)
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            grads.update(r[i][1])
        out.append((rows, grads))
    return out


def assert_close(tag, got, want):
    rows, grads = got
    ref_rows, ref_grads = want
    diff = (rows - ref_rows).abs().max().item()
    assert diff <= 1e-5, f"{tag}: logits differ by {diff}"
    assert sorted(grads) == sorted(ref_grads), f"{tag}: gradient names"
    for name, ref in ref_grads.items():
        diff = (grads[name] - ref).abs().max().item()
        assert diff <= 1e-5, f"{tag}: grad {name} differs by {diff}"
