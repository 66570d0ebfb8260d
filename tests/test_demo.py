"""The demo: scenarios as data, the paired interval, and a fast end-to-end smoke run on the tiny
random model (real server, openai client, rules judge, trainer). The real learning run on the
embedded model is `make demo`, and the `slow` test below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clawbridge.demo import scenario
from clawbridge.demo.recipe import DEMO_RECIPE
from clawbridge.demo.runner import demo_settings, result_table, run_demo
from clawbridge.local_gpu import precision

TINY = {
    "name": "tiny",
    "description": "plumbing only",
    "check": {"max_words": 3, "must_finish": False},
    "replies": {"satisfied": ["Thanks, perfect."], "unsatisfied": ["Too long. Please answer in under 3 words."]},
    "recipe": {"method": "combine", "batch_size": 2, "rounds": 2, "learning_rate": 1e-3, "lora_rank": 4,
               "temperature": 1.0, "max_tokens": 4, "eval_samples": 2, "concurrency": 4, "gate_probes": 4,
               "gate_probes_max": 20,
               # the tiny random model's 4-token draws answer nothing, so no rewrite passes the relevance
               # floor: its corrections train by being pushed down (the default, 0, would train nothing)
               "w_negative": 1.0},
    "train_prompts": ["What is rain?", "Why is the sky blue?", "What is a cat?"],
    "heldout_prompts": ["What is snow?", "What is a dog?", "What is fog?"],
}


def test_builtin_scenarios_load_and_hold_disjoint_prompts():
    assert {"concise", "one_sentence"} <= set(scenario.builtin_names())
    for name in scenario.builtin_names():
        sc = scenario.load(name)
        assert not set(sc.train_prompts) & set(sc.heldout_prompts)
        assert len(sc.heldout_prompts) >= 10 and sc.replies.satisfied and sc.replies.unsatisfied


def test_the_rules_judge_reads_the_scenario_replies_as_intended():
    from clawbridge.judges.rules import classify

    for name in scenario.builtin_names():
        sc = scenario.load(name)
        for text in sc.replies.satisfied:
            assert classify(text).reward == 1, text
        for text in sc.replies.unsatisfied:
            v = classify(text)
            assert v.reward == -1 and v.hint == text, text


def test_the_check_applies_every_condition():
    check = scenario.HiddenPreference(max_words=5, must_match=[r"^- "], must_not_match=["sorry"])
    assert check.satisfied("- one two", "stop")
    assert not check.satisfied("- one two", "length")  # cut at max_tokens
    assert not check.satisfied("- one two three four five six", "stop")
    assert not check.satisfied("one two", "stop")
    assert not check.satisfied("- sorry", "stop")


def test_a_scenario_file_with_overlapping_prompts_is_refused(tmp_path: Path):
    bad = dict(TINY, heldout_prompts=["What is rain?", "What is fog?"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="must not be training prompts"):
        scenario.load(path)
    with pytest.raises(FileNotFoundError):
        scenario.load("no-such-scenario")


def test_numbers_in_a_keyword_list_are_keywords(tmp_path: Path):
    """An unquoted `100` in YAML is a number; as an answer keyword it means the text "100"."""
    path = tmp_path / "numbers.yaml"
    path.write_text(
        "name: numbers\ncheck: {max_words: 20}\n"
        "replies: {satisfied: [Thanks.], unsatisfied: [Shorter please.]}\n"
        "train_prompts: ['What is rain?']\nheldout_prompts: ['At what temperature does water boil?', 'What is pi?']\n"
        "answers:\n  keywords:\n    'At what temperature does water boil?': [100, celsius]\n"
        "    'What is pi?': [3.14]\n"
    )
    sc = scenario.load(path)
    assert sc.answers.keywords == {"At what temperature does water boil?": ["100", "celsius"],
                                   "What is pi?": ["3.14"]}
    check = sc.answer_key("At what temperature does water boil?")
    assert check.answered("Water boils at 100 degrees at sea level.")
    assert not check.answered("Water boils when it gets very hot indeed.")


def test_the_teachability_verdict_says_when_there_is_little_to_learn_from():
    from clawbridge.demo.teachability import Teachability

    def verdict(plain: float, asked: float) -> Teachability:
        return Teachability(plain=plain, asked=asked, asked_preferred=asked, asked_answered=1.0, answers=40)

    bullets = verdict(0.02, 0.06)  # what the bullets scenario measured
    assert bullets.little and bullets.verdict() == (
        "teachability: asked for it, the model meets it in 6% of answers (2% unasked): there is little to learn "
        "from; see docs/learning.md")
    concise = verdict(0.0, 0.41)
    assert not concise.little and concise.verdict().startswith(
        "teachability: asked for it, the model meets it in 41% of answers against 0% unasked: hints can teach it")
    already = verdict(0.5, 0.55)  # the model does it anyway: asking adds little
    assert already.little and "asking adds little" in already.verdict()
    assert verdict(0.0, 0.15).little is False  # the threshold itself is enough


def test_the_price_line_names_the_points_and_the_gates_maximum():
    from clawbridge.demo.teachability import Price

    plain, asked = (1.0,) * 31 + (0.0,) * 19, (1.0,) * 25 + (0.0,) * 25  # 62 % and 50 % of 50
    price = Price(plain, asked, "Be brief.")
    assert price.points == pytest.approx(12.0)
    assert price.line() == ("the price: your preference costs 12 points of general answers on this model: "
                            "62% → 50% of 50 probe questions answered when the base model is asked for it")
    assert price.line(0.15) == price.line()  # within gate_max_price: nothing more to say
    assert price.line(0.10).endswith("above gate_max_price (10 points), so the gate holds every candidate back: "
                                     "raise it to accept this price")
    free = Price(asked, plain, "Be brief.")  # asking answers more: no price
    assert free.points < 0 and "costs no general answers" in free.line(0.15)
    assert price.record((0.02, 0.2)) == {"probe_plain": 0.62, "probe_asked": 0.5, "points": 12.0,
                                         "interval": [2.0, 20.0], "probes": 50, "asked": "Be brief."}


def test_the_twin_is_asked_what_the_collector_hears_in_the_scenarios_corrections():
    """The demo's twin and the gate's read one function: the collector hears the hints (the
    rules judge's hint is the whole correction) and applies each wish heard twice, every
    built-in scenario's corrections being about the form of an answer."""
    from clawbridge.demo.teachability import instruction
    from clawbridge.learning import preferences

    for name in scenario.builtin_names():
        sc = scenario.load(name)
        # the simulated user corrects conversation i with unsatisfied[i % n]: the first seen first
        heard = [(sc.reply(False, i, prompt="What is rain?"), f"turn-{i}") for i in range(12)]
        known = preferences.merge([], heard, 1)
        assert all(p.kind == "length" and p.state == "applied" for p in known), (name, known)
        assert instruction(sc) == preferences.wanted_instruction(known) == preferences.served_instruction(known), name
        # each built-in scenario's corrections are one wish in two wordings: one line, in the
        # scenario's own words
        lines = instruction(sc).splitlines()
        assert len(lines) == 1 and set(lines) <= set(sc.replies.unsatisfied), (name, lines)
        # the same preferences first heard in the other order are asked the same way
        backwards = [(sc.reply(False, i, prompt="What is rain?"), f"turn-{i}") for i in reversed(range(12))]
        assert preferences.wanted_instruction(preferences.merge([], backwards, 1)) == instruction(sc)


def test_yes_and_no_in_a_keyword_list_are_words(tmp_path: Path):
    """YAML 1.1 reads an unquoted yes/no as a boolean; a scenario file reads YAML 1.2's booleans
    (only true/false), so the answer key of a yes/no question keeps its words, and a setting
    written `yes` still means true."""
    path = tmp_path / "yesno.yaml"
    path.write_text(
        "name: yesno\ncheck: {must_finish: no, must_match: ['^(Yes|No)']}\n"
        "replies: {satisfied: [Thanks.], unsatisfied: [Start with Yes or No please.]}\n"
        "train_prompts: ['Is rain wet?']\nheldout_prompts: ['Is a tomato a fruit?', 'Can penguins fly?']\n"
        "answers:\n  object: yes\n  keywords:\n    'Is a tomato a fruit?': [yes, seed, true]\n"
        "    'Can penguins fly?': [no, flightless, False]\n"
    )
    sc = scenario.load(path)
    assert sc.answers.keywords == {"Is a tomato a fruit?": ["yes", "seed", "true"],
                                   "Can penguins fly?": ["no", "flightless", "false"]}
    assert sc.check.must_finish is False and sc.answers.object is True
    assert sc.rate("Is a tomato a fruit?", "Yes, botanically it is one.", "stop").truly
    assert not sc.rate("Can penguins fly?", "Yes, they can.", "stop").answered


def test_paired_interval_by_hand():
    mean, lo, hi = scenario.paired_interval([0, 0, 0.5, 0], [1, 0.5, 1, 1])
    # d = [1, .5, .5, 1]: mean .75, sd .2887, t(3) = 3.182 -> half width .4593
    assert mean == pytest.approx(0.75)
    assert (lo, hi) == (pytest.approx(0.2907, abs=1e-4), 1.0)  # clamped at +1
    assert scenario.paired_interval([0.5, 0.5], [0.5, 0.5]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        scenario.paired_interval([0.0], [1.0])


@pytest.mark.timeout(280)
async def test_demo_smoke_on_the_tiny_model_gives_the_summary(tmp_path: Path):
    sc = scenario.Scenario.model_validate(TINY)
    settings = demo_settings(sc, tmp_path / "data", model="tiny-random")
    result = await run_demo(sc, settings, plot_path=tmp_path / "tiny.png")
    summary = json.loads(json.dumps(result.summary()))
    assert {"before", "after", "interval", "steps", "versions", "seconds", "truly_before", "truly_after",
            "truly_interval", "on_topic_before", "on_topic_after", "probe_before", "probe_after", "probe_interval",
            "gate"} <= set(summary)
    plo, phi = summary["probe_interval"]
    assert -1 <= plo <= summary["probe_after"] - summary["probe_before"] <= phi <= 1
    assert 0 <= summary["probe_before"] <= 1 and 0 <= summary["probe_after"] <= 1
    assert [g["version"] for g in summary["gate"]] == [1, 2]  # every step was judged by the gate
    assert all(g["decision"] in ("accepted", "rejected") and g["figures"] for g in summary["gate"])
    assert 0 <= summary["before"] <= 1 and 0 <= summary["after"] <= 1
    lo, hi = summary["interval"]
    assert -1 <= lo <= summary["delta"] <= hi <= 1
    assert summary["steps"] == 2 and summary["versions"][0]["version"] == 0
    # the demo's recipe serves the weights alone: as served is the weights alone
    assert all(v["instruction"] is None and v["served_truly"] == v["truly"] for v in summary["versions"])
    assert ("as served", "the weights alone") in result_table(result)
    assert summary["train_conversations"] >= 4 and Path(summary["plot"]).stat().st_size > 1000
    # v0 asked for the preference: teachability on the held-out prompts, the price on the probe
    teach, price = summary["teachability"], summary["price"]
    assert teach["plain"] == summary["truly_before"] and 0 <= teach["asked"] <= 1
    assert teach["answers"] == 3 * sc.recipe.teach_samples and teach["verdict"].startswith("teachability: ")
    assert price["asked"] == "Too long. Please answer in under 3 words." and price["probes"] == 20
    assert price["probe_plain"] == summary["probe_before"] and price["probe_asked"] == summary["twin_probe"]
    assert price["points"] == pytest.approx(100 * (price["probe_plain"] - price["probe_asked"]), abs=0.02)
    lo, hi = price["interval"]
    assert lo <= price["points"] <= hi
    assert summary["probe_vs_twin"] == pytest.approx(summary["probe_after"] - summary["twin_probe"], abs=1e-4)
    # each gate decision names what the general probe was compared with, and what the twin was asked
    assert all(g["reference"] == "twin" for g in summary["gate"]), summary["gate"]
    # (the trainer's standing preferences: the hints it trained so far, corrections or objections)
    assert all(g["asked"] is None or isinstance(g["asked"], str) for g in summary["gate"]), summary["gate"]
    parts = summary["seconds_by_part"]
    assert {"start", "measure", "conversations", "learning", "gate", "held-out", "probe", "teachability",
            "twin probe"} <= set(parts) and all(v >= 0 for v in parts.values())
    assert parts["held-out"] + parts["probe"] + parts["teachability"] + parts["twin probe"] <= parts["measure"] + 1
    # the arithmetic the timings were taken in: what this CPU resolves the setting to
    assert summary["dtype"] == precision.name(precision.choose(settings.engine.engine_dtype, "cpu", precision.cpu_flags()))


async def test_with_instant_preferences_the_demo_measures_the_weights_alone_and_as_served(tmp_path: Path):
    """A scenario that turns instant preferences on is served as `clawbridge up` serves: the
    careless user's correction (every reply, the check is never met), heard twice in the first
    round, is served at once, and the version is measured again with it, as served beside the
    weights alone; the JSON's two curves are by conversations."""
    never = {**TINY, "check": {"must_match": ["ZZQZZ"]}, "answers": {"object": False},
             "recipe": {**TINY["recipe"], "instant_preferences": True, "rounds": 1}}  # type: ignore[dict-item]
    sc = scenario.Scenario.model_validate(never)
    result = await run_demo(sc, demo_settings(sc, tmp_path / "data", model="tiny-random"))
    summary = result.summary()
    versions = summary["versions"]
    assert versions[0]["instruction"] is None and versions[0]["served_truly"] == versions[0]["truly"]
    assert [v["instruction"] for v in versions[1:]] == ["Too long. Please answer in under 3 words."], versions
    assert [c for c, _ in summary["served_curve"]] == [c for c, _ in summary["weights_curve"]] == [
        v["conversations"] for v in versions]
    assert [t for _, t in summary["served_curve"]] == [v["served_truly"] for v in versions]
    [row] = [value for label, value in result_table(result) if label.startswith("as served")]
    assert row.startswith("0: ") and row != "the weights alone"  # the curve, by conversations


async def test_a_scenario_whose_feedback_trains_nothing_stops_with_the_reason(tmp_path: Path):
    """Nobody is ever satisfied, and with the default w_negative 0 a correction trains only its
    rewrite, which the tiny model never writes well enough: the round plays its batch and three
    more, then stops with what happened and what to change, instead of talking for ever. (With
    instant preferences on, the correction, heard twice, is served as an instruction and every
    turn served under it trains as a distillation datum: this is the case without them.)"""
    from clawbridge.demo.rounds import NothingToTrain

    never = {**TINY, "check": {"must_match": ["ZZQZZ"]},
             "recipe": {**{k: v for k, v in TINY["recipe"].items() if k != "w_negative"},  # type: ignore[attr-defined]
                        "instant_preferences": False}}
    sc = scenario.Scenario.model_validate(never)
    assert "w_negative" not in sc.recipe.settings and DEMO_RECIPE["w_negative"] == 0.0
    settings = demo_settings(sc, tmp_path / "data", model="tiny-random")
    with pytest.raises(NothingToTrain, match=r"gave 0 trainable samples of the 2 a step needs.*w_negative: 1"):
        await run_demo(sc, settings)


def test_a_restored_copy_has_the_weights_it_copies():
    from clawbridge.store import History

    # v0 served; v1 held back -> v2 is v0's weights; v3 held back -> v4 is v2's, so v0's; v5 accepted
    h = History(copies={2: 0, 4: 2})
    assert h.same_weights(4, 0) and h.same_weights(2, 4) and h.same_weights(0, 0)
    assert not h.same_weights(5, 0) and not h.same_weights(1, 0) and not History().same_weights(4, 0)
    assert History(copies={1: 1}).same_weights(1, 1)  # a malformed self-copy ends the walk instead of looping


def test_a_restored_copy_takes_the_figures_of_the_version_it_copies():
    from clawbridge.demo.results import VersionEval
    from clawbridge.demo.runner import reusable
    from clawbridge.store import History

    v0 = VersionEval(0, 0.05, (0.0, 0.1), 2, 55.0, truly=0.05, probe=0.68, probe_per_prompt=(1.0, 0.0))
    copy = reusable(v0, 4, History(copies={2: 0, 4: 2}), conversations=40)
    assert copy is not None and (copy.version, copy.conversations, copy.seconds) == (4, 40, 0.0)
    assert (copy.rate, copy.per_prompt, copy.truly, copy.probe, copy.probe_per_prompt) == (
        v0.rate, v0.per_prompt, v0.truly, v0.probe, v0.probe_per_prompt)
    assert reusable(v0, 5, History(copies={2: 0, 4: 2}), conversations=40) is None  # trained weights: measure
    # the last candidate held back, the version still serving is measured once: its held-out
    # figures are kept (the caller adds the general probe it lacks), not asked a second time
    unprobed = VersionEval(4, 0.5, (0.5,), 1, 10.0)
    kept = reusable(unprobed, 4, History(), conversations=40)
    assert kept is not None and kept.per_prompt == unprobed.per_prompt and kept.probe is None


def test_the_probe_interval_pairs_the_questions():
    from clawbridge.demo.results import DemoResult, VersionEval

    def ev(version: int, probe: tuple[float, ...]) -> VersionEval:
        return VersionEval(version, 0.0, (0.0,), 1, 0.0, probe=sum(probe) / len(probe), probe_per_prompt=probe)

    b, a = (1.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0)  # d = [0, -1, 0, 0]: mean -0.25, sd 0.5
    result = DemoResult("s", "m", "combine", 0, 0, 0, (0, 0), 1, [ev(0, b), ev(1, a)], 0, 0, 0, 1, 1)
    lo, hi = result.probe_interval or (0.0, 0.0)
    assert (lo, hi) == pytest.approx((-1.0, -0.25 + 3.182 * 0.25), abs=1e-3)  # the low end clamps at -1
    assert result.summary()["probe_interval"] == [round(lo, 4), round(hi, 4)]
    unprobed = DemoResult("s", "m", "combine", 0, 0, 0, (0, 0), 1, [ev(0, b), VersionEval(1, 0.0, (0.0,), 1, 0.0)],
                          0, 0, 0, 1, 1)
    assert unprobed.probe_interval is None and unprobed.summary()["probe_interval"] is None


@pytest.mark.timeout(280)
def test_the_demo_command_prints_the_table_and_writes_the_summary(tmp_path: Path):
    """`clawbridge demo` end to end through the CLI (a scenario file, the tiny model, one step)."""
    from clawbridge.cli.main import app
    from typer.testing import CliRunner

    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["demo", "--scenario", str(tmp_path / "tiny.json"), "--model", "tiny-random",
                                   "--rounds", "1", "--out", str(out), "--json",
                                   "--data-dir", str(tmp_path / "data")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["scenario"] == "tiny" and summary["steps"] == 1
    assert summary["price"]["asked"] and summary["teachability"]["verdict"]
    assert json.loads((out / "tiny.json").read_text()) == summary
    assert "held-out prompts the training never saw (tiny)" in res.stderr
    # not a terminal: the progress is one plain line per event, no redraws
    assert "\r" not in res.stderr and "\x1b[" not in res.stderr
    events = [ln for ln in res.stderr.splitlines() if ln.startswith("[")]
    assert [e.split("] ", 1)[1] for e in events][:3] == [
        "0/3 starting the stack", "0/3 measuring policy@v0", "1/3 round 1/1: conversations"]
    assert events[-1].endswith("3/3 done")
    # teachability and the price are said before the first round
    lines = res.stderr.splitlines()
    teach = next(i for i, ln in enumerate(lines) if ln.strip().startswith("teachability: "))
    price = next(i for i, ln in enumerate(lines) if ln.strip().startswith("the price: your preference costs"))
    first_round = next(i for i, ln in enumerate(lines) if ln.endswith("round 1/1: conversations"))
    assert teach < price < first_round
    assert "the price: general probe, plain → asked" in res.stderr and "last version vs the twin" in res.stderr


@pytest.mark.timeout(280)
def test_a_signal_stops_the_demo_cleanly_and_keeps_what_it_captured(tmp_path: Path):
    """Ctrl-C or SIGTERM mid-demo: the CLI says where the data is and exits 130, without a
    traceback, and every turn it captured is in the store."""
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    (tmp_path / "tiny.json").write_text(json.dumps({**TINY, "recipe": {**TINY["recipe"], "rounds": 50}}))
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "clawbridge"), "demo", "--scenario", str(tmp_path / "tiny.json"),
         "--model", "tiny-random", "--out", str(tmp_path / "out"), "--data-dir", str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 200
        turns = 0
        while turns < 4:  # the simulated user is talking to the server
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.5)
            try:
                with sqlite3.connect(data / "clawbridge.db") as db:
                    turns = db.execute("SELECT count(*) FROM turns").fetchone()[0]
            except sqlite3.Error:
                pass
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by a signal" in err and str(data) in err and "Traceback" not in err, err
    with sqlite3.connect(data / "clawbridge.db") as db:
        assert db.execute("SELECT count(*) FROM turns").fetchone()[0] >= turns


@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_the_default_demo_improves_held_out_prompts(tmp_path: Path):
    """What `make demo` shows: the embedded model learns the `concise` preference."""
    sc = scenario.load(scenario.DEFAULT_SCENARIO)
    result = await run_demo(sc, demo_settings(sc, tmp_path / "data"), plot_path=tmp_path / "c.png")
    assert result.after - result.before >= 0.25 and result.interval[0] > 0


@pytest.mark.slow
@pytest.mark.timeout(5400)  # two demos; about 25 min on 2 idle cores, far more on busy ones
async def test_a_harmful_run_serves_nothing_worse_than_the_twin(tmp_path: Path):
    """A careless user who thanks any short answer (echoes and dodges too) and a learning rate 20x
    the demo's: the gate must hold back every candidate that answers fewer questions than the
    prompted twin (v0 asked for the preference) by more than the margin, or than v0 by more than
    gate_max_price, so the version served at the end answers the general probes as the twin does.
    The same run with the gate off shows the harm the gate prevents (so this test can fail)."""
    sc = scenario.load(scenario.DEFAULT_SCENARIO)
    recipe = sc.recipe.updated(rounds=2, learning_rate=20 * DEMO_RECIPE["learning_rate"])
    careless = sc.answers.model_copy(update={"object": False})
    harmful = sc.model_copy(update={"recipe": recipe, "answers": careless})
    settings = demo_settings(harmful, tmp_path / "gated")
    gated = await run_demo(harmful, settings)
    assert any(g["decision"] == "rejected" for g in gated.gate), gated.gate
    first, last, twin = gated.first, gated.last, gated.twin_probe
    assert last.probe is not None and first.probe is not None and twin is not None
    noise = 0.10  # one answer per probe question: sampling noise allowed
    assert last.probe >= twin - settings.gating.gate_margin - noise
    assert last.probe >= first.probe - settings.gating.gate_max_price - noise
    assert last.truly >= first.truly - 0.10
    off = harmful.model_copy(update={"recipe": recipe.updated(gate="off")})
    ungated = await run_demo(off, demo_settings(off, tmp_path / "ungated"))
    assert ungated.last.probe is not None and ungated.twin_probe is not None
    assert ungated.last.probe < ungated.twin_probe - 0.2, "the harmful run did no harm: the test proves nothing"


def test_one_sentence_counts_one_finished_sentence_of_any_length_and_nothing_else():
    check = scenario.load("one_sentence").check
    long_one = "An earthquake is " + "a very " * 20 + "sudden shaking of the ground."
    assert check.satisfied("A noun is a word for a thing.", "stop")
    assert check.satisfied(long_one, "stop")  # no word limit, unlike concise
    assert check.satisfied("Is it big? ", "stop")
    assert not check.satisfied("Short. Two sentences.", "stop")
    assert not check.satisfied("Line one.\nLine two.", "stop")  # a second line is a second sentence
    assert not check.satisfied("A noun is a word for a thing.", "length")  # cut, not ended
    assert not check.satisfied("A noun is a word for a thing", "stop")  # no end mark


def test_the_gate_asks_each_validation_prompt_validation_samples_times():
    """...and judges the validation split as the preference itself (`measures_preference`: its
    mean against the serving version decides)."""
    from clawbridge.demo.runner import gate_probes

    sc = scenario.load("concise")
    probes = gate_probes(sc)
    assert [p.messages for p in probes] == [tuple(sc.messages(q)) for q in sc.gate_prompts]
    assert {p.group for p in probes} == {"validation"} and {p.samples for p in probes} == {sc.recipe.validation_samples}
    assert all(p.measures_preference for p in probes)


async def test_the_demo_names_a_blend_the_gate_served(tmp_path: Path):
    """The progress line's source: a version recorded as a blend is named with its candidate and
    alpha; any other version is not a blend."""
    from types import SimpleNamespace

    from clawbridge.demo.rounds import _blend_of
    from clawbridge.store import PolicyVersionRow, Store

    store = Store.open(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        running = SimpleNamespace(store=store)
        assert await _blend_of(running, 7) is None  # type: ignore[arg-type]
        store.record_policy_version(PolicyVersionRow(version=6, copy_of=0))
        store.record_policy_version(PolicyVersionRow(version=7, blend_of=4, blend_alpha=0.75))
        assert await _blend_of(running, 7) == (4, 0.75)  # type: ignore[arg-type]
        assert await _blend_of(running, 6) is None  # type: ignore[arg-type]
    finally:
        store.close()
