"""The RL math with the worked numbers of the design (docs/design.md#methods), computed by hand."""

from __future__ import annotations

import pytest
from clawbridge.judges.votes import majority
from clawbridge.learning.advantages import (
    anchored,
    binary_advantages,
    combine_advantages,
    group_normalise,
    integrated_reward,
    opd_advantages,
    overlong_penalty,
    sample_advantages,
    scale_negatives,
)
from clawbridge.loss import objective
from clawbridge.types import LossSpec


def rounded(xs: tuple[float, ...], n: int = 2) -> list[float]:
    return [round(x, n) for x in xs]


def test_binary_broadcasts_the_reward_to_every_token() -> None:
    assert binary_advantages(-1, 3) == (-1.0, -1.0, -1.0)
    assert binary_advantages(1, 0) == ()


def test_opd_gap_teacher_minus_student_is_unclipped_without_clip() -> None:
    assert rounded(opd_advantages([-0.5], [-2.3], clip=None)) == [1.8]


def test_opd_gap_is_clipped_to_one_by_default() -> None:
    assert opd_advantages([-0.5], [-2.3]) == (1.0,)
    assert rounded(opd_advantages([-0.5, -3.0, -1.0], [-2.3, -0.2, -1.4])) == [1.0, -1.0, 0.4]


def test_opd_refuses_logprobs_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="teacher has 1 logprobs"):
        opd_advantages([-0.5], [-2.3, -1.0])


def test_combine_adds_weighted_reward_to_the_clipped_gap() -> None:
    adv = combine_advantages([-0.5, -1.0], [-2.3, -1.4], reward=-1, w_opd=1, w_rl=1)
    assert rounded(adv) == [0.0, -0.6]
    adv = combine_advantages([-0.5], [-2.3], reward=1, w_opd=0.5, w_rl=2.0, clip=None)
    assert rounded(adv) == [2.9]  # 0.5 * 1.8 + 2 * 1


def test_combine_without_teacher_is_the_reward_alone() -> None:
    assert combine_advantages(None, [-1.0, -2.0], reward=1, w_rl=0.5) == (0.5, 0.5)


def test_group_normalise_uses_population_std() -> None:
    # mean 0.25, population std 0.829 (the sample std 0.957 would give 0.78 for the ones)
    assert rounded(group_normalise([1, -1, 1, 0])) == [0.90, -1.51, 0.90, -0.30]


def test_group_normalise_of_equal_rewards_is_zero_not_nan() -> None:
    assert group_normalise([1, 1, 1]) == (0.0, 0.0, 0.0)
    assert group_normalise([]) == ()


@pytest.mark.parametrize(("length", "penalty"), [(700, 0.0), (800, 0.0), (900, -0.5), (1000, -1.0), (1100, -1.0)])
def test_overlong_penalty_ramps_down_inside_the_cache_window(length: int, penalty: float) -> None:
    assert overlong_penalty(length, max_len=1000, cache_len=200) == pytest.approx(penalty)


def test_integrated_reward_adds_the_mean_step_vote() -> None:
    assert round(integrated_reward(1, [1, 1, -1]), 2) == 1.33
    assert integrated_reward(-1, []) == -1.0
    assert integrated_reward(0, [1, 1], lam=0.5) == 0.5


def test_ppo_objective_is_clipped_at_one_plus_eps_high() -> None:
    # rho 1.4 > 1.28: the clipped branch 1.28 * 0.90 = 1.152 is the smaller one
    assert round(objective(1.4, 0.90, LossSpec(clip_low=0.2, clip_high=0.28)), 2) == 1.15
    # a negative advantage takes the unclipped (more pessimistic) branch
    assert objective(1.4, -1.0) == pytest.approx(-1.4)


def test_majority_wins_and_counts_votes() -> None:
    count = majority([1, 1, -1])
    assert (count.reward, count.plus, count.minus, count.zero, count.failed) == (1, 2, 1, 0, 0)
    assert majority([-1, 0, -1]).reward == -1


