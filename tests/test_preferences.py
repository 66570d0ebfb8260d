"""The user's preferences (pure): hints that say the same thing are one preference, and what
stands is asked in a canonical wording and order."""

from __future__ import annotations

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
    # the two most frequent (a tie goes to the first seen), asked in a canonical (sorted) order
    assert [p.text for p in prefs.standing(more, keep=2)] == [
        "Too long. Please answer in one short sentence, under 20 words.", "Say it in French 0."]
    assert prefs.instruction(prefs.standing(more, keep=2)) == (
        "Say it in French 0.\nToo long. Please answer in one short sentence, under 20 words.")
    assert prefs.from_json(prefs.to_json(more)) == more
    assert prefs.instruction([]) is None
    assert prefs.merge([], [("   ", "x")], 1) == []


def test_a_preference_leaves_out_what_was_about_one_turn_and_keeps_its_shortest_wording():
    """The rules judge's hint is the user's whole reply: a correction, and sometimes an objection
    that quotes the question. The quote is about that turn; the correction and the correction
    followed by an objection are one standing wish, worded the short way."""
    q = "Why is the sky blue?"
    both = f"Too long. Please answer in one short sentence, under 20 words. That's not an answer to my question. I asked: {q}"
    assert prefs.general(both, q) == ("Too long. Please answer in one short sentence, under 20 words. "
                                      "That's not an answer to my question.")
    assert prefs.general("Please answer what I asked: why is the sky blue", q) == ""
    assert prefs.general("Shorter, please.", None) == "Shorter, please."
    known = prefs.merge([], [(prefs.general(both, q), "a"),
                             ("Too long. Please answer in one short sentence, under 20 words.", "b"),
                             (prefs.general("That's not an answer to my question. I asked: What is rain?",
                                            "What is rain?"), "c")], 1)
    assert [(p.text, p.count) for p in known] == [
        ("Too long. Please answer in one short sentence, under 20 words.", 2),
        ("That's not an answer to my question.", 1)]
