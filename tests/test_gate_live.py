"""The gate on the real engine path (tiny random model): a trained candidate that answers the
probes worse than the serving version is published, judged, held back and replaced by a copy of
the serving weights, and what serves afterwards answers as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from clawbridge.learning.gate import Asked, Gate, GateProbe, question_seed
from clawbridge.learning.trainer import Trainer
from clawbridge.types import SamplingParams
from helpers.gate import PROMPTS, _answers, _as_gate, _plain, _wrecked
from helpers.learning import collector_for, record_turns


async def test_a_worse_candidate_is_held_back_and_serving_stays(tmp_path: Path):
    # a learning rate that wrecks the model in one step: the "harmful run"
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        before = await _answers(backend, renderer, params, 0)

        # each probe's check: the answer is exactly v0's (same seed), so any change counts as worse
        plain = [renderer.parse(
            (await backend.sample(renderer.render([{"role": "user", "content": p}]), _as_gate(params, p), version=0))[0].tokens,
            "length").content or "" for p in PROMPTS]

        def same_as_v0(i: int):
            return lambda text, _finish: 1.0 if text == plain[i] else 0.0

        probes = [GateProbe("validation", ({"role": "user", "content": p},), same_as_v0(i))
                  for i, p in enumerate(PROMPTS)]
        gate = Gate(backend, renderer, probes, params=params, margin=0.05, alpha=0.1)
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        trainer = Trainer(settings.training, backend, store, gate=gate)
        step = await trainer.step_once()
        assert step is not None and step.version == 1
        [decision] = trainer.promotion.decisions
        assert decision.decision == "rejected", decision
        assert decision.figures["validation_candidate"] < decision.figures["validation_serving"] == 1.0
        # v0 serves: the serving comparison is also the one with v0, at the stricter alpha_base
        assert decision.figures["validation_v0"] == decision.figures["validation_serving"]
        assert decision.figures["validation_p_vs_v0"] == decision.figures["validation_p_vs_serving"]
        # v2 is a copy of v0's weights and serves; nothing is pinned between steps
        assert step.served == 2 and backend.version == 2 and backend.held is None
        assert store.history().copies == {2: 0}
        assert [g.decision for g in store.history().decisions] == ["rejected"]
        assert await _answers(backend, renderer, params, 2) == before
        assert await _answers(backend, renderer, params, 1) != before


@pytest.mark.parametrize("reserve", [False, True])
async def test_doubt_on_the_first_probes_asks_the_reserve(tmp_path: Path, reserve: bool):
    """Four first probes see the wrecked candidate worse on one: no evidence of harm, and none
    that it is within the margin of v0 either, so with nothing more to ask it is held back for
    want of proof; with a reserve of six more, the first probes cannot decide, the gate asks the
    reserve too and holds the candidate back on the harm they show."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        questions = [*PROMPTS, "What is ice?", "Why is grass green?", "What is a dog?", "Where is Chad?"]
        plain = {q: renderer.parse((await backend.sample(
            renderer.render([{"role": "user", "content": q}]), _as_gate(params, q), version=0))[0].tokens, "length").content or ""
            for q in questions}

        def probe(q: str, check_v0: bool) -> GateProbe:
            check = (lambda text, _f: 1.0 if text == plain[q] else 0.0) if check_v0 else (lambda _t, _f: 1.0)
            return GateProbe("probe", ({"role": "user", "content": q},), check)

        first = [probe(questions[0], True)] + [probe(q, False) for q in questions[1:4]]
        more = [probe(q, True) for q in questions[4:]]
        gate = Gate(backend, renderer, first, params=params, margin=0.05, alpha=0.1, reference="v0",
                    reserve=more if reserve else ())
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        trainer = Trainer(settings.training, backend, store, gate=gate)
        assert await trainer.step_once() is not None
        [decision] = trainer.promotion.decisions
        if reserve:
            assert decision.decision == "rejected", decision
            assert decision.figures["probes_asked"] == 10
            assert decision.figures["probe_candidate"] < 0.5
        else:
            assert decision.decision == "rejected" and "not shown within" in decision.reason, decision
            assert decision.figures["probes_asked"] == 4 and decision.figures["probe_candidate"] == 0.75


