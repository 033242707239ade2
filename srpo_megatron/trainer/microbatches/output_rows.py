"""What the loss sees of the last pipeline stage: the response rows' logits, or the output layer unapplied.

``OutputHead`` is chosen once per model (``performance.fused_output``, ``models/performance.py``):

- **off** (megatron's output layer): ``GPTModel`` returns ``[b, S, V/TP]`` logits; ``rows`` picks the
  response rows and masks the padded vocabulary ids (``logit_rows``).
- **on** (fused, ``ops/fused_output.py``): during the forward ``GPTModel.post_process`` reads False, so
  megatron's ``_postprocess`` returns the decoder's hidden states (after the final norm, which the decoder
  block applies itself) before its output layer; nothing of size ``[T, V/TP]`` is built. ``rows`` then
  does what ``ColumnParallelLinear`` would do around its GEMM: under sequence parallelism megatron's
  ``gather_from_sequence_parallel_region`` (backward: reduce-scatter of the partial hidden gradients),
  otherwise ``copy_to_tensor_model_parallel_region`` (backward: all-reduce over TP); then it picks the
  response rows and returns ``OutputShard(hidden rows, this rank's output weight, vocab_pad)``. The
  weight is ``shared_embedding_or_output_weight()`` for tied embeddings, so both uses share one gradient.

No megatron code is patched: ``post_process`` is an attribute megatron itself reads at forward time, set
for the duration of one forward call and restored. ``tests/unit/test_output_rows.py`` pins the upstream
fact (the hidden states come back unchanged when it is False) on every tested megatron-core version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.ops.fused_output import OutputShard

Rows = torch.Tensor | OutputShard


def logit_rows(logits: torch.Tensor, rows: torch.Tensor, vocab_pad: torch.Tensor | None) -> torch.Tensor:
    """[b, S, V/TP] logits → [T, V/TP] rows; padded vocabulary ids ([V/TP] bool, None = none) masked to a
    huge negative."""
    out = logits[rows]
    if vocab_pad is not None:
        out = out.masked_fill(vocab_pad, torch.finfo(out.dtype).min / 4)
    return out


def gpt_model(module: torch.nn.Module) -> Any:
    """The megatron ``GPTModel`` inside wrappers (DDP, Float16Module: each keeps it as ``.module``)."""
    m: Any = module
    while not hasattr(m, "shared_embedding_or_output_weight") and hasattr(m, "module"):
        m = m.module
    if not hasattr(m, "shared_embedding_or_output_weight"):
        raise TypeError(f"{type(module).__name__} holds no megatron GPTModel")
    return m


@contextlib.contextmanager
def hidden_states_only(gpt: Any) -> Iterator[None]:
    """For one forward: megatron's ``_postprocess`` returns the hidden states, not logits (module doc)."""
    was = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = was


class OutputHead:
    """The loss input of one model on the last stage (module doc)."""

    def __init__(
        self,
        module: torch.nn.Module,
        vocab_pad: torch.Tensor,
        *,
        fused: bool,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        # read once here, not per micro-batch (a host sync): None when this shard has no padded id
        self.vocab_pad = vocab_pad if bool(vocab_pad.any()) else None
        self.fused, self.tp_group = fused, tp_group
        self.sequence_parallel = sequence_parallel
        self.gpt = gpt_model(module) if fused else None
        if self.gpt is not None and self.gpt.config.mtp_num_layers:
            # megatron's MTP loss runs inside _postprocess, after the hidden states it would return
            raise ValueError(
                "performance.fused_output needs a model without MTP layers (mtp_num_layers is set); "
                "use performance.fused_output=off"
            )

    def forward(self) -> contextlib.AbstractContextManager[None]:
        """Wrap one model forward (a no-op unless fused)."""
        last = self.gpt is not None and self.gpt.post_process
        return hidden_states_only(self.gpt) if last else contextlib.nullcontext()

    def rows(self, output: torch.Tensor, rows: torch.Tensor) -> Rows:
        """The last stage's ``output`` → the loss input of ``rows`` ([b, S] bool, the response rows)."""
        if self.gpt is None:
            return logit_rows(output, rows, self.vocab_pad)
        hidden = hidden_rows(output, rows, self.tp_group, self.sequence_parallel)
        weight = (
            self.gpt.shared_embedding_or_output_weight()
            if self.gpt.share_embeddings_and_output_weights
            else self.gpt.output_layer.weight
        )
        return OutputShard(hidden, weight, self.vocab_pad)


def hidden_rows(
    output: torch.Tensor, rows: torch.Tensor, tp_group: dist.ProcessGroup | None, sequence_parallel: bool
) -> torch.Tensor:
    """Decoder output ``[S (/TP under SP), b, H]`` → the response rows' hidden states ``[T, H]``, entering
    the TP region as ``ColumnParallelLinear`` enters it (module doc), in ``[b, S]`` row order like logits."""
    from megatron.core import tensor_parallel

    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return output.transpose(0, 1)[rows]
    if sequence_parallel:  # all-gather along the sequence; backward: reduce-scatter into a new tensor
        full = tensor_parallel.gather_from_sequence_parallel_region(
            output, tensor_parallel_output_grad=True, group=tp_group
        )
        return full.transpose(0, 1)[rows]
    # After the row pick, so the gradient reaching the all-reduce is contiguous: megatron-core 0.16.1's
    # ``_reduce`` all-reduces ``grad.contiguous()`` and returns ``grad``, so a non-contiguous gradient (the
    # transpose's) went back unreduced (tests/dist/test_fused_output_tp.py caught exactly that).
    return tensor_parallel.copy_to_tensor_model_parallel_region(output.transpose(0, 1)[rows], group=tp_group)


def mix_rows(rows: Rows, other: Rows, alpha: float) -> Rows:
    """(1 − α)·rows + α·other: the trust-region teacher's logits mix, materialised or fused (forward only)."""
    if isinstance(rows, OutputShard):
        assert isinstance(other, OutputShard)  # both passes use one head kind
        return OutputShard(rows.hidden, rows.weight, rows.vocab_pad, mix=(alpha, other))
    assert isinstance(other, torch.Tensor)
    return (1 - alpha) * rows + alpha * other
