"""The user's preferences (pure): hints that say the same thing are one preference, a hint that
negates a wish never counts for the wish, and what stands is asked in a canonical wording and order."""

from __future__ import annotations

import pytest
from clawbridge.learning import preferences as prefs


def test_hints_that_say_the_same_thing_count_as_one_preference():
    known = prefs.merge([], [("Too long. Please answer in one short sentence, under 20 words.", "a"),
                             ("too long. please answer in one short sentence, under 20 words!", "b"),
                             ("Use a bulleted list.", "c")], version=1)
    assert [(p.text, p.count, p.turns) for p in known] == [
        ("Too long. Please answer in one short sentence, under 20 words.", 2, ("a", "b")),
        ("Use a bulleted list.", 1, ("c",))]
    more = prefs.merge(known, [(f"Say it in French {i}.", str(i)) for i in range(3)] + [("Use a bulleted list.", "d")], 2)
    # four of the five words of "say it in french 0" are in "... 1": the same wish, counted once
    assert [p.count for p in more] == [2, 2, 3]
    # each heard at least twice and about the form of an answer: applied, asked in a canonical (sorted) order
    assert [p.state for p in more] == ["applied"] * 3
    assert prefs.served_instruction(more) == (
        "Say it in French 0.\nToo long. Please answer in one short sentence, under 20 words.\nUse a bulleted list.")
    assert prefs.instruction([]) is None
    assert prefs.merge([], [("   ", "x")], 1) == []


def test_a_preference_leaves_out_what_was_about_one_turn_and_keeps_its_shortest_wording():
    """The rules judge's hint is the user's whole reply: a correction, and sometimes an objection
    that quotes the question. The quote is about that turn; the correction and the correction
    followed by an objection are one standing wish, worded the short way."""
    q = "Why is the sky blue?"
    both = f"Too long. Please answer in one short sentence, under 20 words. That's not an answer to my question. I asked: {q}"
    assert prefs.unquoted(both, q) == ("Too long. Please answer in one short sentence, under 20 words. "
                                      "That's not an answer to my question.")
    assert prefs.unquoted("Please answer what I asked: why is the sky blue", q) == ""
    assert prefs.unquoted("Shorter, please.", None) == "Shorter, please."
    known = prefs.merge([], [(prefs.unquoted(both, q), "a"),
                             ("Too long. Please answer in one short sentence, under 20 words.", "b"),
                             (prefs.unquoted("That's not an answer to my question. I asked: What is rain?",
                                            "What is rain?"), "c")], 1)
    assert [(p.text, p.count) for p in known] == [
        ("Too long. Please answer in one short sentence, under 20 words.", 2),
        ("That's not an answer to my question.", 1)]

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


@pytest.mark.parametrize(("a", "b"), [
    ("Too long. Please answer in one short sentence, under 20 words.",
     "That's too long for me. Just one short sentence of at most 20 words, please."),
    ("Use bullet points.", "Please answer with a numbered list."),
    ("Do not use bullet points.", "No lists, please."),
    ("Answer in French.", "Please reply in French."),
])
def test_the_same_wish_about_form_in_other_words_is_one_preference(a: str, b: str) -> None:
    """Two wordings of one wish about the form of an answer (the same stances, the same numbers)
    are one preference, served as one instruction: served twice, the model was asked twice as
    hard, and the gate's twin with it."""
    assert prefs.same(a, b) and prefs.same(b, a)
    known = prefs.merge([], [(a, "t1"), (b, "t2")], 1)
    assert [(p.count, p.state) for p in known] == [(2, "applied")]
    assert prefs.served_instruction(known) == min(a, b, key=len)


@pytest.mark.parametrize(("a", "b"), [
    ("Keep answers under 20 words.", "One sentence of at most 50 words, please."),  # other numbers
    ("Too long. Please answer in one short sentence, under 20 words.", "Shorter, please."),
    ("Keep it short.", "Brief answers in a bulleted list, please."),  # one more stance
    ("Answer in French.", "Answer in German."),
    ("Keep it short.", "Give me longer answers."),
])
def test_other_wishes_about_form_stay_apart(a: str, b: str) -> None:
    assert not prefs.same(a, b) and not prefs.same(b, a)
