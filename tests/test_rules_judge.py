"""The offline rules judge on a varied written set of thanks, corrections and neutral replies
(tests/rules_replies.py): it must read ordinary corrections, including requests about how to
answer ("Please always end your answer with 'Hope this helps!'"), as corrections with the
user's words as the hint."""

from __future__ import annotations

import pytest
from clawbridge.judges.rules import classify
from rules_replies import (
    CORRECTIONS,
    HELDOUT_CORRECTIONS,
    HELDOUT_NEUTRAL,
    HELDOUT_THANKS,
    NEUTRAL,
    THANKS,
)

SETS = [(THANKS + HELDOUT_THANKS, 1), (CORRECTIONS + HELDOUT_CORRECTIONS, -1), (NEUTRAL + HELDOUT_NEUTRAL, 0)]


def test_accuracy_on_the_written_set_is_at_least_95_percent():
    wrong = [(text, want, classify(text).reward) for texts, want in SETS for text in texts
             if classify(text).reward != want]
    total = sum(len(texts) for texts, _ in SETS)
    assert total >= 120
    assert 1 - len(wrong) / total >= 0.95, wrong


@pytest.mark.parametrize("text", [
    "Please always end your answer with 'Hope this helps!'",
    "Always sign off with 'Cheers, Sam'.",  # "cheers" inside an instruction is not thanks
    "That doesn't answer my question. Please answer what I asked: What is a noun?",
])
def test_an_instruction_is_a_correction_and_its_words_are_the_hint(text: str):
    v = classify(text)
    assert v.reward == -1 and v.hint == text


def test_a_new_question_is_not_feedback():
    assert classify("Can you tell me about the moon?").reward == 0
    assert classify("Is that correct?").reward == 0
