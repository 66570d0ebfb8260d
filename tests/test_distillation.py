"""What one sample trains (`learning.distillation`): its own answer as a datum, and with top-k
distillation the teacher's prompt on a hinted sample's datums, fresh draws of the trained policy
beside the batch and the lift filter on them; backends whose loss cannot see the teacher refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.judges import Teacher
from clawbridge.learning.distillation import to_datum, to_datums
from clawbridge.learning.trainer import Trainer
from clawbridge.store import Sample, Store, StoredTurn
from helpers.learning import record_priorities, record_turns, settings_for


def test_a_sample_without_advantages_cannot_become_a_datum(data_dir: Path):
    settings = settings_for(data_dir)
    with Store.open(settings.db_url) as store:
        [tid] = record_turns(store, 1)
        sid, _ = store.create_sample(tid, "combine", state="pending")
        [s] = store.get_samples([sid])
        with pytest.raises(ValueError, match="no advantages"):
            to_datum(s)


def hinted_and_approved(store: Store) -> None:
    """Two judged samples: a corrected turn with a hint (its own answer's advantages all zero, as
    with w_negative 0) and an approved one."""
    from helpers.learning import record_turns

    hinted_turn, plain_turn = record_turns(store, 2)
    n = len(store.get_turn(hinted_turn).completion_ids)  # type: ignore[union-attr]
    store.create_sample(hinted_turn, "combine", reward=-1.0, hint="Answer in one word.", advantages=(0.0,) * n)
    m = len(store.get_turn(plain_turn).completion_ids)  # type: ignore[union-attr]
    store.create_sample(plain_turn, "combine", reward=1.0, advantages=(1.0,) * m)


def the_hinted(store: Store) -> tuple[Sample, StoredTurn]:
    """`hinted_and_approved`'s hinted sample, waiting to train, and its turn."""
    [hinted] = [x for x in store.pending_samples(2, method="combine") if x.hint]
    turn = store.get_turn(hinted.turn_id)
    assert turn is not None
    return hinted, turn


async def test_the_trainer_distils_hinted_samples_with_the_collectors_teacher_prompt(data_dir: Path):
    """A hinted sample's datums carry the teacher prompt the collector scored with (the turn's
    prompt with the hint); an approved one's carry none; the step reports the term."""
    from clawbridge.chat.renderer import Renderer
    from clawbridge.learning.collector import turn_context

    settings = settings_for(data_dir, batch_size=2, opd_topk=8)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        hinted_and_approved(store)
        teacher = Teacher(backend, Renderer(backend.tokenizer()))
        trainer = Trainer(settings.training, backend, store, teacher=teacher)
        hinted, plain = sorted(store.pending_samples(2, method="combine"), key=lambda x: x.hint is None)
        want = teacher.prompt_ids(turn_context(store.get_turn(hinted.turn_id)), "Answer in one word.")  # type: ignore[arg-type]
        # an all-zero own answer trains only because it is distilled
        assert [d.teacher_prompt_ids for d in await trainer.distillation.datums(hinted)] == [tuple(want)]
        assert [d.teacher_prompt_ids for d in await trainer.distillation.datums(plain)] == [None]
        assert await trainer.distillation.datums(plain) == to_datums(plain)
        result = await trainer.step_once()
        assert result is not None and result.metrics["topk_kl"] > 0
        assert result.metrics["samples"] == 2  # the hinted answer (distilled) and the approved one
    finally:
        await backend.close()
        store.close()


async def test_a_rewrite_learns_the_teachers_distribution_only_with_opd_topk_rewrite(data_dir: Path):
    """The trainer's setting reaches the datums: the hinted answer is distilled either way, its
    rewrite (a draw the hint favours) only with opd_topk_rewrite on, the default."""
    from clawbridge.chat.renderer import Renderer
    from clawbridge.store import Rewrite
    from helpers.learning import record_turns

    settings = settings_for(data_dir, batch_size=2, opd_topk=8)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        [tid] = record_turns(store, 1)
        n = len(store.get_turn(tid).completion_ids)  # type: ignore[union-attr]
        sid, _ = store.create_sample(tid, "combine", state="pending")
        store.set_sample_advantages(sid, (0.0,) * n, reward=-1.0, hint="Answer in one word.",
                                    rewrite=Rewrite((5, 6), (-1.0, -2.0), (1.0, 1.0)))
        [sample] = store.pending_samples(1, method="combine")
        teacher = Teacher(backend, Renderer(backend.tokenizer()))
        taught = {}
        for on in (True, False):
            trainer = Trainer(settings.training.model_copy(update={"opd_topk_rewrite": on}), backend, store, teacher=teacher)
            taught[on] = [d.teacher_prompt_ids for d in await trainer.distillation.datums(sample)]
        want = tuple(trainer.distillation.teacher_prompt(store.get_turn(tid), "Answer in one word."))  # type: ignore[arg-type]
        assert taught == {True: [want, want], False: [want, None]}
    finally:
        await backend.close()
        store.close()


