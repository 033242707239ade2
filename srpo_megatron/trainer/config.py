"""The typed recipe of ``srpo train``: one dataclass per component, composed into ``TrainConfig``.

A recipe (``examples/*.yaml``) is loaded strictly with ``srpo_megatron.configs.load_config``: unknown
keys are rejected with the valid ones listed, values are type-checked, and each component validates its
own semantics (``__post_init__``) with an error that says what is wrong, why and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from srpo_megatron.configs import ConfigError
from srpo_megatron.data.config import DataConfig
from srpo_megatron.evaluation.config import EvalConfig
from srpo_megatron.losses.config import LossConfig
from srpo_megatron.models.moe import MoEConfig
from srpo_megatron.models.performance import PerformanceConfig
from srpo_megatron.parallel import ParallelConfig
from srpo_megatron.rollout.config import RolloutConfig, SGLangEngineConfig  # noqa: F401 - re-exported


@dataclass
class RunConfig:
    """Where the run lives and how often it saves."""

    dir: str = "runs/srpo"  # run directory: metrics.jsonl, tensorboard/, checkpoints/, eval/, plots/
    seed: int = 1234  # seeds init, rollout sampling (per step) and data shuffling
    save_every: int = 10  # checkpoint every N optimizer steps (0 = only at the end)
    keep_last: int = 2  # checkpoints kept (older ones are deleted after a new one is complete)
    tensorboard: bool = True  # also write TensorBoard scalars under <dir>/tensorboard
    wandb_project: str | None = None  # log to Weights & Biases too (needs the `wandb` extra)
    progress_bar: bool = True  # a tqdm bar with the key figures on rank 0
    restart: bool = False  # start from step 0 even over existing checkpoints (they are moved aside)

    def __post_init__(self) -> None:
        if self.save_every < 0 or self.keep_last < 1:
            raise ConfigError(
                f"run.save_every={self.save_every} / run.keep_last={self.keep_last}: save_every must be "
                ">= 0 (0 = only at the end) and keep_last >= 1"
            )


@dataclass
class ModelConfig:
    """The policy: an HF folder (config, tokenizer, weights) and optionally a converted checkpoint."""

    hf_dir: str = ""  # HF model folder (config.json, tokenizer, safetensors); the rollout engine loads it
    megatron_checkpoint: str | None = None  # tools/convert_hf_to_megatron.py output; None = read hf_dir
    params_dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 (fp32 main params) on CUDA, else fp32
    max_sequence_length: int = 4096  # longest prompt + response the policy will see (RoPE table size)

    def __post_init__(self) -> None:
        if self.max_sequence_length < 1:
            raise ConfigError(f"model.max_sequence_length={self.max_sequence_length} must be >= 1 (tokens)")
        if not self.hf_dir:
            raise ConfigError(
                "model.hf_dir is empty: point it at an HF model folder (config.json + tokenizer + "
                "safetensors), e.g. the output of tools/prepare_smollm2.py"
            )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up to a constant learning rate (method §4)."""

    lr: float = 5e-6  # peak (constant) learning rate; paper: GRPO 1e-6, SDPO 1e-5, SRPO 5e-6
    warmup_steps: int = 10  # linear warm-up steps from 0
    weight_decay: float = 0.01  # decoupled weight decay
    adam_beta1: float = 0.9  # AdamW β1
    adam_beta2: float = 0.999  # AdamW β2
    adam_eps: float = 1e-8  # AdamW ε
    clip_grad: float = 1.0  # global gradient-norm clip (0 = off)

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or self.clip_grad < 0:
            raise ConfigError(
                f"optim: lr={self.lr} must be > 0, warmup_steps={self.warmup_steps} >= 0, "
                f"clip_grad={self.clip_grad} >= 0"
            )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name}={getattr(self, name)} must be in [0, 1) (0.9 / 0.999)")
        if self.adam_eps <= 0 or self.weight_decay < 0:
            raise ConfigError(
                f"optim.adam_eps={self.adam_eps} must be > 0 (1e-8) and optim.weight_decay="
                f"{self.weight_decay} >= 0"
            )


