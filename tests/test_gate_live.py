"""The gate on the real engine path (tiny random model): a trained candidate that answers the
probes worse than the serving version is published, judged, held back and replaced by a copy of
the serving weights, and what serves afterwards answers as before."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.learning.gate import GATE_KEY, Gate, GateProbe, question_seed
from clawbridge.learning.trainer import ROLLBACKS_KEY, Trainer
from clawbridge.store import Store
from clawbridge.types import SamplingParams
from helpers.learning import collector_for, record_turns, settings_for

PROMPTS = ["What is rain?", "Why is the sky blue?", "What is a cat?", "Where is Peru?", "What is snow?",
           "How do birds fly?"]


@contextlib.asynccontextmanager
async def _wrecked(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[Any, Store, LocalBackend, Renderer, SamplingParams]]:
    """A learning rate that wrecks the tiny model in one step (the "harmful run"), the gate on with
    only the caller's probes; a pinned local backend and seed-7 sampling. Closed on the way out."""
    settings = settings_for(tmp_path, learning_rate=0.5, gate="on", gate_probes=0, **overrides)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        yield settings, store, backend, Renderer(backend.tokenizer()), SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    finally:
        await backend.close()
        store.close()


def _as_gate(params: SamplingParams, question: str) -> SamplingParams:
    """`params` as the gate asks `question` with them: the question's own seed."""
    return dataclasses.replace(params, seed=question_seed(params.seed, question))


async def _answers(backend: LocalBackend, renderer: Renderer, params: SamplingParams, version: int) -> list[str]:
    out = []
    for p in PROMPTS:
        [c] = await backend.sample(renderer.render([{"role": "user", "content": p}]), params, version=version)
        out.append(renderer.decode(c.tokens))
    return out


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
        [decision] = trainer.decisions
        assert decision.decision == "rejected", decision
        assert decision.figures["validation_candidate"] < decision.figures["validation_serving"] == 1.0
        # v0 serves: the serving comparison is also the one with v0, at the stricter alpha_base
        assert decision.figures["validation_v0"] == decision.figures["validation_serving"]
        assert decision.figures["validation_p_vs_v0"] == decision.figures["validation_p_vs_serving"]
        # v2 is a copy of v0's weights and serves; nothing is pinned between steps
        assert step.served == 2 and backend.version == 2 and backend.held is None
        assert store.get_meta(ROLLBACKS_KEY) == {"2": 0}
        assert [g["decision"] for g in store.get_meta(GATE_KEY)] == ["rejected"]
        assert await _answers(backend, renderer, params, 2) == before
        assert await _answers(backend, renderer, params, 1) != before


async def test_a_candidate_the_gate_never_judged_is_judged_after_a_restart(tmp_path: Path):
    """A process killed while the gate judged leaves a recorded candidate with no decision; the
    restarted learner judges it before training on, so no version serves ungated."""
    from clawbridge.learning.trainer import pending_candidate

    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        v0 = await _answers(backend, renderer, params, 0)
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        # the step publishes and records v1; the gate's decision never comes (the kill)
        assert (await Trainer(settings.training, backend, store).step_once()).version == 1  # type: ignore[union-attr]
        assert await pending_candidate(store) == (1, 0)

        plain = [renderer.parse(
            (await backend.sample(renderer.render([{"role": "user", "content": p}]), _as_gate(params, p), version=0))[0].tokens,
            "length").content or "" for p in PROMPTS]
        probes = [GateProbe("validation", ({"role": "user", "content": p},),
                            lambda text, _finish, want=want: 1.0 if text == want else 0.0)
                  for p, want in zip(PROMPTS, plain, strict=True)]
        restarted = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert await restarted.judge_pending() == 2  # rejected: a copy of v0 serves as v2
        assert [g["decision"] for g in store.get_meta(GATE_KEY)] == ["rejected"]
        assert await pending_candidate(store) is None and backend.held is None
        assert await _answers(backend, renderer, params, 2) == v0
        assert await restarted.judge_pending() is None  # decided once: nothing pending


def _same_as_v0(plain: list[str]) -> list[GateProbe]:
    return [GateProbe("validation", ({"role": "user", "content": p},),
                      lambda text, _finish, want=want: 1.0 if text == want else 0.0)
            for p, want in zip(PROMPTS, plain, strict=True)]


async def _plain(backend: LocalBackend, renderer: Renderer, params: SamplingParams) -> list[str]:
    return [renderer.parse(
        (await backend.sample(renderer.render([{"role": "user", "content": p}]), _as_gate(params, p), version=0))[0].tokens,
        "length").content or "" for p in PROMPTS]