async def test_fresh_draws_of_the_trained_policy_are_distilled_beside_the_batch(data_dir: Path):
    """opd_draws 3: the hinted sample brings three fresh answers of the newest weights, drawn at
    the turn's settings, each with the teacher prompt and no advantage of its own."""
    from clawbridge.chat.renderer import Renderer

    settings = settings_for(data_dir, batch_size=2, opd_topk=8, opd_draws=3)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    with pytest.raises(ValueError, match="opd_draws needs opd_topk"):
        Trainer(settings_for(data_dir, opd_draws=3).training, backend, store)
    await backend.start()
    try:
        hinted_and_approved(store)
        trainer = Trainer(settings.training, backend, store, teacher=Teacher(backend, Renderer(backend.tokenizer())))
        hinted, turn = the_hinted(store)
        teacher_ids = trainer.distillation.teacher_prompt(turn, "Answer in one word.")
        priorities = record_priorities(backend)
        [own, *drawn] = await trainer.distillation.datums(hinted)
        assert priorities == ["background"]  # fresh draws wait behind a user's request
        assert own == to_datums(hinted, teacher_ids)[0]
        assert len(drawn) == 3 and all(d.teacher_prompt_ids == tuple(teacher_ids) for d in drawn)
        assert all(set(d.advantages) == {0.0} and d.prompt_ids == hinted.prompt_ids for d in drawn)
        assert all(len(d.completion_ids) <= turn.sampling.max_tokens for d in drawn)
        result = await trainer.step_once()
        assert result is not None and result.metrics["samples"] == 2 + 3
    finally:
        await backend.close()
        store.close()


async def test_only_the_fresh_draws_the_hint_does_not_lift_are_distilled(data_dir: Path):
    """opd_draw_max_lift: a fresh draw distils only when its lift (the teacher's model with the
    hint minus without it, mean per token, scored here independently) is at most the bound; the
    bound set between the draws' own lifts keeps exactly those at or below it, and a bound below
    every lift sends none."""

    from clawbridge.chat.renderer import Renderer
    from clawbridge.learning.rewrite import redraw_params

    settings = settings_for(data_dir, batch_size=2, opd_topk=8, opd_draws=3)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        hinted_and_approved(store)
        teacher = Teacher(backend, Renderer(backend.tokenizer()))
        hinted, turn = the_hinted(store)
        params = redraw_params(turn)
        drawn = [c for c in await backend.sample(hinted.prompt_ids, params, n=6) if c.tokens]
        t_ids = Trainer(settings.training, backend, store, teacher=teacher).distillation.teacher_prompt(turn, "Answer in one word.")

        async def lift(tokens: list[int]) -> float:
            with_hint = await backend.score(t_ids, tokens, model="base", temperature=params.temperature)
            without = await backend.score(hinted.prompt_ids, tokens, model="base", temperature=params.temperature)
            return sum(a - b for a, b in zip(with_hint, without, strict=True)) / len(tokens)

        lifts = [await lift(c.tokens) for c in drawn]
        assert len(set(lifts)) > 2, "the draws should differ in lift"
        ordered = sorted(lifts)
        half = len(ordered) // 2
        bound = (ordered[half - 1] + ordered[half]) / 2  # between two draws, clear of rounding
        trainer = Trainer(settings.training, backend, store, teacher=teacher)
        kept = await trainer.distillation.drop_lifted(drawn, hinted.prompt_ids, t_ids, params.temperature, bound)
        assert kept == [c for c, x in zip(drawn, lifts, strict=True) if x <= bound]
        assert 0 < len(kept) < len(drawn)
        none = Trainer(settings.training.model_copy(update={"opd_draw_max_lift": -1e9}), backend, store, teacher=teacher)
        assert [d.completion_ids for d in await none.distillation.datums(hinted)] == [hinted.completion_ids]
    finally:
        await backend.close()
        store.close()


def test_a_backend_whose_loss_cannot_see_the_teacher_is_refused_at_start(data_dir: Path, tokenizer):
    from clawbridge.backends.tinker import TinkerBackend
    from fakes.fake_tinker import FakeTinkerService

    settings = settings_for(data_dir, opd_topk=20)
    store = Store.open(settings.db_url)
    try:
        tinker = TinkerBackend(service_client=FakeTinkerService(), base_model="Qwen/Qwen3-4B-Instruct-2507",
                               tokenizer=tokenizer)
        with pytest.raises(ValueError, match="tinker backend cannot distil"):
            Trainer(settings.training, tinker, store)
    finally:
        store.close()


async def test_the_learners_draws_stop_at_redraw_max_tokens(data_dir: Path):
    """`redraw_max_tokens`: a fresh draw (and a rewrite's teacher draw: both take `redraw_params`)
    stops there, where the turn's own budget would let it run on; 0 keeps the turn's budget."""
    from clawbridge.chat.renderer import Renderer
    from clawbridge.learning.rewrite import redraw_params

    settings = settings_for(data_dir, batch_size=2, opd_topk=8, opd_draws=4, opd_draw_max_lift=None)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        hinted_and_approved(store)
        teacher = Teacher(backend, Renderer(backend.tokenizer()))
        hinted, turn = the_hinted(store)
        own = redraw_params(turn).max_tokens
        assert redraw_params(turn, 3).max_tokens == 3 and redraw_params(turn, 10 * own).max_tokens == own
        trainer = Trainer(settings.training, backend, store, teacher=teacher, redraw_max_tokens=3)
        t_ids = trainer.distillation.teacher_prompt(turn, hinted.hint)
        drawn = await trainer.distillation.fresh_draws(hinted, turn, t_ids)
        assert len(drawn) == 4 and max(len(d.completion_ids) for d in drawn) == 3
    finally:
        await backend.close()
        store.close()
