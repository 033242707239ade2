"""Hand-worked routing and advantage cases (method §1.3, §2)."""

from __future__ import annotations

import torch

from srpo_megatron.losses import group_advantages, route, routing_masks

T, F = True, False


def test_all_correct_group_goes_to_grpo_with_teachers_available():
    r = route(torch.tensor([[1.0, 1.0, 1.0]]))
    assert r.correct.tolist() == [[T, T, T]]
    assert r.has_teacher.tolist() == [[T, T, T]]
    assert r.to_sdpo.tolist() == [[F, F, F]]
    assert r.sibling.tolist() == [[1, 0, 0]]


def test_all_wrong_group_falls_back_to_grpo():
    r = route(torch.tensor([[0.0, 0.0, 0.0, 0.0]]))
    assert r.has_teacher.tolist() == [[F, F, F, F]]
    assert r.to_sdpo.tolist() == [[F, F, F, F]]
    assert r.sibling.tolist() == [[-1, -1, -1, -1]]
    assert group_advantages(torch.tensor([[0.0, 0.0, 0.0, 0.0]])).tolist() == [[0.0] * 4]


def test_single_correct_sample_gets_no_teacher_but_its_siblings_do():
    r = route(torch.tensor([[0.0, 1.0, 0.0]]))
    assert r.correct.tolist() == [[F, T, F]]
    assert r.has_teacher.tolist() == [[T, F, T]]  # the only correct one has no *other* correct sample
    assert r.to_sdpo.tolist() == [[T, F, T]]
    assert r.sibling.tolist() == [[1, -1, 1]]


def test_mixed_groups_threshold_and_first_sibling():
    rewards = torch.tensor([[0.2, 0.5, 0.9, 0.49], [1.0, 0.0, 1.0, 0.0]])
    r = route(rewards, success_threshold=0.5)
    assert r.correct.tolist() == [[F, T, T, F], [T, F, T, F]]
    assert r.to_sdpo.tolist() == [[T, F, F, T], [F, T, F, T]]
    assert r.sibling.tolist() == [[1, 2, 1, 1], [2, 0, 0, 0]]
    # A higher threshold changes who is correct: only 0.9 and the 1.0s remain.
    r2 = route(rewards, success_threshold=0.8)
    assert r2.to_sdpo.tolist() == [[T, T, F, T], [F, T, F, T]]
    assert r2.sibling.tolist() == [[2, 2, -1, 2], [2, 0, 0, 0]]


def test_group_advantages_mean_centred_and_std_option():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert group_advantages(rewards).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25]]
    # Unbiased std of (1, 0, 0, 1) is sqrt(1/3); of (1, 0, 0, 0) is 0.5.
    a = group_advantages(rewards, std_normalize=True, eps=0.0)
    expect = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]])
    expect[0] /= (1 / 3) ** 0.5
    assert torch.allclose(a, expect, atol=1e-6)


def test_routing_masks_per_mode():
    r = route(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    grpo, sdpo, teacher = routing_masks(r, "srpo")
    assert sdpo.tolist() == [[F, T, F], [T, F, T], [F, F, F]]
    assert grpo.tolist() == [[T, F, T], [F, T, F], [T, T, T]]
    assert teacher.tolist() == sdpo.tolist()
    grpo, sdpo, teacher = routing_masks(r, "sdpo")  # every sample with a correct sibling, correct or not
    assert sdpo.tolist() == [[T, T, T], [T, F, T], [F, F, F]] and not bool(grpo.any())
    grpo, sdpo, teacher = routing_masks(r, "grpo")
    assert bool(grpo.all()) and not bool(sdpo.any()) and not bool(teacher.any())
    grpo, sdpo, teacher = routing_masks(r, "advantage_mix")
    assert bool(grpo.all()) and not bool(sdpo.any()) and teacher.tolist() == r.has_teacher.tolist()


def test_fig1b_modes_split_pure_sdpo_into_wrong_and_correct_samples():
    # Group 0: two correct (0, 2) -> both have a teacher (each other); wrong 1 has teacher 0.
    # Group 1: one correct (1) -> it has no other correct sibling; wrong 0 and 2 have teacher 1.
    # Group 2: all wrong -> nobody has a teacher. Group 3: all correct -> every sample has a teacher.
    r = route(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    grpo, sdpo, teacher = routing_masks(r, "sdpo_incorrect_only")
    assert sdpo.tolist() == [[F, T, F], [T, F, T], [F, F, F], [F, F, F]]
    assert teacher.tolist() == sdpo.tolist() and not bool(grpo.any())  # no GRPO fallback
    grpo, sdpo, teacher = routing_masks(r, "sdpo_correct_only")
    assert sdpo.tolist() == [[T, F, T], [F, F, F], [F, F, F], [T, T, T]]
    assert teacher.tolist() == sdpo.tolist() and not bool(grpo.any())
    # The correct samples' teacher context is another correct sibling, never the sample itself.
    assert r.sibling.tolist()[0] == [2, 0, 0] and r.sibling.tolist()[3] == [1, 0, 0]
    sib, rows = r.sibling[sdpo], sdpo.nonzero()
    assert bool((sib != rows[:, 1]).all()) and bool(r.correct[rows[:, 0], sib].all())
    # Together the two restrictions are exactly pure SDPO, and they never overlap.
    inc = routing_masks(r, "sdpo_incorrect_only")[1]
    cor = routing_masks(r, "sdpo_correct_only")[1]
    assert not bool((inc & cor).any()) and (inc | cor).tolist() == routing_masks(r, "sdpo")[1].tolist()


def test_unknown_mode_names_the_choices():
    import pytest

    with pytest.raises(ValueError, match="sdpo_correct_only"):
        routing_masks(route(torch.tensor([[1.0, 0.0]])), "sdpo_only_correct")
