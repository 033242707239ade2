"""Numerical kernels on tensor-parallel shards (pure functions of tensors and explicit process groups)."""

from srpo_megatron.ops.fused_output import OutputShard
from srpo_megatron.ops.vocab_parallel import VocabStats, append_tail, entropy, log_probs, token_stats, top_k

__all__ = ["OutputShard", "VocabStats", "append_tail", "entropy", "log_probs", "token_stats", "top_k"]
