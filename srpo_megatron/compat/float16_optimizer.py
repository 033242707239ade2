"""Shim: checkpoint megatron's bf16 optimizer (no distributed optimizer) when some parameters stay fp32.

Without Transformer Engine the policy is built from megatron's local spec, whose torch RMSNorm weights
stay fp32 inside a bf16 model. ``Float16OptimizerWithFloat16Params`` trains such a model correctly (fp32
parameters go to its ``fp32_from_fp32_groups``), but its ``sharded_state_dict`` (megatron-core 0.16.1 and
0.19.2) numbers the parameters by enumerating the *bf16* parameters only, while the torch optimizer's
state ids enumerate *every* parameter of ``optimizer.param_groups``. An fp32 parameter's id then names no
model tensor (``ValueError: Param id 10 does not match any model sharded param`` on save) and, had the fp32
parameters come first, bf16 ids would name the wrong tensor. The distributed optimizer keeps its own
fp32 groups and is not affected.

:func:`fix_float16_optimizer_checkpointing` replaces that method, on each such optimizer instance and for
the duration of a ``with`` block, by :func:`sharded_state_dict`: upstream's method with the id map built
from the optimizer's own parameter order (each fp32 main parameter mapped back to its bf16 model
parameter, each fp32 parameter to itself). A second upstream limit shows on load: a parameter group
holding only fp32 parameters (the no-weight-decay group of norms) has no fp32 main copies, and when
``dist_checkpointing`` splits ``[[tensors], []]`` into tensors and the rest, list positions are lost
(``[[tensors]]`` and ``[[]]``), so loading fails with "Cannot merge two lists with different lengths"
(``dict_utils.extract_matching_values``/``merge``). The main copies are therefore
stored per group in a dict ``{group index: [...]}``, which keeps its keys, and :func:`load_state_dict`
turns it back into upstream's list before upstream's method loads it. Tensor keys are upstream's
(``optimizer.state.fp32_param.*``, ``optimizer.state.exp_avg.*``, ...).
tests/dist/test_bf16_resume.py checks the resume is exact, that the layout is upstream's where upstream
works, and fails once upstream saves such a model itself (then drop this module).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def needs_fix(optimizer: Any) -> bool:
    """True for a megatron ``Float16OptimizerWithFloat16Params`` that holds fp32 model parameters."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return isinstance(optimizer, Float16OptimizerWithFloat16Params) and any(
        getattr(optimizer, "fp32_from_fp32_groups", [])
    )


def sharded_state_dict(self: Any, model_sharded_state_dict: Any, is_loading: bool = False, metadata=None):
    """``Float16OptimizerWithFloat16Params.sharded_state_dict`` with ids in the optimizer's own order."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    if is_loading:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    model_of = {  # id(fp32 main param) -> its bf16 model param
        id(main): model
        for models, mains in zip(self.float16_groups, self.fp32_from_float16_groups, strict=True)
        for model, main in zip(models, mains, strict=True)
    }
    groups = self.optimizer.param_groups
    in_order = [model_of.get(id(p), p) for group in groups for p in group["params"]]  # torch's state ids
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, in_order)
    state_groups = state_dict["optimizer"]["param_groups"]
    state_dict["fp32_from_fp16_params"] = {  # a dict: see the module docstring (load_state_dict)
        g: [
            make_sharded_optimizer_tensor(id_map[i], main, prefix="optimizer.state.fp32_param")
            for i, main in zip(
                [i for i, p in zip(state_group["params"], group["params"], strict=True) if id(p) in model_of],
                mains,
                strict=True,
            )
        ]
        for g, (mains, group, state_group) in enumerate(
            zip(self.fp32_from_float16_groups, groups, state_groups, strict=True)
        )
    }
    step = self._extract_common_per_param_step(state_dict["optimizer"])
    # Every state tensor has its parameter's shape; the step is saved once, shared by all parameters.
    optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def load_state_dict(self: Any, state_dict: dict) -> None:
    """Upstream's ``load_state_dict``, given :func:`sharded_state_dict`'s dict of groups as its list."""
    groups = state_dict["fp32_from_fp16_params"]
    if isinstance(groups, dict):
        state_dict = {**state_dict, "fp32_from_fp16_params": [groups[g] for g in range(len(groups))]}
    type(self).load_state_dict(self, state_dict)


@contextlib.contextmanager
def fix_float16_optimizer_checkpointing(optimizer: Any) -> Iterator[int]:
    """Within the block, every chained optimizer :func:`needs_fix` selects uses :func:`sharded_state_dict`
    and :func:`load_state_dict` (save and load must both run inside one).

    Yields how many optimizers it fixed (0: nothing to do, e.g. TE's bf16 norms or fp32 params)."""
    fixed = [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if needs_fix(o)]
    for opt in fixed:
        opt.sharded_state_dict = sharded_state_dict.__get__(opt)
        opt.load_state_dict = load_state_dict.__get__(opt)
    try:
        yield len(fixed)
    finally:
        for opt in fixed:
            del opt.sharded_state_dict, opt.load_state_dict  # back to the class's methods
