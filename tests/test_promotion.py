"""What serves after a candidate is published, on the real engine path (tiny random model, the
gate on): patience and the held lineage, blends before giving a candidate up, a rollback during
a held lineage, and a restart that interrupted the gate's work (a candidate never judged, a held
lineage, a blend being judged) settled before training goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.learning.gate import Gate, GateProbe
from clawbridge.learning.promotion import (
    Interrupted,
    interrupted,
    pin_interrupted,
    resume,
)
from clawbridge.learning.trainer import Trainer
from clawbridge.store import Store
from clawbridge.types import SamplingParams
from helpers.gate import PROMPTS, _answers, _as_gate, _plain, _wrecked
from helpers.learning import collector_for, record_turns


async def test_a_candidate_the_gate_never_judged_is_judged_after_a_restart(tmp_path: Path):
    """A process killed while the gate judged leaves a recorded candidate with no decision; the
    restarted learner judges it before training on, so no version serves ungated."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        v0 = await _answers(backend, renderer, params, 0)
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        # the step publishes and records v1; the gate's decision never comes (the kill)
        assert (await Trainer(settings.training, backend, store).step_once()).version == 1  # type: ignore[union-attr]
        assert await interrupted(store, gated=True) == Interrupted(1, 0, decided=False)

        plain = [renderer.parse(
            (await backend.sample(renderer.render([{"role": "user", "content": p}]), _as_gate(params, p), version=0))[0].tokens,
            "length").content or "" for p in PROMPTS]
        probes = [GateProbe("validation", ({"role": "user", "content": p},),
                            lambda text, _finish, want=want: 1.0 if text == want else 0.0)
                  for p, want in zip(PROMPTS, plain, strict=True)]
        restarted = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert await restarted.promotion.recover() == 2  # rejected: a copy of v0 serves as v2
        assert [g.decision for g in store.history().decisions] == ["rejected"]
        assert await interrupted(store, gated=True) is None and backend.held is None
        assert await _answers(backend, renderer, params, 2) == v0
        assert await restarted.promotion.recover() is None  # decided once: nothing pending


def _same_as_v0(plain: list[str]) -> list[GateProbe]:
    return [GateProbe("validation", ({"role": "user", "content": p},),
                      lambda text, _finish, want=want: 1.0 if text == want else 0.0)
            for p, want in zip(PROMPTS, plain, strict=True)]


async def _patient(settings: Any, store: Store, backend: LocalBackend, renderer: Renderer,
                   params: SamplingParams) -> tuple[Any, list[str], list[GateProbe]]:
    """gate_patience 3 on the wrecked setup, two judged samples waiting: the settings, v0's
    answers, and probes that count any change from v0 as worse."""
    settings = settings.model_copy(update={"training": settings.training.model_copy(update={"gate_patience": 3})})
    v0 = await _answers(backend, renderer, params, 0)
    probes = _same_as_v0(await _plain(backend, renderer, params))
    record_turns(store, 2)
    await collector_for(settings, backend, store).run_once()
    return settings, v0, probes