async def test_against_the_twin_a_price_is_shown_capped_and_paid_only_with_consent(tmp_path: Path):
    """Harm is judged against what the user asked for. On the tiny model any instruction changes
    every answer, so a probe that counts only v0's own answer as right makes the preference cost
    the whole probe: the gate measures that price (v0 100 %, the twin asked for it 0 %) and holds
    the candidate back for it while gate_max_price is 15 points; a user who raised it to 1.0 has
    consented, and the wrecked candidate, no worse than the twin, serves; the strict mode (no
    worse than v0) holds the same candidate back."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        plain = {q: renderer.parse((await backend.sample(
            renderer.render([{"role": "user", "content": q}]), _as_gate(params, q), version=0))[0].tokens, "length").content or ""
            for q in PROMPTS}
        probes = [GateProbe("probe", ({"role": "user", "content": q},),
                            lambda text, _f, want=plain[q]: 1.0 if text == want else 0.0) for q in PROMPTS]
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        assert (await Trainer(settings.training, backend, store).step_once()).version == 1  # type: ignore[union-attr]
        asked = "Always answer 'I don't know'."

        capped = await Gate(backend, renderer, probes, params=params, max_price=0.15).evaluate(1, 0, asked=Asked(asked))
        assert capped.decision == "rejected" and "gate_max_price" in capped.reason, capped
        assert capped.figures["probe_v0"] == 1.0 and capped.figures["probe_twin"] == 0.0
        assert capped.figures["price_points"] == 100.0 and capped.record()["asked"] == asked

        consented = await Gate(backend, renderer, probes, params=params, max_price=1.0).evaluate(1, 0, asked=Asked(asked))
        assert consented.decision == "accepted", consented
        assert consented.reference == "twin" and consented.figures["probe_candidate"] == 0.0
        assert consented.figures["probe_twin"] == 0.0 and consented.figures["price_points"] == 100.0

        strict = await Gate(backend, renderer, probes, params=params, reference="v0").evaluate(1, 0, asked=Asked(asked))
        assert strict.decision == "rejected" and strict.reference == "v0" and strict.instruction is None


async def test_every_probe_is_asked_with_its_own_seed_the_same_for_every_version_and_the_twin(tmp_path: Path):
    """Paired across versions (the same seed for a probe whoever answers it), independent across
    probes (one seed for all made the whole probe one correlated draw)."""
    async with _wrecked(tmp_path) as (_settings, _store, backend, renderer, params):
        asked: list[tuple[int | None, int | None]] = []
        sample = backend.sample

        async def recorded(prompt: Any, p: SamplingParams, n: int = 1, version: int | None = None,
                           priority: str = "user") -> Any:
            asked.append((version, p.seed))
            return await sample(prompt, p, n=n, version=version, priority=priority)

        backend.sample = recorded  # type: ignore[method-assign]
        probes = [GateProbe("probe", ({"role": "user", "content": q},), lambda _t, _f: 1.0) for q in PROMPTS]
        gate = Gate(backend, renderer, probes, params=params)
        await gate.scores(0)
        await gate.scores(0, instruction="Answer in one short sentence.")
        seeds = [question_seed(params.seed, q) for q in PROMPTS]
        assert len(set(seeds)) == len(PROMPTS)
        assert asked == [(0, s) for s in seeds] * 2


async def test_the_price_is_told_once_even_when_the_demo_measured_it_first(tmp_path: Path, caplog: Any):
    """The demo measures v0 and the twin through the gate before any candidate; the gate's first
    decision still tells the price (the server's log line), and only once."""
    import logging

    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        probes = [GateProbe("probe", ({"role": "user", "content": q},), lambda _t, _f: 1.0) for q in PROMPTS]
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        assert (await Trainer(settings.training, backend, store).step_once()).version == 1  # type: ignore[union-attr]
        gate = Gate(backend, renderer, probes, params=params)
        assert await gate.general_scores(0, "Be brief.", gate.reference_samples) == [1.0] * len(PROMPTS)
        with caplog.at_level(logging.WARNING, logger="clawbridge.learning.gate"):
            await gate.evaluate(1, 0, asked=Asked("Be brief."))
            await gate.evaluate(1, 0, asked=Asked("Be brief."))
        told = [r.getMessage() for r in caplog.records if "of general answers" in r.getMessage()]
        assert len(told) == 1 and "'Be brief.' cost 0 points" in told[0], told


async def test_a_probe_with_its_own_samples_is_answered_that_many_times_by_every_version(tmp_path: Path):
    """A validation probe asked 3 times (GateProbe.samples) beside a general one asked the gate's
    once: each version's score of it is the mean check over 3 answers, the twin's and v0's too."""
    async with _wrecked(tmp_path) as (_settings, _store, backend, renderer, params):
        seen: dict[str, list[str]] = {"validation": [], "probe": []}

        def counted(group: str):
            return lambda text, _finish: (seen[group].append(text), 1.0 if len(text) % 2 else 0.0)[1]

        probes = [GateProbe("validation", ({"role": "user", "content": PROMPTS[0]},), counted("validation"), 3),
                  GateProbe("probe", ({"role": "user", "content": PROMPTS[1]},), counted("probe"))]
        gate = Gate(backend, renderer, probes, params=params, reference_samples=2)
        score, _ = await gate.scores(0, instruction=None, samples=2)  # v0 as the gate asks it
        assert (len(seen["validation"]), len(seen["probe"])) == (3, 2)
        assert score == sum(len(t) % 2 for t in seen["validation"]) / 3
        published = await backend.publish()
        await gate.scores(published.version)  # a candidate: the gate's one answer, the probe's own three
        assert (len(seen["validation"]), len(seen["probe"])) == (6, 3)


@pytest.mark.parametrize("measures_preference", [False, True])
async def test_a_group_that_measures_the_preference_holds_back_a_fall_the_harm_rule_cannot_show(tmp_path: Path,
                                                                                                 measures_preference: bool):
    """The demo's validation split measures the preference itself
    (`GateProbe.measures_preference`): against the serving version its mean decides. The wrecked
    candidate keeps five of six validation prompts (−17 points, not significant on six): the harm
    rule serves it, a group that measures the preference holds it back, so a version that keeps
    the preference worse than what serves does not replace it."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        plain = await _plain(backend, renderer, params)
        probes = [GateProbe("validation", ({"role": "user", "content": PROMPTS[0]},),
                            lambda text, _f: 1.0 if text == plain[0] else 0.0,
                            measures_preference=measures_preference)]
        probes += [GateProbe("validation", ({"role": "user", "content": p},), lambda _t, _f: 1.0,
                             measures_preference=measures_preference) for p in PROMPTS[1:]]
        gate = Gate(backend, renderer, probes, params=params, margin=0.05, alpha=0.1, non_inferiority=False)
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        trainer = Trainer(settings.training, backend, store, gate=gate)
        assert await trainer.step_once() is not None
        [decision] = trainer.promotion.decisions
        assert decision.figures["validation_candidate"] == pytest.approx(5 / 6)
        assert decision.figures["validation_serving"] == 1.0 and decision.figures["validation_p_vs_serving"] > 0.1
        if measures_preference:
            assert decision.decision == "rejected", decision
            assert "more than 5 pts below the serving version" in decision.reason, decision.reason
        else:
            assert decision.decision == "accepted", decision
