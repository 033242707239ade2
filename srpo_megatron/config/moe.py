"""The recipe's ``moe`` section: router and expert controls of an MoE policy (see models/moe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from srpo_megatron.config.loading import ConfigError


@dataclass
class MoEConfig:
    """Router and expert controls of an MoE policy (ignored for dense models)."""

    dispatcher: Literal["alltoall", "allgather"] = "alltoall"  # megatron token dispatcher over EP
    router_dtype: Literal["fp32", "fp64"] = "fp32"  # dtype of the router GEMM, softmax and top-k
    aux_loss_coeff: float = 0.0  # load-balancing (aux_loss) coefficient; 0 = off, as in NeMo-RL's RL recipes
    z_loss_coeff: float = 0.0  # router z-loss coefficient; 0 = off
    freeze_router: bool = False  # router weights get no gradient (routing stays the pre-trained one)
    grouped_gemm: bool | None = None  # TE grouped GEMM experts; None = whenever Transformer Engine imports
    # DeepSeek-V3 / GLM-4.5 e_score_correction_bias step per update (megatron's aux-loss-free balancing);
    # 0 = frozen at the checkpoint's values, the RL default (see models/moe.py)
    expert_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        for key in ("aux_loss_coeff", "z_loss_coeff", "expert_bias_update_rate"):
            if getattr(self, key) < 0:
                raise ConfigError(f"moe.{key}={getattr(self, key)} must be >= 0 (0 switches it off)")
