"""The gate's rules (pure): the table built from the settings, and the decision over it."""

from __future__ import annotations

import random

import pytest
from clawbridge.learning.gate_rules import (
    Comparison,
    GateRules,
    GroupRule,
    decide,
    needs_more_probes,
)
from clawbridge.learning.stats import GroupFigures, early, paired_worse


def test_the_rules_are_a_table_built_once_from_the_settings():
    rules = GateRules.build({"probe": False, "validation": True}, reference="twin", margin=0.05, alpha=0.1,
                            alpha_base=0.2, max_price=0.15, non_inferiority=True, recent=True)
    print(rules.describe())
    assert [(r.name, r.rule, r.margin, r.alpha, r.label) for r in (rules.recent, *rules.rows) if r] == [
        ("recent vs serving", "harm", 0.05, 0.1, ""),
        ("probe vs serving", None, 0.05, 0.1, ""),  # paying the price is not harm
        ("probe vs v0", "within", 0.15, 0.1, "v0 (gate_max_price)"),
        ("probe vs twin", "within", 0.05, 0.1, "the prompted twin"),
        ("validation vs serving", "within", 0.05, 0.1, "the serving version"),
        ("validation vs v0", "proof", 0.05, 0.2, ""),
    ]
    assert rules.describe().splitlines()[3] == "probe vs v0              within    0.15    0.1  v0 (gate_max_price)"
    assert rules.max_price == 0.15 and "at most 0.15" in rules.describe()
    strict = GateRules.build({"probe": False}, reference="v0", margin=0.05, alpha=0.1, alpha_base=0.2,
                             max_price=0.15, non_inferiority=False)
    assert [(r.name, r.rule, r.alpha) for r in strict.rows] == [("probe vs serving", "harm", 0.1),
                                                                ("probe vs v0", "harm", 0.2)]
    assert strict.max_price is None and strict.recent is None and "price" not in strict.describe()


def test_the_price_holds_every_candidate_back_above_the_maximum():
    rules = GateRules.build({"probe": False}, reference="twin", margin=0.05, alpha=0.1, alpha_base=0.1,
                            max_price=0.15, non_inferiority=True)
    assert rules.price_held_back(0.62, 0.50) is None  # 12 points: paid
    assert rules.price_held_back(0.62, 0.46) == (
        "the preferences cost 16 pts of the general probe (v0 62%, asked 46%), more than gate_max_price "
        "(15 pts): raise it to accept this price")
    strict = GateRules.build({"probe": False}, reference="v0", margin=0.05, alpha=0.1, alpha_base=0.1,
                             max_price=0.15, non_inferiority=True)
    assert strict.price_held_back(0.62, 0.0) is None  # against v0 no price is measured


def harm(g: GroupFigures, alpha: float = 0.1) -> Comparison:
    """A comparison with the serving version: evidence of harm holds back."""
    return Comparison(GroupRule("probe", "serving", "harm", 0.05, alpha), g)


def proof(g: GroupFigures, alpha: float = 0.2) -> Comparison:
    """A comparison with v0 in the strict mode: the candidate carries the burden of proof."""
    return Comparison(GroupRule("probe", "v0", "proof", 0.05, alpha), g)


def within(g: GroupFigures, margin: float = 0.05, alpha: float = 0.1) -> Comparison:
    """A comparison with the prompted twin: the mean difference decides."""
    return Comparison(GroupRule("probe", "twin", "within", margin, alpha, "the prompted twin"), g)


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
    assert not needs_more_probes({"probe vs v0": proof(drift)})  # all asked: decided
    close = GroupFigures(0.62, 0.62, 0.0, 0.5, 0.15)  # within the margin at 85 %, not at 90 %
    assert decide({"probe vs v0": proof(close)})[0] == "accepted"
    assert decide({"probe vs v0": proof(close, alpha=0.1)})[0] == "rejected"


