"""RMSNorm for megatron's local layer spec under sequence parallelism (CPU tests, GPUs without TE/apex).

megatron-core's local spec uses ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel``:
under sequence parallelism each TP rank normalises only its ``S/TP`` rows, so a norm weight's gradient is
a partial sum that ``finalize_model_grads`` must all-reduce over TP, and it does so only for parameters
marked ``sequence_parallel`` (what TE's and apex's norms do). ``SequenceParallelRMSNorm`` is exactly
``torch.nn.RMSNorm`` (same parameter, same maths as ``WrappedTorchNorm``'s RMSNorm) plus that mark.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last dim ``[..., H]`` whose weight is marked for the TP all-reduce."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"SequenceParallelRMSNorm implements plain RMSNorm only (got normalization="
                f"{config.normalization!r}, zero_centered_gamma={config.layernorm_zero_centered_gamma})"
            )
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # read by finalize_model_grads