async def test_with_patience_training_goes_on_from_a_held_back_candidate(tmp_path: Path):
    """gate_patience 1: the first held-back candidate stays the training lineage while v0 keeps
    serving (no copy); the second in a row restarts from v0's weights with a fresh optimizer."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"training": settings.training.model_copy(update={"gate_patience": 1, "max_staleness": 100})})
        v0 = await _answers(backend, renderer, params, 0)
        gate = Gate(backend, renderer, _same_as_v0(await _plain(backend, renderer, params)), params=params)
        record_turns(store, 6)  # "ok" is neutral: two of every three replies give a sample
        await collector_for(settings, backend, store).run_once()
        assert len(store.pending_samples(10, method="combine")) == 4
        trainer = Trainer(settings.training, backend, store, gate=gate)
        first = await trainer.step_once()
        assert first is not None and first.version == 1 and first.served == 0
        assert backend.held == 0 and backend.version == 0 and backend.newest == 1  # v0 serves; v1 is the lineage
        assert store.history().copies == {} and await interrupted(store, gated=True) == Interrupted(1, 0, decided=True)
        assert await _answers(backend, renderer, params, backend.version) == v0
        assert trainer.optimizer.steps == 1  # the lineage's optimizer goes on

        second = await trainer.step_once()
        assert second is not None and second.version == 2 and trainer.promotion.decisions[-1].decision == "rejected"
        assert trainer.promotion.decisions[-1].serving == 0  # judged against what serves, not against the lineage
        # the second hold-back in a row restarts from the served weights
        assert second.served == 3 and backend.held is None and store.history().copies == {3: 0}
        assert trainer.optimizer.steps == 0 and await interrupted(store, gated=True) is None
        assert await _answers(backend, renderer, params, 3) == v0


async def test_a_candidate_with_a_full_batch_behind_it_is_trained_on_unjudged(tmp_path: Path):
    """gate_every 3: while a full batch waits, the step's candidate is trained on without a
    judgement (v0 serves, patience unspent); once the learner has caught up, the newest is judged.
    A restart after an unjudged candidate judges it before training goes on."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"training": settings.training.model_copy(
            update={"gate_every": 3, "gate_patience": 3, "max_staleness": 100})})
        probes = _same_as_v0(await _plain(backend, renderer, params))
        record_turns(store, 6)
        await collector_for(settings, backend, store).run_once()
        assert len(store.pending_samples(10, method="combine")) == 4  # two batches of two
        trainer = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        first = await trainer.step_once()
        assert first is not None and (first.version, first.served) == (1, 0)
        assert trainer.promotion.decisions == [] and not store.history().decisions  # not judged
        assert (backend.held, backend.version, backend.newest) == (0, 0, 1)
        assert trainer.promotion.held_back_in_a_row == 0 and trainer.optimizer.steps == 1  # the lineage goes on
        assert await interrupted(store, gated=True) == Interrupted(1, 0, decided=False)

        second = await trainer.step_once()  # nothing waits behind it: judged
        assert second is not None and second.version == 2
        assert [(d.candidate, d.serving, d.decision) for d in trainer.promotion.decisions] == [(2, 0, "rejected")]
        assert trainer.promotion.held_back_in_a_row == 1 and trainer.promotion.unjudged == 0

    async with _wrecked(tmp_path / "restart") as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"training": settings.training.model_copy(
            update={"gate_every": 3, "max_staleness": 100})})
        probes = _same_as_v0(await _plain(backend, renderer, params))
        record_turns(store, 6)
        await collector_for(settings, backend, store).run_once()
        assert (await Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
                .step_once()).served == 0  # type: ignore[union-attr]
        restarted = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert await restarted.promotion.recover() == 2  # v1 judged now: rejected, a copy of v0 serves
        assert [(g.candidate, g.decision) for g in store.history().decisions] == [(1, "rejected")]


async def test_a_backlog_drawn_by_the_served_version_stays_fresh_when_a_trained_on_candidate_serves(tmp_path: Path):
    """Staleness counts the versions that served: max_staleness 1, v1 trained on unjudged, v2
    accepted; the batch still waiting was drawn by v0, one serving ago, and trains (counted in
    version numbers it would be two behind, and dropped)."""
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"training": settings.training.model_copy(
            update={"gate_every": 2, "max_staleness": 1})})
        accept_all = [GateProbe("validation", ({"role": "user", "content": p},), lambda _t, _f: 1.0) for p in PROMPTS]
        record_turns(store, 9)
        await collector_for(settings, backend, store).run_once()
        assert len(store.pending_samples(10, method="combine")) == 6  # three batches of two
        trainer = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, accept_all, params=params))
        assert (await trainer.step_once()).served == 0  # type: ignore[union-attr]  # unjudged
        assert (await trainer.step_once()).served == 2  # type: ignore[union-attr]  # judged, accepted
        third = await trainer.step_once()
        assert third is not None and third.samples == 2 and trainer.dropped_stale == 0


