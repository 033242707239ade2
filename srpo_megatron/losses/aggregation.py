"""How per-token losses become the objective L (``loss.aggregation``).

- ``token_mean`` (the paper's equations; SRPO's setting): L = Σ_{i,t} ℓ_{i,t} / N_tokens, N_tokens the valid
  response tokens of the whole training batch (all micro-batches, all DP ranks).
- ``seq_mean_token_mean``: L = (1/N_seq) Σ_i (1/|y_i|) Σ_t ℓ_{i,t}, |y_i| the valid tokens of sample i and
  N_seq the samples of the whole batch. This is what lasgroup/SDPO's code computes (micro-batch 1, a
  token mean per micro-batch, the loss scaled by 1 / gradient accumulation, gradients averaged over DP)
  and verl's ``seq-mean-token-mean``: the paper's GRPO and SDPO baseline runs were averaged this way.

The per-sequence factor 1/|y_i| is fixed once per rollout batch, where every sample's full rows are known
(``sequence_weights``, after ``apply_rejections``), and carried per token in ``TokenBatch.seq_weight``; N_seq
is summed with the other global normalisers. A sample split across micro-batches, context-parallel ranks
or packed sequences therefore still divides by its full length, and L does not depend on the micro-batch
size, DP, TP, packing or CP, as with ``token_mean``.

Rejected tokens that leave the mask (``loss.mask_stale_tokens``; ``loss.is_correction: mis`` under
``loss.is_rejection_denominator: drop``) are treated as not sampled in both modes: they leave |y_i| as they
leave N_tokens, and a sample with no valid token left leaves N_seq (verl's ``agg_loss`` excludes fully
masked sequences the same way). SDPO's code at micro-batch 1 would still count such a sample in the
1/gradient-accumulation factor; neither run of the paper rejects tokens. Under ``keep`` MIS-rejected
tokens stay in the mask, so |y_i| and N_seq are the pre-rejection counts (slime's and miles' per-sample
denominators) and the rejected rows add 0 to the sums.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srpo_megatron.config.loss import Aggregation
    from srpo_megatron.losses.batch import Normalizers, TokenBatch


def sequence_weights(mask: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """1/|y_i| on the valid rows of each sample i (0 on the others): mask [T] bool → [T] float64.

    ``offsets``: N + 1 host ints; sample i owns rows ``[offsets[i], offsets[i + 1])`` (its full response).
    Float64, so that Σ of the weights over the valid rows (N_seq) rounds to the exact count.
    """
    dev, n = mask.device, len(offsets) - 1
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(offsets)], dtype=torch.long, device=dev)
    if int(lengths.sum()) != mask.shape[0]:
        raise ValueError(f"offsets cover {int(lengths.sum())} rows but the mask has {mask.shape[0]}")
    sample = torch.repeat_interleave(torch.arange(n, device=dev), lengths)
    valid = torch.zeros(n, dtype=torch.float64, device=dev).index_add(0, sample, mask.to(torch.float64))
    return torch.where(mask, 1.0 / valid.clamp_min(1.0)[sample], 0.0)


def sequence_count(batch: TokenBatch) -> torch.Tensor:
    """Σ_t seq_weight over the valid rows: this batch's share of N_seq (0-dim float64; 0 without weights)."""
    if batch.seq_weight is None:
        return torch.zeros((), dtype=torch.float64, device=batch.mask.device)
    return batch.seq_weight[batch.mask].to(torch.float64).sum()


def aggregate(
    per_token: torch.Tensor, batch: TokenBatch, normalizers: Normalizers, aggregation: Aggregation
) -> torch.Tensor:
    """This micro-batch's share of L from the per-token losses per_token [T] (0 on rows without loss)."""
    if aggregation == "token_mean":
        return per_token.sum() / normalizers.num_tokens
    if batch.seq_weight is None:
        raise ValueError(
            "loss.aggregation: seq_mean_token_mean needs TokenBatch.seq_weight (1/|y_i| per token); set it "
            "once per rollout batch with losses.sequence_weights(mask, offsets) after apply_rejections"
        )
    if normalizers.num_seqs <= 0:
        raise ValueError(
            "normalizers.num_seqs is 0 under loss.aggregation: seq_mean_token_mean: no micro-batch passed "
            "to global_normalizers carries seq_weight, or no sample has a valid token"
        )
    return (per_token * batch.seq_weight.to(per_token.dtype)).sum() / normalizers.num_seqs
