"""Sample routing and group advantages (method §1.2–1.3, §2): pure functions of per-sample rewards.

Per-sample tensors are ``[B, G]`` (B prompts, G rollouts each). The trainer broadcasts them to the
response tokens of each sample (``values[sample_of_token]``) to build a ``TokenBatch``.

Loss modes (``routing_masks``), per sample i with c_i = correct, m_i = has a correct sibling j ≠ i:

====================  =========================================  ================================
mode                  loss of sample i                           teacher context (sibling j ≠ i)
====================  =========================================  ================================
srpo, srpo_no_dw      SDPO if (1 − c_i)·m_i, else GRPO           first correct j ≠ i
grpo                  GRPO                                       none
sdpo                  SDPO if m_i, else none                     first correct j ≠ i
sdpo_incorrect_only   SDPO if (1 − c_i)·m_i, else none           first correct j ≠ i
sdpo_correct_only     SDPO if c_i·m_i, else none                 first correct j ≠ i (never i)
advantage_mix         GRPO (mixed advantage); teacher if m_i     first correct j ≠ i
====================  =========================================  ================================

The two ``sdpo_*_only`` modes are the paper's Fig. 1(b) restrictions of pure SDPO: the same
self-distillation loss on a subset of the samples SDPO would train on. As in pure SDPO, a sample
outside the subset (including every sample without a teacher) takes no loss at all — no GRPO fallback —
but its tokens still count in the loss denominator (``routed_loss``). ``sdpo_correct_only`` needs at
least two correct samples in a group: a correct sample's teacher sees another correct sibling's
solution, never its own. Neither uses the dynamic weights (only ``srpo`` does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """Routing decision for each sample (all ``[B, G]``).

    correct:     c_i = 1[r_i >= threshold]
    has_teacher: m_i = 1 if another sample of the group (j ≠ i) is correct
    to_sdpo:     z_i^SDPO = (1 − c_i)·m_i   (z_i^GRPO = ~to_sdpo)
    sibling:     int64 index of the first correct sibling j ≠ i, −1 if none (the teacher's context)
    """

    correct: torch.Tensor
    has_teacher: torch.Tensor
    to_sdpo: torch.Tensor
    sibling: torch.Tensor


def route(rewards: torch.Tensor, success_threshold: float = 0.5) -> Routing:
    """Route each sample of ``rewards`` [B, G] to GRPO or SDPO exactly as method §1.3."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G] (prompts × rollouts), got shape {tuple(rewards.shape)}")
    correct = rewards >= success_threshold
    g = rewards.shape[1]
    others = ~torch.eye(g, dtype=torch.bool, device=rewards.device)  # [i, j]: j ≠ i
    candidate = correct[:, None, :] & others[None]  # [B, i, j]
    has_teacher = candidate.any(dim=-1)
    # argmax returns the first maximal index, i.e. the lowest correct j ≠ i.
    sibling = torch.where(has_teacher, candidate.to(torch.int8).argmax(dim=-1), -1)
    return Routing(correct, has_teacher, ~correct & has_teacher, sibling)


def group_advantages(rewards: torch.Tensor, std_normalize: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i − mean_group(r), optionally / (std_group(r) + eps): [B, G] → [B, G] (float).

    The std is the unbiased sample std (as in GRPO implementations); a group of one has advantage 0.
    """
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + eps)
    return adv


def routing_masks(routing: Routing, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which samples take which loss under ``mode``: (grpo, sdpo, needs_teacher), each bool [B, G].

    srpo / srpo_no_dw: GRPO for ~to_sdpo, SDPO for to_sdpo; the teacher runs on to_sdpo samples only.
    grpo:              GRPO for all; no teacher.
    sdpo:              SDPO for every sample with a correct sibling (correct or not), nothing for the rest.
    sdpo_incorrect_only: SDPO for wrong samples with a correct sibling (= to_sdpo), nothing for the rest.
    sdpo_correct_only:   SDPO for correct samples with another correct sibling, nothing for the rest.
    advantage_mix:     GRPO loss for all with a mixed advantage; the teacher runs on samples with a sibling.
    """
    every = torch.ones_like(routing.correct)
    none = torch.zeros_like(routing.correct)
    if mode in ("srpo", "srpo_no_dw"):
        return ~routing.to_sdpo, routing.to_sdpo, routing.to_sdpo
    if mode == "grpo":
        return every, none, none
    if mode == "sdpo":
        return none, routing.has_teacher, routing.has_teacher
    if mode == "sdpo_incorrect_only":
        return none, routing.to_sdpo, routing.to_sdpo
    if mode == "sdpo_correct_only":
        correct_with_teacher = routing.correct & routing.has_teacher
        return none, correct_with_teacher, correct_with_teacher
    if mode == "advantage_mix":
        return every, none, routing.has_teacher
    raise ValueError(
        f"unknown loss mode {mode!r}; choose srpo, grpo, sdpo, srpo_no_dw, sdpo_incorrect_only, "
        "sdpo_correct_only or advantage_mix"
    )