async def _patient(settings: Any, store: Store, backend: LocalBackend, renderer: Renderer,
                   params: SamplingParams) -> tuple[Any, list[str], list[GateProbe]]:
    """gate_patience 3 on the wrecked setup, two judged samples waiting: the settings, v0's
    answers, and probes that count any change from v0 as worse."""
    settings = settings.model_copy(update={"gate_patience": 3})
    v0 = await _answers(backend, renderer, params, 0)
    probes = _same_as_v0(await _plain(backend, renderer, params))
    record_turns(store, 2)
    await collector_for(settings, backend, store).run_once()
    return settings, v0, probes


async def test_with_patience_training_goes_on_from_a_held_back_candidate(tmp_path: Path):
    """gate_patience 1: the first held-back candidate stays the training lineage while v0 keeps
    serving (no copy); the second in a row restarts from v0's weights with a fresh optimizer."""
    from clawbridge.learning.trainer import held_candidate

    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"gate_patience": 1, "max_staleness": 100})
        v0 = await _answers(backend, renderer, params, 0)
        gate = Gate(backend, renderer, _same_as_v0(await _plain(backend, renderer, params)), params=params)
        record_turns(store, 6)  # "ok" is neutral: two of every three replies give a sample
        await collector_for(settings, backend, store).run_once()
        assert len(store.pending_samples(10, method="combine")) == 4
        trainer = Trainer(settings.training, backend, store, gate=gate)
        first = await trainer.step_once()
        assert first is not None and first.version == 1 and first.served == 0
        assert backend.held == 0 and backend.version == 0 and backend.newest == 1  # v0 serves; v1 is the lineage
        assert store.get_meta(ROLLBACKS_KEY) is None and await held_candidate(store) == (1, 0)
        assert await _answers(backend, renderer, params, backend.version) == v0
        assert trainer.fresh_steps == 1  # the lineage's optimizer goes on

        second = await trainer.step_once()
        assert second is not None and second.version == 2 and trainer.decisions[-1].decision == "rejected"
        assert trainer.decisions[-1].serving == 0  # judged against what serves, not against the lineage
        # the second hold-back in a row restarts from the served weights
        assert second.served == 3 and backend.held is None and store.get_meta(ROLLBACKS_KEY) == {"3": 0}
        assert trainer.fresh_steps == 0 and await held_candidate(store) is None
        assert await _answers(backend, renderer, params, 3) == v0


async def test_a_rollback_while_training_goes_on_from_a_held_back_candidate_serves_the_copy(tmp_path: Path):
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings, v0, probes = await _patient(settings, store, backend, renderer, params)
        trainer = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert (await trainer.step_once()).served == 0 and backend.held == 0  # type: ignore[union-attr]
        rb = await trainer.rollback(0)
        assert (rb.version, backend.version, backend.held, trainer.held) == (2, 2, None, None)
        assert store.get_meta(ROLLBACKS_KEY) == {"2": 0}
        assert await _answers(backend, renderer, params, backend.version) == v0


async def test_a_restart_while_training_goes_on_from_a_held_back_candidate_serves_and_restores_the_served(
        tmp_path: Path):
    from clawbridge.learning.trainer import held_candidate

    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings, v0, probes = await _patient(settings, store, backend, renderer, params)
        first = await Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params)).step_once()
        assert first is not None and first.served == 0 and await held_candidate(store) == (1, 0)
    async with _wrecked(tmp_path) as (_, store, backend, renderer, params):  # the same data dir: a restart
        await Trainer(settings.training, backend, store).resume()  # as serve() does before the first request
        backend.serve((await held_candidate(store))[1])  # type: ignore[index]  # and pins it
        assert backend.version == 0
        restarted = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert await restarted.judge_pending() == 2 and backend.held is None and backend.version == 2
        assert store.get_meta(ROLLBACKS_KEY) == {"2": 0} and await held_candidate(store) is None
        assert await _answers(backend, renderer, params, 2) == v0


async def _one_step_blending(settings: Any, store: Store, backend: LocalBackend, renderer: Renderer,
                             params: SamplingParams, alphas: tuple[float, ...]) -> tuple[Trainer, list[str], Any]:
    """One wrecking step with `gate_blend` alphas and probes that count any change from v0 as
    worse: the trainer, v0's answers and the step's result."""
    settings = settings.model_copy(update={"gate_blend": alphas})
    v0 = await _answers(backend, renderer, params, 0)
    gate = Gate(backend, renderer, _same_as_v0(await _plain(backend, renderer, params)), params=params)
    record_turns(store, 2)
    await collector_for(settings, backend, store).run_once()
    trainer = Trainer(settings.training, backend, store, gate=gate)
    return trainer, v0, await trainer.step_once()


