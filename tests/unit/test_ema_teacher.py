"""The EMA teacher keeps an fp32 copy (trainer/state/teacher.py): in bf16 it follows a float64 reference EMA
of a steadily drifting student, where the old bf16-in-place update (planted here) nearly freezes."""

from __future__ import annotations

import torch

from srpo_megatron.trainer.state.teacher import EmaTeacher

ALPHA, STEPS, DRIFT = 0.05, 500, 5e-6  # the setting: Adam-sized steps of lr 5e-6


def _student_trajectory():
    """θ_t (float64) for t = 1..STEPS: weights of typical scale drifting by DRIFT per step."""
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(4096, generator=g, dtype=torch.float64) * 0.02
    sign = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0).double()
    return theta0, [theta0 + t * DRIFT * sign for t in range(1, STEPS + 1)]


def _reference(theta0, trajectory):
    ref = theta0.clone()
    for theta in trajectory:
        ref = (1 - ALPHA) * ref + ALPHA * theta
    return ref


def _followed(teacher: torch.Tensor, ref: torch.Tensor, theta0: torch.Tensor) -> float:
    """Fraction of the reference teacher's drift the teacher followed (1.0 = exactly)."""
    drift = ref - theta0
    return float(((teacher.double() - theta0) * drift.sign()).sum() / drift.abs().sum())


def test_bf16_teacher_follows_the_float64_ema_within_one_percent():
    theta0, trajectory = _student_trajectory()
    ref = _reference(theta0, trajectory)
    module = torch.nn.Linear(4096, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(theta0.view(1, -1))
    teacher = EmaTeacher(module, "ema", ALPHA)
    theta0_bf16 = module.weight.detach().double().view(-1).clone()
    for theta in trajectory:
        teacher.update([theta.float().view(1, -1)])  # the optimizer's fp32 main params
    # The fp32 copy tracks the reference element by element; the bf16 forward copy on aggregate.
    err = (teacher.master[0].double().view(-1) - ref).abs() / (ref - theta0).abs()
    assert err.max() < 0.01, f"fp32 copy off by {err.max():.3%} of the drift"
    followed = _followed(module.weight.detach().view(-1), ref, theta0_bf16)
    assert abs(followed - 1.0) < 0.01, f"bf16 teacher followed {followed:.1%} of the reference EMA"


def test_the_old_bf16_in_place_update_misses_the_reference():
    theta0, trajectory = _student_trajectory()
    ref = _reference(theta0, trajectory)
    teacher = theta0.to(torch.bfloat16)
    start = teacher.double().clone()
    for theta in trajectory:  # the update this module replaced: θ′ and θ both bf16, in place
        teacher.mul_(1 - ALPHA).add_(theta.to(torch.bfloat16), alpha=ALPHA)
    followed = _followed(teacher, ref, start)
    assert abs(followed - 1.0) > 0.1, f"the old update followed {followed:.1%}; the test cannot fail"


def test_fp32_teacher_has_no_separate_copy_and_frozen_does_not_move():
    module = torch.nn.Linear(4, 1, bias=False)
    w0 = module.weight.detach().clone()
    ema = EmaTeacher(module, "ema", 0.5)
    assert ema.master is None
    ema.update([torch.ones(1, 4)])
    assert torch.allclose(module.weight, 0.5 * w0 + 0.5)
    frozen = EmaTeacher(torch.nn.Linear(4, 1, bias=False), "frozen", 0.5)
    before = frozen.module.weight.detach().clone()
    frozen.update([torch.ones(1, 4)])
    assert torch.equal(frozen.module.weight, before)
