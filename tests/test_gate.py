"""The gate's statistics and decision (pure), and the anchor's advantages (pure)."""

from __future__ import annotations

import random

import pytest
from clawbridge.learning.advantages import anchored
from clawbridge.learning.gate import (
    Comparison,
    GroupFigures,
    _t_sf,
    decide,
    doubtful,
    early,
    paired_worse,
    price,
)


def test_the_t_tail_matches_the_tables():
    assert _t_sf(2.262, 9) == pytest.approx(0.025, abs=5e-4)
    assert _t_sf(1.96, 10_000) == pytest.approx(0.025, abs=5e-4)
    assert _t_sf(0.0, 5) == pytest.approx(0.5)
    assert _t_sf(-1.833, 9) == pytest.approx(0.95, abs=5e-4)


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


def harm(g: GroupFigures, alpha: float = 0.1) -> Comparison:
    """A comparison with the serving version: evidence of harm holds back."""
    return Comparison(g, "harm", 0.05, alpha)


def proof(g: GroupFigures, alpha: float = 0.2) -> Comparison:
    """A comparison with v0 in the strict mode: the candidate carries the burden of proof."""
    return Comparison(g, "proof", 0.05, alpha)


def within(g: GroupFigures, margin: float = 0.05, alpha: float = 0.1) -> Comparison:
    """A comparison with the prompted twin: the mean difference decides."""
    return Comparison(g, "within", margin, alpha, "the prompted twin")


def test_a_candidate_is_held_back_only_when_worse_beyond_the_margin_and_significant():
    bad = GroupFigures(0.5, 0.9, -0.4, 0.01, 1.0)
    noisy = GroupFigures(0.5, 0.9, -0.4, 0.3, 0.9)  # a big drop on too few probes to tell
    small = GroupFigures(0.87, 0.9, -0.03, 0.01, 0.2)  # significant but within the margin
    assert decide({"probe vs serving": harm(bad)})[0] == "rejected"
    assert "probe vs serving" in decide({"probe vs serving": harm(bad)})[1]
    assert decide({"a": harm(noisy), "b": harm(small)})[0] == "accepted"


def test_the_comparison_with_v0_has_its_own_significance():
    drift = GroupFigures(0.54, 0.62, -0.08, 0.105, 0.7)  # a demo's v3 against v0, 50 probes
    assert decide({"probe vs serving": harm(drift)})[0] == "accepted"  # a step: alpha 0.1
    decision, reason = decide({"probe vs v0": proof(drift)})
    assert decision == "rejected" and "p=0.105" in reason  # shown worse at alpha_base, not only unproven
    assert not doubtful({"probe vs v0": proof(drift)})  # all asked: decided
    close = GroupFigures(0.62, 0.62, 0.0, 0.5, 0.15)  # within the margin at 85 %, not at 90 %
    assert decide({"probe vs v0": proof(close)})[0] == "accepted"
    assert decide({"probe vs v0": proof(close, alpha=0.1)})[0] == "rejected"


def test_an_early_look_never_accepts():
    better = GroupFigures(0.7, 0.6, 0.1, 0.9, 0.05)  # looks better on the first probes: still ask all
    bad = GroupFigures(0.2, 0.9, -0.7, 0.001, 1.0)  # rejected beyond doubt: nothing to resolve
    assert doubtful({"a": harm(better)}, share=0.3)
    assert not doubtful({"a": harm(bad), "b": harm(better)}, share=0.3)
    assert not doubtful({"a": harm(better)})  # all asked (share 1): decided
    assert doubtful({"probe vs twin": within(better)}, share=0.3)