async def test_a_given_up_candidate_is_tried_blended_toward_the_base_first(tmp_path: Path):
    """gate_blend (0.9, 1e-6): the wrecked candidate is held back and given up (patience 0); its
    delta x 0.9 still answers differently and is held back too (never recorded as a version), its
    delta x 1e-6 answers as v0 does and serves, with exactly the candidate's LoRA B scaled, and
    training goes on from it."""
    from clawbridge.cli.status import version_origin
    from clawbridge.learning.trainer import BLENDS_KEY, held_candidate

    # adapters not merged into the weights: a merge rounds W + delta stochastically in bf16, so even
    # a 1e-6 delta would change answers at rounding level; added beside the base it rounds away
    async with _wrecked(tmp_path, engine_merge_adapters=False) as (settings, store, backend, renderer, params):
        trainer, v0, step = await _one_step_blending(settings, store, backend, renderer, params, (0.9, 1e-6))
        assert step is not None and step.version == 1
        assert [(d.candidate, d.decision) for d in trainer.decisions] == [(1, "rejected"), (2, "rejected"), (3, "accepted")]
        assert [g["version"] for g in store.get_meta(GATE_KEY)] == [1, 2, 3]
        assert step.served == 3 and backend.version == 3 and backend.held is None and trainer.held is None
        assert store.get_meta(BLENDS_KEY) == {"3": {"of": 1, "alpha": 1e-6}}
        assert version_origin(None, 3, {}, store.get_meta(BLENDS_KEY)) == "v1's delta x 1e-06"
        assert store.get_meta(ROLLBACKS_KEY) is None  # no copy of v0: the blend is what serves
        assert [v.version for v in store.versions()] == [1, 3]  # the held-back blend v2: never a version
        assert store.latest_version().step is None and await held_candidate(store) is None  # type: ignore[union-attr]
        assert await _answers(backend, renderer, params, 3) == v0
        assert trainer.fresh_steps == 0  # a fresh optimizer for the blend

        # the served blend's weights: v1's with every lora_B scaled, lora_A as it was
        blend = await backend.engine.trainable_state()
        await backend.rollback(1)  # v4: v1's weights, to read them
        lineage = await backend.engine.trainable_state()
        assert {k for k in blend if ".lora_B." in k} and blend.keys() == lineage.keys()
        for k, w in lineage.items():
            want = w * 1e-6 if ".lora_B." in k else w
            assert torch.allclose(blend[k], want, rtol=1e-5, atol=0), k


async def test_blends_nobody_accepts_leave_the_copy_of_the_served_weights(tmp_path: Path):
    from clawbridge.learning.trainer import BLENDS_KEY

    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        trainer, v0, step = await _one_step_blending(settings, store, backend, renderer, params, (0.9,))
        assert step is not None and [d.decision for d in trainer.decisions] == ["rejected", "rejected"]
        assert step.served == 3 and store.get_meta(ROLLBACKS_KEY) == {"3": 0} and store.get_meta(BLENDS_KEY) is None
        assert await _answers(backend, renderer, params, 3) == v0


async def test_a_restart_while_a_blend_is_judged_restores_the_served_weights(tmp_path: Path):
    """Killed while the gate judged a blend: the blend was published but never recorded, so the
    restart finds the held-back candidate newest and trains on from the served weights; the
    blend never serves."""
    from clawbridge.learning.trainer import BLENDS_KEY, held_candidate

    async with _wrecked(tmp_path, engine_merge_adapters=False) as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"gate_blend": (1e-6,)})
        v0 = await _answers(backend, renderer, params, 0)
        probes = _same_as_v0(await _plain(backend, renderer, params))
        gate = Gate(backend, renderer, probes, params=params)
        judge = gate.evaluate

        async def killed_on_the_blend(candidate: int, serving: int, **kw: Any):
            if candidate == 2:
                raise asyncio.CancelledError  # the kill, while the blend is judged
            return await judge(candidate, serving, **kw)

        gate.evaluate = killed_on_the_blend  # type: ignore[method-assign]
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        with pytest.raises(asyncio.CancelledError):
            await Trainer(settings.training, backend, store, gate=gate).step_once()
        assert backend.newest == 2 and await held_candidate(store) == (1, 0)
    async with _wrecked(tmp_path, engine_merge_adapters=False) as (_, store, backend, renderer, params):  # a restart
        await Trainer(settings.training, backend, store).resume()
        backend.serve((await held_candidate(store))[1])  # type: ignore[index]
        restarted = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        served = await restarted.judge_pending()
        assert served is not None and served > 2 and backend.version == served
        assert store.get_meta(ROLLBACKS_KEY) == {str(served): 0} and store.get_meta(BLENDS_KEY) is None
        assert await _answers(backend, renderer, params, served) == v0


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
        [decision] = trainer.decisions
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

        capped = await Gate(backend, renderer, probes, params=params, max_price=0.15).evaluate(1, 0, asked=asked)
        assert capped.decision == "rejected" and "gate_max_price" in capped.reason, capped
        assert capped.figures["probe_v0"] == 1.0 and capped.figures["probe_twin"] == 0.0
        assert capped.figures["price_points"] == 100.0 and capped.record()["asked"] == asked

        consented = await Gate(backend, renderer, probes, params=params, max_price=1.0).evaluate(1, 0, asked=asked)
        assert consented.decision == "accepted", consented
        assert consented.reference == "twin" and consented.figures["probe_candidate"] == 0.0
        assert consented.figures["probe_twin"] == 0.0 and consented.figures["price_points"] == 100.0

        strict = await Gate(backend, renderer, probes, params=params, reference="v0").evaluate(1, 0, asked=asked)
        assert strict.decision == "rejected" and strict.reference == "v0" and strict.asked is None


