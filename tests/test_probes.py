"""Whether an answer answers the question (the offline check behind "truly satisfied"), the
general probe set, and the simulated user's replies built on them."""

from __future__ import annotations

from clawbridge.demo import scenario
from clawbridge.judges.rules import classify
from clawbridge.learning.probes import AnswerKey, general_probes, is_echo, own_words


def test_echoes_and_dodges_do_not_answer_a_question():
    check = scenario.load("concise").answer_key("What is an earthquake?")
    assert not check.answered("It seems I'm having a misunderstanding.")
    assert not check.answered("What is an earthquake?")
    assert not check.answered("An earthquake is an earthquake.")
    assert check.answered("A sudden shaking of the ground caused by moving tectonic plates.")
    fish = scenario.load("concise").answer_key("How do fish breathe underwater?")
    assert not fish.answered("How do fish breathe underwater?")
    assert fish.answered("Fish use gills to take oxygen from the water.")


def test_a_keyword_matches_the_start_of_a_word_only():
    check = AnswerKey("Why is the sea wet?", ("evaporat", "7"), min_words=2)
    assert check.answered("Because water evaporates slowly.")
    assert not check.answered("Because of the vaporous air.")
    assert check.answered("About 7 days.") and not check.answered("About 17 days.")
    assert not check.answered("About 70 days.")  # a number is matched whole


def test_keywords_never_repeat_the_question_and_every_builtin_prompt_has_some():
    for name in scenario.builtin_names():
        sc = scenario.load(name)
        for prompt in [*sc.train_prompts, *sc.heldout_prompts]:
            key = sc.answer_key(prompt)
            assert key.keywords, f"{name}: no reference keywords for {prompt!r}"
            assert not own_words(prompt, key.keywords), (prompt, own_words(prompt, key.keywords))
    for p in general_probes():
        assert not own_words(p.question, p.key.keywords), p.question


def test_the_general_probe_set_is_two_hundred_questions_shared_by_no_scenario():
    probes = general_probes()
    assert len(probes) == 200 and len({p.question for p in probes}) == len(probes)
    for name in scenario.builtin_names():
        sc = scenario.load(name)
        assert not {p.question for p in probes} & {*sc.train_prompts, *sc.heldout_prompts}


def test_a_one_word_right_answer_answers_a_probe_and_a_dodge_does_not():
    probe = next(p for p in general_probes() if p.question == "Who wrote Romeo and Juliet?")
    assert probe.key.answered("Shakespeare.")
    assert not probe.key.answered("Romeo.") and not probe.key.answered("A good question.")


def test_an_echo_is_recognised_whatever_its_case_and_punctuation():
    assert is_echo("How do fish breathe underwater?", "how do FISH breathe underwater")
    assert not is_echo("How do fish breathe underwater?", "With gills.")


def test_the_user_thanks_only_an_answer_that_is_both_preferred_and_answered():
    sc = scenario.load("concise")
    p = "What is a noun?"
    thanks = sc.reply(True, 0, answered=True, prompt=p)
    objection = sc.reply(True, 0, answered=False, prompt=p)
    both = sc.reply(False, 0, answered=False, prompt=p)
    assert classify(thanks).reward == 1
    assert classify(objection).reward == -1 and p in objection
    v = classify(both)
    assert v.reward == -1 and v.hint is not None and "doesn't answer" in v.hint and "short" in v.hint


def test_the_validation_split_is_neither_trained_on_nor_held_out():
    sc = scenario.load("concise")
    assert len(sc.gate_prompts) >= 2
    assert not set(sc.gate_prompts) & set(sc.training_prompts)
    assert not set(sc.gate_prompts) & set(sc.heldout_prompts)
