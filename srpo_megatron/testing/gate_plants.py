"""Planted regressions of the training-metric gate (``srpo_megatron.testing.gate``): what each changes.

Each plant is a change that a real regression could make and that the gate must catch (issue 28):

- ``entropy_weights_off``: the dynamic weights switched off (``loss.beta=0``: w̃ = 1 on every SDPO token);
- ``tis_cap``: the truncated-importance-sampling cap changed (``loss.tis_cap=0.5``). The gated run's engine
  holds the trainer's fp32 weights (trainer–engine gap ~5e-7, ``logprob/gap_mean``), so ρ = π_old/π_rollout
  is 1 to 1e-6 and a cap only changes anything where it binds, below 1;
- ``ema_alpha``: the EMA teacher's rate changed (``teacher.ema_alpha=0.2``; the recipe's is 0.05);
- ``routing_all_wrong_to_sdpo``: a CODE change, not a key: routing sends every wrong sample to SDPO, also
  in all-wrong groups that have no correct sibling (method §1.3 sends those to GRPO). It is planted by
  replacing ``route`` where the trainer calls it (``trainer/collect/sample_routing.py``) inside the training
  process: ``python -m srpo_megatron.testing.gate_plants routing_all_wrong_to_sdpo <srpo CLI args>``.

Override plants are plain ``-o KEY=VALUE`` overrides; ``code_plant_main`` applies a code plant and then
runs the ``srpo`` CLI in the same process.
"""

from __future__ import annotations

import sys

import torch

# plant -> the recipe overrides that plant it (code plants: none)
OVERRIDE_PLANTS: dict[str, list[str]] = {
    "entropy_weights_off": ["loss.beta=0"],
    "tis_cap": ["loss.tis_cap=0.5"],
    "ema_alpha": ["teacher.ema_alpha=0.2"],
}
CODE_PLANTS = ("routing_all_wrong_to_sdpo",)
PLANTS = (*OVERRIDE_PLANTS, *CODE_PLANTS)


def _route_all_wrong_to_sdpo(rewards: torch.Tensor, success_threshold: float = 0.5):
    """``losses.route`` with the planted bug: to_sdpo = every wrong sample, teacher or not (the sibling stays
    −1 where there is none, so the trainer's ``texts[i][-1]`` silently takes the group's last response)."""
    from srpo_megatron.losses.routing import Routing, route

    right = route(rewards, success_threshold)
    return Routing(right.correct, right.has_teacher, ~right.correct, right.sibling)


def apply_code_plant(name: str) -> None:
    """Install code plant ``name`` in this process (before the trainer runs)."""
    if name != "routing_all_wrong_to_sdpo":
        raise SystemExit(f"gate_plants: unknown code plant {name!r}; choose one of {', '.join(CODE_PLANTS)}")
    from srpo_megatron.trainer.collect import sample_routing

    sample_routing.route = _route_all_wrong_to_sdpo


def code_plant_main(argv: list[str]) -> int:
    """``python -m srpo_megatron.testing.gate_plants PLANT ARGS...``: apply PLANT, then ``srpo ARGS...``."""
    if not argv:
        raise SystemExit(f"usage: gate_plants PLANT SRPO_ARGS...; PLANT is one of {', '.join(CODE_PLANTS)}")
    apply_code_plant(argv[0])
    from srpo_megatron.cli import main

    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(code_plant_main(sys.argv[1:]))
