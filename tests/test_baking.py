"""Baking an applied preference into the weights (bridge/learning/baking.py, docs/methods.md#the-weights-later)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from clawbridge.learning.baking import MIN_LIFT, carried, retired, verdict
from clawbridge.store import Preference


def test_the_share_is_how_far_the_weights_came_from_the_base_to_the_twin():
    # two answers, 2 + 1 tokens: the twin likes them 0.3 nats a token more than the base does
    base_without = [[-1.0, -2.0], [-0.5]]
    base_with = [[-0.7, -1.7], [-0.2]]
    c = carried(base_with, base_without, base_without)  # the base itself: nothing carried
    assert c.lift == pytest.approx(0.3) and c.carried == pytest.approx(0.0) and c.share == pytest.approx(0.0)
    c = carried(base_with, base_without, base_with)  # weights that answer alone as the twin asked does
    assert c.share == pytest.approx(1.0) and (c.tokens, c.turns) == (3, 2)
    half = [[-0.85, -1.85], [-0.35]]
    assert carried(base_with, base_without, half).share == pytest.approx(0.5)
    # share = 1 - KL(twin || version) / KL(twin || base), token-averaged on the twin's answers
    kl_twin_base = sum(sum(a) - sum(b) for a, b in zip(base_with, base_without, strict=True)) / 3
    kl_twin_half = sum(sum(a) - sum(b) for a, b in zip(base_with, half, strict=True)) / 3
    assert carried(base_with, base_without, half).share == pytest.approx(1 - kl_twin_half / kl_twin_base)


def test_an_instruction_that_hardly_moves_its_answers_is_not_measured():
    tiny = MIN_LIFT / 2
    c = carried([[-1.0 + tiny]], [[-1.0]], [[0.0]])
    assert c.share is None
    assert verdict(None, learned=False, retire_share=0.8, restore_share=0.5) is False
    assert verdict(None, learned=True, retire_share=0.8, restore_share=0.5) is True
    assert carried([], [], []).share is None


def test_mismatched_scores_are_refused():
    with pytest.raises(ValueError):
        carried([[-1.0, -1.0]], [[-1.0]], [[-1.0]])


def test_retired_at_the_retire_share_and_back_only_below_the_restore_share():
    assert verdict(0.79, learned=False, retire_share=0.8, restore_share=0.5) is False
    assert verdict(0.8, learned=False, retire_share=0.8, restore_share=0.5) is True
    # between the two a learned preference stays learned and an applied one stays applied: no flapping
    assert verdict(0.6, learned=True, retire_share=0.8, restore_share=0.5) is True
    assert verdict(0.6, learned=False, retire_share=0.8, restore_share=0.5) is False
    assert verdict(0.49, learned=True, retire_share=0.8, restore_share=0.5) is False


def test_retired_changes_only_what_was_measured_and_leaves_a_dropped_one_alone():
    now = datetime(2026, 11, 28, tzinfo=UTC)
    known = [
        Preference("Answer in one sentence.", 3, ("a", "b", "c"), 0, id=1, state="applied", kind="length"),
        Preference("Use bullet points.", 2, ("d", "e"), 0, id=2, state="learned", kind="format", learned_version=3),
        Preference("Reply in French.", 2, ("f", "g"), 0, id=3, state="dropped", kind="language"),
    ]
    out = retired(known, {1: True, 2: False, 3: True}, 5, now)
    assert (out[0].state, out[0].learned_version, out[0].state_at) == ("learned", 5, now)
    assert (out[1].state, out[1].learned_version) == ("applied", None)
    assert out[2] == known[2]  # the user dropped it meanwhile: a measurement never brings it back