def test_staleness_counts_the_versions_that_served():
    from clawbridge.learning.trainer import oldest_fresh
    from clawbridge.store import GateRecord, History

    def decided(candidate: int, decision: str) -> GateRecord:
        return GateRecord(candidate=candidate, serving=0, decision=decision, reason="")

    history = History(decisions=(decided(3, "rejected"), decided(6, "accepted"), decided(9, "accepted")),
                      copies={10: 6})
    assert history.served(10) == [0, 6, 9, 10]
    assert history.served(6) == [0, 6]  # what served later does not count yet
    assert [oldest_fresh([0, 6, 9, 10], k) for k in (0, 1, 2, 3, 4)] == [10, 9, 6, 0, 0]
    assert oldest_fresh([0], 0) == 0


async def test_with_gate_every_1_every_candidate_is_judged_even_with_a_batch_waiting(tmp_path: Path):
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"training": settings.training.model_copy(
            update={"gate_patience": 3, "max_staleness": 100})})
        assert settings.training.gate_every == 1
        probes = _same_as_v0(await _plain(backend, renderer, params))
        record_turns(store, 6)
        await collector_for(settings, backend, store).run_once()
        trainer = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert (await trainer.step_once()).served == 0  # type: ignore[union-attr]
        assert [d.candidate for d in trainer.promotion.decisions] == [1]


async def test_a_rollback_while_training_goes_on_from_a_held_back_candidate_serves_the_copy(tmp_path: Path):
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings, v0, probes = await _patient(settings, store, backend, renderer, params)
        trainer = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert (await trainer.step_once()).served == 0 and backend.held == 0  # type: ignore[union-attr]
        rb = await trainer.promotion.rollback(0)
        assert (rb.version, backend.version, backend.held, trainer.promotion.held) == (2, 2, None, None)
        assert store.history().copies == {2: 0}
        assert await _answers(backend, renderer, params, backend.version) == v0


async def test_a_restart_while_training_goes_on_from_a_held_back_candidate_serves_and_restores_the_served(
        tmp_path: Path):
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        settings, v0, probes = await _patient(settings, store, backend, renderer, params)
        first = await Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params)).step_once()
        assert first is not None and first.served == 0 and await interrupted(store, gated=True) == Interrupted(1, 0, decided=True)
    async with _wrecked(tmp_path) as (_, store, backend, renderer, params):  # the same data dir: a restart
        await resume(backend, store)  # as serve() does before the first request
        assert await pin_interrupted(backend, store) == Interrupted(1, 0, decided=True)  # and pins what served
        assert backend.version == 0
        restarted = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        assert await restarted.promotion.recover() == 2 and backend.held is None and backend.version == 2
        assert store.history().copies == {2: 0} and await interrupted(store, gated=True) is None
        assert await _answers(backend, renderer, params, 2) == v0


