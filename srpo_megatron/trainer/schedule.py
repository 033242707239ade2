"""Run micro-batches through megatron's real schedules (``get_forward_backward_func``: no-pipelining or
1F1B), so TP/PP/DP behave exactly as in Megatron-LM. Used by the scoring and the learning pass.

Loss scaling: ``routed_loss`` returns each micro-batch's share of the global objective (global token
denominator), so gradients must be *summed* over micro-batches and DP ranks. Megatron divides the loss by
the number of micro-batches and DDP averages over DP, hence the learning pass's ``num_microbatches ·
dp_size`` factor. With context parallelism megatron also multiplies the loss by CP and DDP averages over
DP×CP, which cancel: the CP ranks' partial losses are summed as well.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from srpo_megatron.trainer.batches import MicroBatch

OnRows = Callable[[torch.Tensor, int], torch.Tensor | None]


def logit_rows(logits: torch.Tensor, rows: torch.Tensor, vocab_pad: torch.Tensor) -> torch.Tensor:
    """[b, S, V/TP] logits → [T, V/TP] rows; padded vocabulary ids ([V/TP] bool) masked to a huge negative."""
    out = logits[rows]
    if bool(vocab_pad.any()):
        out = out.masked_fill(vocab_pad, torch.finfo(out.dtype).min / 4)
    return out


def run_schedule(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    on_rows: OnRows,
    vocab_pad: torch.Tensor,
    *,
    forward_only: bool,
    before_forward: Callable[[int], None] | None = None,
) -> None:
    """Run the schedule; ``on_rows(row_logits [T, V/TP], mb_index)`` runs on the last stage per micro-batch
    and returns that micro-batch's loss (None in forward-only passes); it is not called for a micro-batch of
    which this rank holds no rows. ``before_forward(mb_index)`` runs just before each micro-batch's forward
    on every stage (MoE expert replay, trainer/moe_replay.py, sets its experts there)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    index = iter(range(len(micro_batches)))

    def forward_step(data_iterator, m):
        k = next(data_iterator)
        mb = micro_batches[k]
        if before_forward is not None:
            before_forward(k)
        if mb.packed is None:
            out = m(mb.tokens, mb.positions, None)
        else:  # THD: attention stays inside each packed sequence
            out = m(mb.tokens, mb.positions, None, packed_seq_params=mb.packed)

        def loss_func(logits):
            rows = logit_rows(logits, mb.rows, vocab_pad)
            # A CP rank may hold none of a micro-batch's response rows (all its chunks are prompt): nothing
            # to score there, but the zero loss below still runs the backward through the CP K/V gathers
            # that the other CP ranks take part in.
            loss = on_rows(rows, k) if rows.size(0) else None
            if loss is None:
                loss = logits.sum() * 0.0
            return loss, {}

        return out, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=index,
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.seq_length for mb in micro_batches),  # PP: all equal (fixed shapes); ÷ CP inside
        micro_batch_size=micro_batches[0].tokens.shape[0],
        forward_only=forward_only,
    )
