"""The typed recipe of ``srpo train``: the sections composed into ``TrainConfig``, and the rules that
span sections.

A recipe (``examples/*.yaml``) is loaded strictly with :func:`load_recipe` (``base:`` and overrides as in
config/loading.py): unknown keys are rejected with the valid ones listed, values are type-checked, and
each section validates its own semantics (``__post_init__``) with an error that says what is wrong, why
and how to fix it. Here: one sampling temperature (the loss takes ``rollout.temperature``), no KL
penalty without a reference policy, whole prompt groups per optimizer step, packing for CP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from srpo_megatron.config.data import DataConfig
from srpo_megatron.config.evaluation import EvalConfig
from srpo_megatron.config.loading import ConfigError, load_config, warn_config
from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.config.loss import LossConfig
from srpo_megatron.config.model import ModelConfig
from srpo_megatron.config.moe import MoEConfig
from srpo_megatron.config.optim import OptimConfig
from srpo_megatron.config.parallel import ParallelConfig
from srpo_megatron.config.performance import PerformanceConfig
from srpo_megatron.config.rollout import RolloutConfig
from srpo_megatron.config.run import RunConfig
from srpo_megatron.config.teacher import TeacherConfig
from srpo_megatron.config.train_loop import TrainLoopConfig


@dataclass
class TrainConfig:
    """A whole ``srpo train`` recipe."""

    model: ModelConfig
    data: DataConfig
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)  # GPU kernels, recompute
    moe: MoEConfig = field(default_factory=MoEConfig)  # router/expert controls (MoE policies only)
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters; rank 0 = full fine-tuning

    def __post_init__(self) -> None:
        # One sampling temperature (method §2): the loss divides logits by the one the rollouts used.
        self.loss.temperature = self.rollout.temperature
        if self.loss.kl_coef > 0:
            raise ConfigError(
                f"loss.kl_coef={self.loss.kl_coef}: the k3 KL penalty needs reference-policy log-probs, and "
                "`srpo train` keeps no reference policy (no reference forward runs), so the first step "
                "with GRPO tokens would fail in the loss and the term would mean nothing elsewhere; set "
                "loss.kl_coef=0 (the paper's setting; the clip and the EMA teacher bound the drift)"
            )
        if self.rollout.prompts_per_step % self.train.mini_batches:
            raise ConfigError(
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} is not divisible by "
                f"train.mini_batches={self.train.mini_batches}; each optimizer step takes whole prompt groups"
            )
        if self.loss.mask_stale_tokens and not self.rollout.off_policy_steps:
            warn_config(
                "loss.mask_stale_tokens=true does nothing at rollout.off_policy_steps=0: on-policy, no token "
                "is ever staler than the bound; set rollout.off_policy_steps >= 1 or drop the key"
            )
        if self.lora.enabled and self.lora.sync == "adapter" and self.rollout.engine == "sglang":
            self._check_sglang_adapter_sync()
        cp, budget = self.parallel.cp, self.train.max_tokens_per_micro_batch
        if cp > 1 and (budget <= 0 or budget % (2 * cp)):
            raise ConfigError(
                f"parallel.cp={cp} splits every packed sequence into 2·cp = {2 * cp} chunks, so it needs "
                f"packing: train.max_tokens_per_micro_batch={budget} must be a positive multiple of "
                f"{2 * cp}; set it (e.g. {2 * cp * 1024}) or set parallel.cp=1"
            )

    def _check_sglang_adapter_sync(self) -> None:
        """SGLang takes adapters by ``/load_lora_adapter_from_tensors`` from the colocated trainer
        (same-host tensors) over HTTP, and stamps their version by ``/update_weight_version``, which the
        offline ``sglang.Engine`` lacks (``weights.lora_engine_sync``)."""
        r, s = self.rollout, self.rollout.sglang
        assert s is not None  # RolloutConfig requires the section for engine=sglang
        if r.placement != "colocated" or s.mode != "http" or s.weight_sync != "tensor":
            raise ConfigError(
                f"lora.sync=adapter with rollout.engine=sglang needs rollout.placement=colocated, "
                f"rollout.sglang.mode=http and rollout.sglang.weight_sync=tensor (got {r.placement}, "
                f"{s.mode}, {s.weight_sync}): the adapter goes to the server as same-host tensors and only "
                "the HTTP server can stamp its version; set those, or "
                "lora.sync: merged (the engines get W + (alpha/r) B A as full weights)"
            )


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The one way a recipe file becomes a ``TrainConfig``: ``base:`` chain resolved, ``key=value``
    overrides applied last, every section type-checked and validated (``srpo train``, ``eval``,
    ``launch``, ``plan``, ``doctor`` and the SGLang server launcher all call this)."""
    return load_config(TrainConfig, path, overrides)