@dataclass
class TeacherConfig:
    """The self-teacher of SDPO (method §1.4–1.5)."""

    kind: Literal["ema", "frozen", "trust_region"] = "ema"  # EMA of the student / initial model / mix
    ema_alpha: float = (
        0.05  # θ′ ← (1−α)θ′ + αθ after each step; trust_region: log q = (1−α)log q_ref + α log q_θ
    )
    max_prompt_tokens: int = 4096  # teacher prompt (with the sibling's solution) truncated from the right
    # the teacher's user turn (method §1.4); {user_prompt} and {sibling_response} are filled in
    solution_template: str = (
        "{user_prompt}\nCorrect solution:\n\n{sibling_response}\n\nCorrectly solve the original question."
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.ema_alpha <= 1.0:
            raise ConfigError(f"teacher.ema_alpha={self.ema_alpha} must be in [0, 1] (paper: 0.05)")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"teacher.max_prompt_tokens={self.max_prompt_tokens} must be >= 1")
        for key in ("{user_prompt}", "{sibling_response}"):
            if key not in self.solution_template:
                raise ConfigError(f"teacher.solution_template must contain {key}")


@dataclass
class TrainLoopConfig:
    """Steps and batching of the optimisation."""

    steps: int = 100  # training steps (each: one rollout batch)
    mini_batches: int = 1  # optimizer steps per rollout batch (paper: SRPO/SDPO 1, GRPO 4)
    micro_batch_size: int = 4  # sequences per forward/backward micro-batch on each DP rank (unpacked)
    # > 0: pack sequences end to end (THD) into micro-batches of at most this many tokens (first-fit
    # decreasing) instead of micro_batch_size right-padded rows; 0 = off. Required for parallel.cp > 1.
    max_tokens_per_micro_batch: int = 0
    skip_nonfinite: bool = True  # skip (and count) a step whose loss or grad norm is NaN/inf
    eval_at_ends: bool = (
        False  # evaluate before the first and after the last step (eval.every_n_steps between)
    )
    eval_greedy: bool = True  # with each evaluation also report greedy accuracy (temperature 0, k = 1)
    # with eval_at_ends: also evaluate the starting weights (False: a study shares one step-0 evaluation)
    eval_at_start: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError(
                f"train.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0 "
                "(0 turns packing off)"
            )
        if self.steps < 0 or self.mini_batches < 1 or self.micro_batch_size < 1:
            raise ConfigError(
                f"train: steps={self.steps} >= 0, mini_batches={self.mini_batches} >= 1 and "
                f"micro_batch_size={self.micro_batch_size} >= 1 are required"
            )


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

    def __post_init__(self) -> None:
        if abs(self.loss.temperature - self.rollout.temperature) > 1e-12:
            raise ConfigError(
                f"loss.temperature={self.loss.temperature} differs from rollout.temperature="
                f"{self.rollout.temperature}: the loss must divide logits by the sampling temperature "
                "(method §2); set both to the same value"
            )
        if self.rollout.prompts_per_step % self.train.mini_batches:
            raise ConfigError(
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} is not divisible by "
                f"train.mini_batches={self.train.mini_batches}; each optimizer step takes whole prompt groups"
            )
        cp, budget = self.parallel.cp, self.train.max_tokens_per_micro_batch
        if cp > 1 and (budget <= 0 or budget % (2 * cp)):
            raise ConfigError(
                f"parallel.cp={cp} splits every packed sequence into 2·cp = {2 * cp} chunks, so it needs "
                f"packing: train.max_tokens_per_micro_batch={budget} must be a positive multiple of "
                f"{2 * cp}; set it (e.g. {2 * cp * 1024}) or set parallel.cp=1"
            )
