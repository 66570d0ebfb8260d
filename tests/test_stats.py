"""The gate's statistics (pure), against tables and hand-worked numbers."""

from __future__ import annotations

import math

import pytest
from clawbridge.learning.stats import betainc, early, paired_worse, price, t_sf


def test_the_t_tail_matches_the_tables():
    assert t_sf(2.262, 9) == pytest.approx(0.025, abs=5e-4)
    assert t_sf(1.96, 10_000) == pytest.approx(0.025, abs=5e-4)
    assert t_sf(0.0, 5) == pytest.approx(0.5)
    assert t_sf(-1.833, 9) == pytest.approx(0.95, abs=5e-4)


def test_paired_worse_by_hand():
    # d = [-1, -1, 0, -1]: mean -0.75, sd 0.5, t = -3.0 with 3 df -> P(T < -3) = 0.0288
    g = paired_worse([0, 0, 1, 0], [1, 1, 1, 1])
    assert (g.candidate, g.reference, g.delta) == (0.25, 1.0, -0.75)
    assert g.p_worse == pytest.approx(0.0288, abs=5e-4)
    # non-inferiority at margin 0.05: t = (-0.75 + 0.05) / (0.5 / 2) = -2.8 -> P(T > -2.8) = 0.966
    assert g.p_inferior == pytest.approx(0.966, abs=5e-4)
    same = paired_worse([1, 0, 1], [1, 0, 1])
    assert same.delta == 0 and same.p_worse == 1.0  # no difference is no evidence of harm
    assert same.p_inferior == 0.0  # ... and, without spread, proof of being within the margin
    # one gained, two lost of ten: no evidence of harm, and none of safety either
    mixed = paired_worse([1, 1, 0, 1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 1, 1, 1, 0], margin=0.05)
    assert mixed.p_worse == pytest.approx(0.5) and mixed.p_inferior > 0.3
    assert paired_worse([0, 0], [1, 1]).p_worse == 0.0  # worse on every probe
    with pytest.raises(ValueError):
        paired_worse([1.0], [1.0, 0.0])


def test_the_t_tail_in_closed_form():
    # one degree of freedom is Cauchy: P(T > 1) = 1/2 - atan(1)/pi = 1/4
    assert t_sf(1.0, 1) == pytest.approx(0.25, abs=1e-12)
    # two: P(T > t) = 1/2 - t / (2 sqrt(t^2 + 2)); t = 2 -> 1/2 - 1/sqrt(6) = 0.0917517
    assert t_sf(2.0, 2) == pytest.approx(0.5 - 1 / math.sqrt(6), abs=1e-12)
    assert t_sf(math.inf, 3) == 0.0 and t_sf(-math.inf, 3) == 1.0


def test_the_incomplete_beta_by_hand():
    assert betainc(1.0, 1.0, 0.3) == pytest.approx(0.3, abs=1e-12)  # uniform: I_x(1, 1) = x
    assert betainc(2.0, 1.0, 0.5) == pytest.approx(0.25, abs=1e-12)  # I_x(a, 1) = x^a
    assert betainc(3.0, 3.0, 0.5) == pytest.approx(0.5, abs=1e-12)  # symmetric
    assert betainc(2.0, 3.0, 0.0) == 0.0 and betainc(2.0, 3.0, 1.0) == 1.0


def test_an_early_look_needs_the_obrien_fleming_significance():
    # a third of the probes: z = 1.2816 / sqrt(1/3) = 2.2197 -> p = 0.0132
    assert early(0.1, 1 / 3) == pytest.approx(0.0132, abs=5e-4)
    # half: z = 1.6449 / sqrt(1/2) = 2.3262 -> p = 0.0100
    assert early(0.05, 0.5) == pytest.approx(0.0100, abs=5e-4)
    assert early(0.1, 1.0) == 0.1 and early(0.1, 2.0) == 0.1


def test_the_price_is_plain_minus_prompted():
    assert price([1, 1, 0, 1], [1, 0, 0, 1]) == 0.25
    assert price([0.5, 0.5], [1.0, 1.0]) == -0.5  # asking helped
    with pytest.raises(ValueError):
        price([1.0], [])