async def _one_step_blending(settings: Any, store: Store, backend: LocalBackend, renderer: Renderer,
                             params: SamplingParams, alphas: tuple[float, ...]) -> tuple[Trainer, list[str], Any]:
    """One wrecking step with `gate_blend` alphas and probes that count any change from v0 as
    worse: the trainer, v0's answers and the step's result."""
    settings = settings.model_copy(update={"training": settings.training.model_copy(update={"gate_blend": alphas})})
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
    # adapters not merged into the weights: a merge rounds W + delta stochastically in bf16, so even
    # a 1e-6 delta would change answers at rounding level; added beside the base it rounds away
    async with _wrecked(tmp_path, engine_merge_adapters=False) as (settings, store, backend, renderer, params):
        trainer, v0, step = await _one_step_blending(settings, store, backend, renderer, params, (0.9, 1e-6))
        assert step is not None and step.version == 1
        assert [(d.candidate, d.decision) for d in trainer.promotion.decisions] == [(1, "rejected"), (2, "rejected"), (3, "accepted")]
        assert [g.candidate for g in store.history().decisions] == [1, 2, 3]
        assert step.served == 3 and backend.version == 3 and backend.held is None and trainer.promotion.held is None
        assert store.history().blends == {3: (1, 1e-6)}
        assert version_origin(store.versions()[-1]) == "v1's delta x 1e-06"
        assert store.history().copies == {}  # no copy of v0: the blend is what serves
        assert [v.version for v in store.versions()] == [1, 3]  # the held-back blend v2: never a version
        assert store.latest_version().step is None and await interrupted(store, gated=True) is None  # type: ignore[union-attr]
        assert await _answers(backend, renderer, params, 3) == v0
        assert trainer.optimizer.steps == 0  # a fresh optimizer for the blend

        # the served blend's weights: v1's with every lora_B scaled, lora_A as it was
        blend = await backend.engine.trainable_state()
        await backend.rollback(1)  # v4: v1's weights, to read them
        lineage = await backend.engine.trainable_state()
        assert {k for k in blend if ".lora_B." in k} and blend.keys() == lineage.keys()
        for k, w in lineage.items():
            want = w * 1e-6 if ".lora_B." in k else w
            assert torch.allclose(blend[k], want, rtol=1e-5, atol=0), k


async def test_blends_nobody_accepts_leave_the_copy_of_the_served_weights(tmp_path: Path):
    async with _wrecked(tmp_path) as (settings, store, backend, renderer, params):
        trainer, v0, step = await _one_step_blending(settings, store, backend, renderer, params, (0.9,))
        assert step is not None and [d.decision for d in trainer.promotion.decisions] == ["rejected", "rejected"]
        assert step.served == 3 and store.history().copies == {3: 0} and store.history().blends == {}
        assert await _answers(backend, renderer, params, 3) == v0


async def test_a_restart_while_a_blend_is_judged_restores_the_served_weights(tmp_path: Path):
    """Killed while the gate judged a blend: the blend was published but never recorded, so the
    restart finds the held-back candidate newest and trains on from the served weights; the
    blend never serves."""
    async with _wrecked(tmp_path, engine_merge_adapters=False) as (settings, store, backend, renderer, params):
        settings = settings.model_copy(update={"training": settings.training.model_copy(update={"gate_blend": (1e-6,)})})
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
        assert backend.newest == 2 and await interrupted(store, gated=True) == Interrupted(1, 0, decided=True)
    async with _wrecked(tmp_path, engine_merge_adapters=False) as (_, store, backend, renderer, params):  # a restart
        await resume(backend, store)
        await pin_interrupted(backend, store)
        restarted = Trainer(settings.training, backend, store, gate=Gate(backend, renderer, probes, params=params))
        served = await restarted.promotion.recover()
        assert served is not None and served > 2 and backend.version == served
        assert store.history().copies == {served: 0} and store.history().blends == {}
        assert await _answers(backend, renderer, params, served) == v0


async def test_a_candidate_pinned_at_a_restart_serves_when_the_gate_has_nothing_to_ask(tmp_path: Path):
    """gate on, but no probes and no judge model (the rules judge): the composition root builds no
    gate. A candidate never judged was pinned behind its predecessor before the first request;
    with nothing to judge it, the learner lets it serve, as without a gate, instead of pinning
    the predecessor for ever."""
    from clawbridge.server import build_learning

    async with _wrecked(tmp_path) as (settings, store, backend, renderer, _params):
        record_turns(store, 2)
        await collector_for(settings, backend, store).run_once()
        assert (await Trainer(settings.training, backend, store).step_once()).version == 1  # type: ignore[union-attr]
        await resume(backend, store)  # as serve() does before the first request
        assert await pin_interrupted(backend, store) == Interrupted(1, 0, decided=False) and backend.version == 0
        trainer = build_learning(settings, backend, store, renderer).trainer
        assert trainer.promotion.gate is None
        assert await trainer.promotion.recover() == 1
        assert backend.held is None and backend.version == 1
