"""What the losses take: one micro-batch of response tokens (``TokenBatch``) and the global quantities of
the whole training batch (``Normalizers``).

The leaf of ``losses/``: every loss module may import it, it imports none of them. The layout (flat
per-token rows, per-sample fields broadcast to the sample's rows) is described in ``losses/routed.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass
class TokenBatch:
    """One micro-batch of response tokens, flat over rows T (see the module docstring)."""

    response_ids: torch.Tensor  # [T] int64: sampled token y_t (global vocabulary id)
    mask: torch.Tensor  # [T] bool: a valid response token (False = padding / prompt / rejected off-policy)
    advantages: torch.Tensor  # [T] float: group advantage A_i of the row's sample
    grpo: torch.Tensor  # [T] bool: z_i^GRPO of the row's sample under the mode
    sdpo: torch.Tensor  # [T] bool: z_i^SDPO of the row's sample under the mode
    old_logp: torch.Tensor  # [T] float: log π_old(y_t) from the scoring pass
    rollout_logp: torch.Tensor | None = None  # [T] float: the engine's log π_rollout(y_t) (TIS)
    ref_logp: torch.Tensor | None = None  # [T] float: reference log-probs (only for kl_coef > 0)
    topk_ids: torch.Tensor | None = None  # [T, K] int64: student top-K ids (rows with sdpo set)
    teacher_logp: torch.Tensor | None = None  # [T, K+1] float: teacher log-probs at topk_ids + tail
    teacher_entropy: torch.Tensor | None = None  # [T] float: teacher full-vocabulary entropy H
    teacher_token_logp: torch.Tensor | None = None  # [T] float: log q(y_t) (advantage_mix only)
    teacher: torch.Tensor | None = None  # [T] bool: rows with teacher data (advantage_mix only)
    stale: torch.Tensor | None = None  # [T] bool: generated > rollout.off_policy_steps versions ago
    seq_log_ratio: torch.Tensor | None = None  # [T] float: Σ log π_old/π_rollout over the row's sample
    seq_weight: torch.Tensor | None = None  # [T] float64: 1/|y_i| of the row's sample (seq_mean_token_mean)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenBatch:
        """A new batch of ``fn`` applied to every tensor field (None fields stay None)."""
        values: dict[str, Any] = {
            f.name: (None if (v := getattr(self, f.name)) is None else fn(v)) for f in fields(self)
        }
        return TokenBatch(**values)

    def slice(self, start: int, end: int) -> TokenBatch:
        """Rows [start, end) as a new batch (views, no copies)."""
        return self._map(lambda v: v[start:end])

    def take(self, index: torch.Tensor) -> TokenBatch:
        """Rows ``index`` ([R] int64, on the batch's device) as a new batch (copies)."""
        return self._map(lambda v: v[index])

    def to(self, device: torch.device | str) -> TokenBatch:
        """Every tensor moved to ``device`` (one hand-off; a no-op for tensors already there)."""
        return self._map(lambda v: v.to(device))

    def split(self, n: int) -> list[TokenBatch]:
        """Split into ``n`` consecutive micro-batches of (nearly) equal rows."""
        t = len(self)
        bounds = [round(i * t / n) for i in range(n + 1)]
        return [self.slice(a, b) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class Normalizers:
    """Global quantities of the whole training batch (all micro-batches, all DP ranks)."""

    num_tokens: float  # valid response tokens: the denominator of L (token_mean)
    num_sdpo_tokens: float  # |Ω_sdpo|: valid tokens routed to SDPO
    sum_raw_weights: float  # Σ_{Ω_sdpo} w̃ with w̃ = exp(−β·H_teacher)
    num_seqs: float = 0.0  # N_seq: samples with a valid token, the denominator of seq_mean_token_mean

    @property
    def mean_raw_weight(self) -> float:
        return self.sum_raw_weights / max(self.num_sdpo_tokens, 1.0)