def test_an_early_look_rejects_only_beyond_the_stricter_boundary():
    # O'Brien-Fleming at a third of the probes: z = 1.2816 / sqrt(1/3) = 2.22 -> p 0.0132
    assert early(0.1, 1 / 3) == pytest.approx(0.0132, abs=5e-4)
    assert early(0.1, 1.0) == 0.1 and early(0.2, 0.32) < 0.2
    borderline = GroupFigures(0.31, 0.56, -0.25, 0.05, 0.9)  # rejected at alpha 0.1 on a third: ask all
    clear = GroupFigures(0.12, 0.56, -0.44, 0.005, 1.0)  # beyond the early boundary: decided
    assert decide({"probe vs serving": harm(borderline)})[0] == "rejected"
    assert doubtful({"probe vs serving": harm(borderline)}, share=1 / 3)
    assert not doubtful({"probe vs serving": harm(clear)}, share=1 / 3)
    assert not doubtful({"probe vs serving": harm(borderline)}, share=1.0)  # all asked: decided
    # a comparison with v0 uses alpha_base, made stricter the same way: 0.2 -> 0.068 at 0.32
    drift = GroupFigures(0.44, 0.56, -0.12, 0.167, 0.8)
    assert doubtful({"probe vs v0": proof(drift)}, share=0.32)
    # an early look does not hold back for want of evidence of safety: the rest may bring it
    unproven = GroupFigures(0.56, 0.56, 0.0, 0.5, 0.4)
    assert doubtful({"probe vs v0": proof(unproven)}, share=0.32)
    # against the twin, an early look holds back only a loss beyond the margin shown at the
    # early boundary: 1 - p_inferior is the p of "no more than the margin below"
    shown = GroupFigures(0.30, 0.56, -0.26, 0.001, 0.995)
    below = GroupFigures(0.48, 0.56, -0.08, 0.1, 0.75)  # below the margin, not shown so early
    assert not doubtful({"probe vs twin": within(shown)}, share=0.3)
    assert doubtful({"probe vs twin": within(below)}, share=0.3)
    assert decide({"probe vs twin": within(below)})[0] == "rejected"  # all asked: the mean decides


def test_against_v0_the_candidate_must_show_it_loses_less_than_the_margin():
    unproven = GroupFigures(0.58, 0.62, -0.04, 0.28, 0.44)  # run 8's candidate: 50 answers looked fine
    shown = GroupFigures(0.66, 0.62, 0.04, 0.9, 0.03)
    decision, reason = decide({"probe vs v0": proof(unproven)})
    assert decision == "rejected" and "not shown within 5 pts" in reason
    assert decide({"probe vs v0": proof(shown)})[0] == "accepted"
    # against the serving version only harm that can be shown holds a candidate back; so against
    # v0 with gate_v0_test "harm"
    assert decide({"probe vs serving": harm(unproven)})[0] == "accepted"
    assert decide({"probe vs v0": harm(unproven, alpha=0.2)})[0] == "accepted"


def test_against_the_twin_paying_the_price_is_not_harm_and_more_is():
    """The decided rule (docs/methods.md#the-gate): on the general probe the candidate is judged
    against the base model asked for the user's preferences. A candidate 12 points below v0 but
    1 below the twin (the price is 11) serves; one 8 below the twin does not, whatever v0 says."""
    pays = {"probe vs twin": within(GroupFigures(0.50, 0.51, -0.01, 0.4, 0.2)),
            "probe vs v0": within(GroupFigures(0.50, 0.62, -0.12, 0.01, 0.2), margin=0.15)}
    assert decide(pays) == ("accepted", "no probe group is worse beyond the margin; the probe is within it "
                                        "of the prompted twin")
    beyond = {"probe vs twin": within(GroupFigures(0.43, 0.51, -0.08, 0.05, 0.7)),
              "probe vs v0": within(GroupFigures(0.43, 0.62, -0.19, 0.001, 0.9), margin=0.25)}
    decision, reason = decide(beyond)
    assert decision == "rejected" and reason.startswith("probe vs twin: 43% vs 51% (-8 pts)")
    assert "below the prompted twin" in reason
    # the cap: within the margin of the twin, but further below v0 than the maximum price
    capped = {"probe vs twin": within(GroupFigures(0.40, 0.42, -0.02, 0.3, 0.2)),
              "probe vs v0": Comparison(GroupFigures(0.40, 0.62, -0.22, 0.001, 0.9), "within", 0.15, 0.1,
                                        "v0 (gate_max_price)")}
    assert decide(capped)[0] == "rejected" and "v0 (gate_max_price)" in decide(capped)[1]


def test_the_price_is_plain_minus_asked():
    assert price([1, 1, 0, 1], [1, 0, 0, 1]) == 0.25
    assert price([0.5, 0.5], [1.0, 1.0]) == -0.5  # asking helped
    with pytest.raises(ValueError):
        price([1.0], [])


def _serves(non_inferiority: bool, loss: float, rng: random.Random, candidates: int = 5, probes: int = 50) -> bool:
    """One simulated run: v0 answers probe i right with its own rate; each candidate `loss`
    below it; one answer per probe and version (independent draws). Did any candidate serve?"""
    rates = [rng.uniform(0.3, 0.95) for _ in range(probes)]
    v0 = [float(rng.random() < r) for r in rates]
    for _ in range(candidates):
        cand = [float(rng.random() < max(0.0, min(1.0, r - loss))) for r in rates]
        g = paired_worse(cand, v0, 0.05)
        if decide({"probe vs v0": proof(g) if non_inferiority else harm(g, alpha=0.2)})[0] == "accepted":
            return True
    return False


