"""SRPO losses: routing, group advantages, GRPO and SDPO token losses, off-policy corrections, the routed
objective.

All are pure functions of tensors (plus explicit process groups) returning ``(per-token loss, metrics)``
where they are losses; ``routed_loss`` owns nothing global — the caller supplies the denominators.
"""

from srpo_megatron.losses.aggregation import sequence_weights
from srpo_megatron.losses.batch import Normalizers, TokenBatch
from srpo_megatron.losses.grpo import grpo_token_loss, tis_weight
from srpo_megatron.losses.importance import apply_rejections, bounded_is_weight, sequence_log_ratio
from srpo_megatron.losses.routed import global_normalizers, routed_loss
from srpo_megatron.losses.routing import Routing, group_advantages, route, routing_masks
from srpo_megatron.losses.scoring import StudentScore, TeacherScore, score_student, score_teacher
from srpo_megatron.losses.sdpo import dynamic_weights, raw_weights, sdpo_token_loss, topk_divergence

__all__ = [
    "Normalizers",
    "Routing",
    "StudentScore",
    "TeacherScore",
    "TokenBatch",
    "apply_rejections",
    "bounded_is_weight",
    "dynamic_weights",
    "global_normalizers",
    "group_advantages",
    "grpo_token_loss",
    "raw_weights",
    "route",
    "routed_loss",
    "routing_masks",
    "score_student",
    "score_teacher",
    "sdpo_token_loss",
    "sequence_log_ratio",
    "sequence_weights",
    "tis_weight",
    "topk_divergence",
]