def test_a_tie_between_votes_gives_zero_reward() -> None:
    assert majority([1, -1]).reward == 0
    assert majority([1, -1, 0]).reward == 0
    assert majority([1, 1, -1, -1, None]).reward == 0


def test_failed_votes_are_counted_and_never_vote() -> None:
    count = majority([None, None, -1])
    assert (count.reward, count.failed, count.valid) == (-1, 2, 1)
    all_failed = majority([None, None, None])
    assert (all_failed.reward, all_failed.failed) == (0, 3)
    assert majority([]).reward == 0


def test_majority_rejects_values_outside_minus_one_to_one() -> None:
    with pytest.raises(ValueError):
        majority([2])


STUDENT = [-2.3, -1.4]
TEACHER = [-0.5, -1.0]


def test_binary_yields_a_sample_only_for_a_nonzero_reward() -> None:
    assert sample_advantages("binary", 1, False, None, STUDENT) == (1.0, 1.0)
    assert sample_advantages("binary", 0, True, TEACHER, STUDENT) is None


def test_opd_yields_a_sample_only_when_a_hint_was_accepted() -> None:
    assert rounded(sample_advantages("opd", 0, True, TEACHER, STUDENT) or ()) == [1.0, 0.4]
    assert sample_advantages("opd", -1, False, None, STUDENT) is None


def test_combine_yields_a_sample_for_a_hint_or_a_reward() -> None:
    assert rounded(sample_advantages("combine", -1, True, TEACHER, STUDENT) or ()) == [0.0, -0.6]
    assert sample_advantages("combine", -1, False, None, STUDENT) == (-1.0, -1.0)
    assert rounded(sample_advantages("combine", 0, True, TEACHER, STUDENT) or ()) == [1.0, 0.4]
    assert sample_advantages("combine", 0, False, None, STUDENT) is None


def test_combine_ignores_teacher_logprobs_when_no_hint_was_accepted() -> None:
    assert sample_advantages("combine", 1, False, TEACHER, STUDENT) == (1.0, 1.0)


def test_a_sample_with_all_zero_advantages_is_not_a_sample() -> None:
    assert sample_advantages("opd", 0, True, STUDENT, STUDENT) is None


def test_an_accepted_hint_without_teacher_logprobs_is_an_error() -> None:
    with pytest.raises(ValueError, match="teacher"):
        sample_advantages("opd", 0, True, None, STUDENT)


def test_sample_weights_and_clip_reach_the_advantages() -> None:
    adv = sample_advantages("combine", 1, True, [-0.5], [-2.3], w_opd=2.0, w_rl=0.5, clip=None)
    assert rounded(adv or ()) == [4.1]


def test_scale_negatives_keeps_the_gains_and_scales_the_push_down():
    assert scale_negatives([0.5, -1.0, 2.0], 0.25) == (0.5, -0.25, 2.0)
    assert scale_negatives([0.5, -1.0, 2.0], 0.0) == (0.5, 0.0, 2.0)
    assert scale_negatives([-1.0, -2.0], 1.0) == (-1.0, -2.0)
    with pytest.raises(ValueError):
        scale_negatives([1.0], -0.5)


def test_the_anchor_pulls_each_token_back_by_how_far_it_moved_from_the_base():
    # old - base = [0.5, -1.0, 0.0]; coef 0.1 -> A - [0.05, -0.1, 0]
    out = anchored([1.0, 1.0, -1.0], [-0.5, -2.0, -1.0], [-1.0, -1.0, -1.0], 0.1)
    assert out == pytest.approx((0.95, 1.1, -1.0))
    assert anchored([1.0], [-3.0], [-1.0], 0.0) == (1.0,)
    with pytest.raises(ValueError):
        anchored([1.0, 1.0], [-1.0], [-1.0], 0.1)