def test_five_candidates_twelve_points_worse_rarely_serve_a_harmful_one():
    """The hole the burden of proof closes, simulated: with evidence of harm alone, some one of
    five candidates that each lose 12 points looks fine and serves in most runs; with the
    candidate carrying the proof, in few. A candidate 10 points better still serves in most."""
    rng = random.Random(7)
    runs = 400
    harm_only = sum(_serves(False, 0.12, rng) for _ in range(runs)) / runs
    burden = sum(_serves(True, 0.12, rng) for _ in range(runs)) / runs
    better = sum(_serves(True, -0.10, rng, candidates=1) for _ in range(runs)) / runs
    assert harm_only > 0.5 and burden < 0.25 and better > 0.7, (harm_only, burden, better)


def test_the_anchor_pulls_each_token_back_by_how_far_it_moved_from_the_base():
    # old - base = [0.5, -1.0, 0.0]; coef 0.1 -> A - [0.05, -0.1, 0]
    out = anchored([1.0, 1.0, -1.0], [-0.5, -2.0, -1.0], [-1.0, -1.0, -1.0], 0.1)
    assert out == pytest.approx((0.95, 1.1, -1.0))
    assert anchored([1.0], [-3.0], [-1.0], 0.0) == (1.0,)
    with pytest.raises(ValueError):
        anchored([1.0, 1.0], [-1.0], [-1.0], 0.1)


def test_versions_and_status_show_the_gate_decisions(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps the table to the terminal's width
    from clawbridge.cli.status import print_status, print_versions
    from clawbridge.config import Settings
    from clawbridge.learning.gate import GATE_KEY, GateDecision
    from clawbridge.learning.promotion import ROLLBACKS_KEY
    from clawbridge.store import PolicyVersionRow, Store

    settings = Settings(data_dir=tmp_path)
    tmp_path.mkdir(exist_ok=True)
    with Store.open(settings.db_url) as store:
        for v in (1, 2, 3):
            store.record_policy_version(PolicyVersionRow(version=v, step=v if v < 3 else None))
        decisions = [GateDecision(1, 0, "accepted", "ok", {"probe_candidate": 0.8}),
                     GateDecision(2, 1, "rejected", "probe vs serving: 20% vs 80% (-60 pts, p=0.001)",
                                  {"probe_candidate": 0.2})]
        store.set_meta(GATE_KEY, [d.record() for d in decisions])
        store.set_meta(ROLLBACKS_KEY, {"3": 1})
    print_versions(str(tmp_path), None)
    out = capsys.readouterr().out
    assert "accepted (probe 80%)" in out and "rejected by the gate" in out and "rollback of v1" in out
    print_status(str(tmp_path), None)
    assert "1 accepted, 1 held back" in capsys.readouterr().out


def test_the_price_and_the_preferences_are_shown_wherever_versions_are(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    from clawbridge.cli.status import print_preferences, print_status, print_versions
    from clawbridge.config import Settings
    from clawbridge.learning import preferences as prefs
    from clawbridge.learning.gate import GATE_KEY, GateDecision
    from clawbridge.store import PolicyVersionRow, Store

    settings = Settings(data_dir=tmp_path)
    print_preferences(str(tmp_path), None)
    assert "no preferences yet" in capsys.readouterr().out
    known = prefs.merge([], [("Answer in one short sentence.", "t1"), ("Use bullet points.", "t2"),
                             ("answer in ONE short sentence", "t3")], version=1)
    figures = {"probe_candidate": 0.5, "probe_twin": 0.5, "probe_v0": 0.62, "price_points": 12.0}
    with Store.open(settings.db_url) as store:
        store.record_policy_version(PolicyVersionRow(version=1, step=1))
        store.set_meta(prefs.PREFERENCES_KEY, prefs.to_json(known))
        store.set_meta(GATE_KEY, [GateDecision(1, 0, "accepted", "ok", figures, "twin",
                                               prefs.instruction(prefs.standing(known))).record()])
    print_preferences(str(tmp_path), None)
    out = capsys.readouterr().out
    assert "answer in ONE short sentence" in out and "t1 t3" in out and "Use bullet points." in out  # the shortest wording
    assert "price: 12 pts of general answers (v0 62%, asked for these 2 50%)" in out
    print_versions(str(tmp_path), None)
    assert "twin 50%, v0 62%: price 12 pts" in capsys.readouterr().out
    print_status(str(tmp_path), None)
    assert "12 pts of general answers" in capsys.readouterr().out


def test_hints_that_say_the_same_thing_count_as_one_preference():
    from clawbridge.learning import preferences as prefs

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
    from clawbridge.learning import preferences as prefs

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
