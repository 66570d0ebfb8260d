"""A hint that negates a wish never counts for the wish (learning.preferences.same)."""

from __future__ import annotations

import pytest
from clawbridge.learning import preferences as prefs

OPPOSITES = [
    ("Use bullet points.", "Do not use bullet points."),
    ("Use bullet points.", "Don't use bullet points."),
    ("Use bullet points.", "Don\u2019t use bullet points."),
    ("Use bullet points.", "Never use bullet points."),
    ("Use bullet points.", "No bullet points."),
    ("Use bullet points.", "Avoid bullet points."),
    ("Use bullet points.", "Stop using bullet points."),
    ("Answer with bullet points.", "Answer without bullet points."),
    ("Use bullet points in the answer.", "The answer doesn't use bullet points."),
    ("Give an example.", "Please do not give an example."),
]


@pytest.mark.parametrize(("wish", "negated"), OPPOSITES)
def test_a_negation_never_merges_with_its_opposite(wish: str, negated: str) -> None:
    assert not prefs.same(wish, negated) and not prefs.same(negated, wish)
    known = prefs.merge([], [(wish, "a"), (negated, "b")], 1)
    assert [(p.text, p.count) for p in known] == [(wish, 1), (negated, 1)]


@pytest.mark.parametrize(("a", "b"), [
    ("Do not use bullet points.", "Please do not use bullet points."),
    ("Don't use bullet points.", "Do not use bullet points."),  # one negation, two wordings
    ("Never use bullet points.", "Please never use bullet points!"),
    ("Too long. Please answer in one short sentence.",
     "Too long. Please answer in one short sentence. That's not an answer to my question."),
    ("Answer in one sentence.", "No, answer in one sentence."),  # "No," is an interjection
    ("Answer in one sentence.", "Answer in one sentence, not three."),
])
def test_the_same_wish_still_merges(a: str, b: str) -> None:
    assert prefs.same(a, b) and prefs.same(b, a)


def test_a_second_negation_undoes_the_first() -> None:
    assert prefs.senses("Don't stop using lists.") == prefs.senses("Using lists.")
    assert prefs.same("Don't stop using bullet points.", "Keep using bullet points.")


def test_hints_without_words_are_the_same_only_when_equal() -> None:
    assert prefs.same("No.", " no. ") and not prefs.same("No.", "Never.")
