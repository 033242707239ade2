"""The rollout-engine interface shared by the SGLang engine (GPU clusters) and the CPU engine.

Trainer, evaluation and weight sync only talk to this Protocol. An engine serves exactly one weight
*version* at a time: ``update_weights`` either installs a complete new version or leaves the old one
serving (or refuses to generate) — never a mixture.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """The rollout engine failed (crash, timeout, inconsistent weights). The message says which and why."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``n`` completions are drawn per prompt."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k truncation
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting any of these (EOS is added)
    seed: int | None = None  # makes a call reproducible when set
    prompt_offset: int = 0  # global index of prompts[0]: per-sample seeds follow the global prompt index,
    # so a prompt's samples do not depend on how prompts are split across engines
    # MoE: report each token's routed experts in ``Completion.routed_experts`` (rollout routing replay;
    # SGLang needs ``--enable-return-routed-experts``). Ignored by dense models.
    return_routed_experts: bool = False
    # Report the engine's K most likely tokens and their log-probs at every response position
    # (``Completion.top_ids`` / ``top_logprobs``; SGLang ``top_logprobs_num``); 0 = none.
    top_logprobs: int = 0


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 63-bit seed of one sample: depends only on (call seed, prompt index, sample index), so seeded
    samples do not depend on how an engine batches them. Every engine derives its per-sample seeds here."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Completion:
    """One sampled response: token ids, the engine's log-prob of each sampled token, why it ended."""

    prompt_index: int  # index of the prompt in the ``generate`` call
    token_ids: list[int]
    logprobs: list[float]  # log π_rollout(y_t | ...) at the sampling temperature, len == len(token_ids)
    finish_reason: FinishReason
    weight_version: int = 0  # weight version the engine served when the sample was dispatched
    # Partial rollouts: the version that generated each token (len == len(token_ids)); None = every token
    # is ``weight_version``'s (an uninterrupted generation).
    token_versions: list[int] | None = None
    # MoE, when ``SamplingParams.return_routed_experts``: int ``[P + R - 1, layers, top_k]`` global expert
    # ids (flat ``[(P + R - 1) · layers · top_k]`` from SGLang), one row per position the engine forwarded:
    # the prompt and every response token but the last, in SGLang's layout (``rollout/routed_experts.py``).
    # None for dense models or when not requested.
    routed_experts: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)  # engine-specific extras for logs (sample index, raw reason)
    # When ``SamplingParams.top_logprobs`` = K > 0: the engine's K most likely ids at each response position
    # ``[R, K]`` int64 and their log-probs ``[R, K]`` float32, from the same distribution as ``logprobs``
    # (temperature-scaled, before top-k/top-p). None when not requested. Declared after ``meta`` so that
    # positional construction (tests, the rollout buffer) keeps working.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # The CPU engine's precision audit (``rollout/precision_audit.py``): per response token
    # |log π_served − log π_sent|, the served precision's own gap in the engine's arithmetic. None when
    # the engine does not audit (SGLang; the CPU engine without ``rollout.parity_top_k``).
    precision_gap: list[float] | None = None


@dataclass(frozen=True)
class EngineHealth:
    ok: bool
    weight_version: int
    detail: str = ""


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout engine provides (CPU transformers engine, SGLang offline/HTTP)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt; result[i] holds prompt i's completions."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Install a complete set of HF-named weights as ``version`` (atomic: all or nothing). Works on a
        released engine too: it resumes what the update needs, and serves again once it succeeded."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights currently served."""
        ...

    def release_memory(self) -> None:
        """Free accelerator memory (colocated training); ``generate`` is refused until resumed."""
        ...

    def resume_memory(self) -> None: ...

    def health(self) -> EngineHealth: ...

    def shutdown(self) -> None: ...
