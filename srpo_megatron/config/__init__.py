"""The typed recipe: every section's dataclass and the strict loader, importable without torch.

``load_recipe(path, overrides)`` is the one way a recipe becomes a :class:`TrainConfig`: ``srpo train``,
``eval``, ``launch``, ``plan``, ``doctor`` and the SGLang server launcher all call it. One file per
section (``run.py``, ``rollout.py``, ...); ``loading.py`` turns YAML (with ``base:`` inheritance) and
``key=value`` overrides into them; ``recipe.py`` composes them and holds the cross-section checks;
``cluster.py`` is the cluster file of ``srpo launch`` / ``plan`` / ``doctor``. Nothing here imports
torch, transformers or megatron (tests/unit/test_configs.py checks it in a subprocess).
"""

from srpo_megatron.config.cluster import CLUSTER_DIR, ClusterConfig, TunnelConfig, cluster_files, load_cluster
from srpo_megatron.config.data import ArithmeticTaskConfig, DataConfig
from srpo_megatron.config.evaluation import EvalConfig
from srpo_megatron.config.loading import (
    ConfigError,
    ConfigWarning,
    apply_overrides,
    from_dict,
    load_config,
    load_recipe_data,
    load_yaml,
    to_dict,
)
from srpo_megatron.config.loss import MODES, LossConfig
from srpo_megatron.config.model import ModelConfig
from srpo_megatron.config.moe import MoEConfig
from srpo_megatron.config.optim import OptimConfig
from srpo_megatron.config.parallel import ParallelConfig
from srpo_megatron.config.performance import RECOMPUTE_MODULES, PerformanceConfig
from srpo_megatron.config.recipe import TrainConfig, load_recipe
from srpo_megatron.config.rollout import RolloutConfig, SGLangEngineConfig
from srpo_megatron.config.run import RunConfig
from srpo_megatron.config.teacher import TeacherConfig
from srpo_megatron.config.train_loop import TrainLoopConfig

__all__ = [
    "CLUSTER_DIR",
    "MODES",
    "RECOMPUTE_MODULES",
    "ArithmeticTaskConfig",
    "ClusterConfig",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "EvalConfig",
    "LossConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PerformanceConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangEngineConfig",
    "TeacherConfig",
    "TrainConfig",
    "TrainLoopConfig",
    "TunnelConfig",
    "apply_overrides",
    "cluster_files",
    "from_dict",
    "load_cluster",
    "load_config",
    "load_recipe",
    "load_recipe_data",
    "load_yaml",
    "to_dict",
]
