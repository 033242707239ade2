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

from srpo_megatron.ops.fused_output import OutputShard
from srpo_megatron.trainer.microbatches.batches import MicroBatch
from srpo_megatron.trainer.microbatches.output_rows import OutputHead, Rows

OnRows = Callable[[Rows, int], torch.Tensor | None]


def run_schedule(
    model: torch.nn.Module,
    micro_batches: list[MicroBatch],
    on_rows: OnRows,
    head: OutputHead,
    *,
    forward_only: bool,
    before_forward: Callable[[int], None] | None = None,
) -> None:
    """Run the schedule; ``on_rows(rows, mb_index)`` runs on the last stage per micro-batch, with ``rows``
    the response rows as ``head`` gives them (``[T, V/TP]`` logits, or the fused ``OutputShard``),
    and returns that micro-batch's loss (None in forward-only passes); it is not called for a micro-batch of
    which this rank holds no rows. ``before_forward(mb_index)`` runs just before each micro-batch's forward
    on every stage (MoE expert replay, trainer/microbatches/moe_replay.py, sets its experts there)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    index = iter(range(len(micro_batches)))

    def forward_step(data_iterator, m):
        k = next(data_iterator)
        mb = micro_batches[k]
        if before_forward is not None:
            before_forward(k)
        with head.forward():
            if mb.packed is None:
                out = m(mb.tokens, mb.positions, None)
            else:  # THD: attention stays inside each packed sequence
                out = m(mb.tokens, mb.positions, None, packed_seq_params=mb.packed)

        def loss_func(output):
            rows = head.rows(output, mb.rows)
            # A CP rank may hold none of a micro-batch's response rows (all its chunks are prompt): nothing
            # to score there, but the zero loss below still runs the backward through the CP K/V gathers
            # that the other CP ranks take part in.
            count = rows.rows_shape[0] if isinstance(rows, OutputShard) else rows.size(0)
            loss = on_rows(rows, k) if count else None
            if loss is None:
                loss = output.sum() * 0.0
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
