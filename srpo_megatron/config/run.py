"""The recipe's ``run`` section: where the run lives, how it logs and how often it saves."""

from __future__ import annotations

from dataclasses import dataclass

from srpo_megatron.config.loading import ConfigError


@dataclass
class RunConfig:
    """Where the run lives and how often it saves."""

    dir: str = "runs/srpo"  # run directory: metrics.jsonl, tensorboard/, checkpoints/, eval/, plots/
    seed: int = 1234  # seeds init, rollout sampling (per step) and data shuffling
    save_every: int = 10  # checkpoint every N optimizer steps (0 = only at the end)
    keep_last: int = 2  # checkpoints kept (older ones are deleted after a new one is complete)
    # Distributed-optimizer state saved model-shaped (megatron's fully_reshardable: gathered on DP rank 0,
    # slow) so a resume may change TP/PP/EP; false = dp_reshardable, fully parallel, resumes at any DP
    checkpoint_fully_reshardable: bool = False
    tensorboard: bool = True  # also write TensorBoard scalars under <dir>/tensorboard
    wandb_project: str | None = None  # log to Weights & Biases too (needs the `wandb` extra)
    progress_bar: bool = True  # a tqdm bar with the key figures on rank 0
    # Start from step 0 over existing checkpoints, ONCE per run.dir: the first start with it moves
    # checkpoints/ aside (the newest keep_last moved-aside folders are kept) and writes
    # <dir>/restart_done.json; later starts with the flag (a requeue, the same command) resume. Delete
    # restart_done.json to start over again.
    restart: bool = False

    def __post_init__(self) -> None:
        if not str(self.dir).strip():
            raise ConfigError(
                "run.dir is empty: the run would write into the current directory; set run.dir=runs/NAME"
            )
        if self.save_every < 0 or self.keep_last < 1:
            raise ConfigError(
                f"run.save_every={self.save_every} / run.keep_last={self.keep_last}: save_every must be "
                ">= 0 (0 = only at the end) and keep_last >= 1"
            )