async def test_every_probe_is_asked_with_its_own_seed_the_same_for_every_version_and_the_twin(tmp_path: Path):
    """Paired across versions (the same seed for a probe whoever answers it), independent across
    probes (one seed for all made the whole probe one correlated draw)."""
    async with _wrecked(tmp_path) as (_settings, _store, backend, renderer, params):
        asked: list[tuple[int | None, int | None]] = []
        sample = backend.sample

        async def recorded(prompt: Any, p: SamplingParams, n: int = 1, version: int | None = None) -> Any:
            asked.append((version, p.seed))
            return await sample(prompt, p, n=n, version=version)

        backend.sample = recorded  # type: ignore[method-assign]
        probes = [GateProbe("probe", ({"role": "user", "content": q},), lambda _t, _f: 1.0) for q in PROMPTS]
        gate = Gate(backend, renderer, probes, params=params)
        await gate.scores(0)
        await gate.scores(0, asked="Answer in one short sentence.")
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
        assert await gate.general(0, "Be brief.", gate.reference_samples) == [1.0] * len(PROMPTS)
        with caplog.at_level(logging.WARNING, logger="clawbridge.learning.gate"):
            await gate.evaluate(1, 0, asked="Be brief.")
            await gate.evaluate(1, 0, asked="Be brief.")
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
        score, _ = await gate.scores(0, asked=None, samples=2)  # v0 as the gate asks it
        assert (len(seen["validation"]), len(seen["probe"])) == (3, 2)
        assert score == sum(len(t) % 2 for t in seen["validation"]) / 3
        published = await backend.publish()
        await gate.scores(published.version)  # a candidate: the gate's one answer, the probe's own three
        assert (len(seen["validation"]), len(seen["probe"])) == (6, 3)


@pytest.mark.parametrize("kept", [False, True])
async def test_a_group_that_measures_the_preference_holds_back_a_fall_the_harm_rule_cannot_show(tmp_path: Path,
                                                                                                 kept: bool):
    """The demo's validation split measures the preference itself (`GateProbe.kept`): against the
    serving version its mean decides. The wrecked candidate keeps five of six validation prompts
    (−17 points, not significant on six): the harm rule serves it, a kept group holds it back, so
    a version that keeps the preference worse than what serves does not replace it."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        plain = await _plain(backend, renderer, params)
        probes = [GateProbe("validation", ({"role": "user", "content": PROMPTS[0]},),
                            lambda text, _f: 1.0 if text == plain[0] else 0.0, kept=kept)]
        probes += [GateProbe("validation", ({"role": "user", "content": p},), lambda _t, _f: 1.0, kept=kept)
                   for p in PROMPTS[1:]]
        gate = Gate(backend, renderer, probes, params=params, margin=0.05, alpha=0.1, non_inferiority=False)
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        trainer = Trainer(settings.training, backend, store, gate=gate)
        assert await trainer.step_once() is not None
        [decision] = trainer.decisions
        assert decision.figures["validation_candidate"] == pytest.approx(5 / 6)
        assert decision.figures["validation_serving"] == 1.0 and decision.figures["validation_p_vs_serving"] > 0.1
        if kept:
            assert decision.decision == "rejected", decision
            assert "more than 5 pts below the serving version" in decision.reason, decision.reason
        else:
            assert decision.decision == "accepted", decision