def test_an_early_look_never_accepts():
    better = GroupFigures(0.7, 0.6, 0.1, 0.9, 0.05)  # looks better on the first probes: still ask all
    bad = GroupFigures(0.2, 0.9, -0.7, 0.001, 1.0)  # rejected beyond doubt: nothing to resolve
    assert needs_more_probes({"a": harm(better)}, share=0.3)
    assert not needs_more_probes({"a": harm(bad), "b": harm(better)}, share=0.3)
    assert not needs_more_probes({"a": harm(better)})  # all asked (share 1): decided
    assert needs_more_probes({"probe vs twin": within(better)}, share=0.3)


def test_an_early_look_rejects_only_beyond_the_stricter_boundary():
    # O'Brien-Fleming at a third of the probes: z = 1.2816 / sqrt(1/3) = 2.22 -> p 0.0132
    assert early(0.1, 1 / 3) == pytest.approx(0.0132, abs=5e-4)
    assert early(0.1, 1.0) == 0.1 and early(0.2, 0.32) < 0.2
    borderline = GroupFigures(0.31, 0.56, -0.25, 0.05, 0.9)  # rejected at alpha 0.1 on a third: ask all
    clear = GroupFigures(0.12, 0.56, -0.44, 0.005, 1.0)  # beyond the early boundary: decided
    assert decide({"probe vs serving": harm(borderline)})[0] == "rejected"
    assert needs_more_probes({"probe vs serving": harm(borderline)}, share=1 / 3)
    assert not needs_more_probes({"probe vs serving": harm(clear)}, share=1 / 3)
    assert not needs_more_probes({"probe vs serving": harm(borderline)}, share=1.0)  # all asked: decided
    # a comparison with v0 uses alpha_base, made stricter the same way: 0.2 -> 0.068 at 0.32
    drift = GroupFigures(0.44, 0.56, -0.12, 0.167, 0.8)
    assert needs_more_probes({"probe vs v0": proof(drift)}, share=0.32)
    # an early look does not hold back for want of evidence of safety: the rest may bring it
    unproven = GroupFigures(0.56, 0.56, 0.0, 0.5, 0.4)
    assert needs_more_probes({"probe vs v0": proof(unproven)}, share=0.32)
    # against the twin, an early look holds back only a loss beyond the margin shown at the
    # early boundary: 1 - p_inferior is the p of "no more than the margin below"
    shown = GroupFigures(0.30, 0.56, -0.26, 0.001, 0.995)
    below = GroupFigures(0.48, 0.56, -0.08, 0.1, 0.75)  # below the margin, not shown so early
    assert not needs_more_probes({"probe vs twin": within(shown)}, share=0.3)
    assert needs_more_probes({"probe vs twin": within(below)}, share=0.3)
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
              "probe vs v0": Comparison(GroupRule("probe", "v0", "within", 0.15, 0.1, "v0 (gate_max_price)"),
                                        GroupFigures(0.40, 0.62, -0.22, 0.001, 0.9))}
    assert decide(capped)[0] == "rejected" and "v0 (gate_max_price)" in decide(capped)[1]


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


def test_an_accepted_candidate_is_said_within_the_twin_only_when_the_twin_was_asked():
    fine = GroupFigures(0.9, 0.9, 0.0, 1.0, 0.0)
    kept = Comparison(GroupRule("validation", "serving", "within", 0.05, 0.1, "the serving version"), fine)
    shown = Comparison(GroupRule("validation", "v0", "proof", 0.05, 0.2), fine)
    assert decide({"validation vs serving": kept, "validation vs v0": shown}) == (
        "accepted", "no probe group is worse beyond the margin, and each is within it of v0")
    twin = Comparison(GroupRule("probe", "twin", "within", 0.05, 0.1, "the prompted twin"), fine)
    assert decide({"validation vs serving": kept, "probe vs twin": twin})[1].endswith("of the prompted twin")

