"""Hint-guided rewrites (bridge/learning/rewrite.py): which draw is kept, that the store keeps
it with its sample across a reopen, and that a corrected turn trains its rewrite beside its own
answer in one step, through the real local backend (tiny random model, rules judge, SQLite)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.judges import teacher_messages
from clawbridge.judges.prompts import INTERNAL_CONTEXT_MARKER
from clawbridge.learning.advantages import anchored, sample_advantages, scale_negatives
from clawbridge.learning.distillation import to_datums
from clawbridge.learning.rewrite import Draw, pick, question_of, without_question, write_rewrite
from clawbridge.learning.trainer import Trainer
from clawbridge.local_gpu import models
from clawbridge.store import Rewrite, Store, StoredTurn, TurnRecord
from clawbridge.types import SamplingParams
from helpers.learning import collector_for, record_priorities, record_turns, settings_for


def short_turns(store: Store, replies: list[str], first: int = 0) -> list[str]:
    """Main turns asked with max_tokens 8 (a rewrite never writes more than the turn asked for),
    each with the user's reply as its next state; sessions and questions numbered from `first`."""
    tok = models.load_tokenizer(models.resolve(models.TINY))
    renderer = Renderer(tok)
    ids = []
    for i, reply in enumerate(replies, start=first):
        messages = [{"role": "user", "content": f"Question number {i}?"}]
        completion = tuple(tok.encode(f" An answer to question {i}."))
        tid = store.record_turn(TurnRecord(
            session_id=f"s{i}", messages=messages, prompt_ids=tuple(renderer.render(messages)),
            completion_ids=completion, logprobs=tuple(-1.5 for _ in completion), version=0,
            finish_reason="stop", response={"role": "assistant", "content": f"An answer to question {i}."},
            sampling=SamplingParams(max_tokens=8, temperature=1.0),
        ))
        store.attach_next_state(tid, [{"role": "user", "content": reply}])
        ids.append(tid)
    return ids


def test_pick_surest_keeps_the_teachers_surest_draw_that_is_not_the_turns_own_answer():
    draws = [Draw((1, 2), (-2.0, -2.0)), Draw((3,), (-0.1,)), Draw((4, 5), (-0.5, -0.7)), Draw((), ())]
    assert pick(draws, rule="surest") == 1
    assert pick(draws, own=(3,), rule="surest") == 2  # the surest is what the policy already said
    assert pick([Draw((), ())], rule="surest") is None
    assert pick([Draw((7,), (-1.0,))], own=(7,), rule="surest") is None


def test_pick_lift_keeps_the_draw_the_hint_made_likeliest():
    # the teacher's model with the hint vs without: lifts 1.0, 0.1 and 1.5 per token
    ordinary = Draw((1, 2), (-0.5, -0.5), (-1.5, -1.5))
    surest = Draw((3,), (-0.1,), (-0.2,))  # the teacher is surest of it, but so is the model unhinted
    hinted = Draw((4, 5), (-1.0, -1.0), (-2.5, -2.5))
    assert [d.lift for d in (ordinary, surest, hinted)] == pytest.approx([1.0, 0.1, 1.5])
    assert pick([ordinary, surest, hinted]) == 2 and pick([ordinary, surest, hinted], rule="surest") == 1
    assert pick([ordinary, surest, hinted], own=(4, 5)) == 0
    assert Draw((1,), (-1.0,)).lift == float("-inf")  # not scored: never preferred
    assert pick([Draw((), ())]) is None


def test_a_finished_draw_is_picked_before_one_cut_at_max_tokens_whatever_their_lifts():
    # a policy that has learned to stop after one sentence gives a second sentence a low logprob;
    # the teacher's cut, two-sentence draw then had the highest lift and was trained as the
    # demonstration of a preference for less
    cut = Draw((1, 2, 3), (-1.0, -1.0, -1.0), (-3.0, -3.0, -3.0), finished=False)
    done = Draw((4, 5), (-1.0, -1.0), (-1.5, -1.5))
    assert cut.lift > done.lift
    assert pick([cut, done]) == 1 and pick([cut, done], rule="surest") == 1
    assert pick([cut]) == 0  # every usable draw was cut: the best of them


def test_a_draw_the_question_does_not_explain_is_never_picked_however_high_its_lift():
    # with the question / with it blanked: an answer is far likelier with it (3 nats in all);
    # a remark about the answer ("Your answer is too long.") is about as likely without it (0.2)
    answer = Draw((1, 2), (-1.0, -1.0), (-2.0, -2.0), (-2.5, -2.5))
    remark = Draw((3, 4), (-0.5, -0.5), (-3.0, -3.0), (-0.6, -0.6))
    assert answer.relevance == pytest.approx(3.0) and remark.relevance == pytest.approx(0.2)
    assert remark.lift > answer.lift
    assert pick([answer, remark]) == 1  # no floor: the lift alone takes the remark
    assert pick([answer, remark], min_relevance=2.0) == 0
    assert pick([remark], min_relevance=2.0) is None  # nothing usable: no rewrite at all
    assert pick([answer, remark], rule="surest", min_relevance=2.0) == 0
    assert Draw((1,), (-1.0,)).relevance == float("inf")  # not scored: no floor applies
    assert Draw((1,), (-1.0,), alone=(-1.0, -2.0)).relevance == float("-inf")  # a mis-scored draw never passes


def test_a_draw_the_hint_barely_lifted_is_never_picked_even_when_it_is_the_only_one():
    # recorded in the concise demo: once the student met the preference more often than its
    # teacher, half the teacher's picks of over 20 words had lifts below 0.3 nats a token (the
    # model's own habit), against 4 % of the short ones
    habit = Draw((1, 2, 3), (-1.0, -1.0, -1.0), (-1.1, -1.2, -1.3))  # lift 0.2
    asked = Draw((4, 5), (-1.0, -1.0), (-1.5, -1.5))  # lift 0.5
    assert habit.lift == pytest.approx(0.2) and asked.lift == pytest.approx(0.5)
    assert pick([habit, asked], min_lift=0.3) == 1
    assert pick([habit], min_lift=0.3) is None  # nothing the hint asked for: no rewrite at all
    assert pick([habit]) == 0  # no floor: the best there is
    assert pick([habit, asked], rule="surest", min_lift=0.3) == 1
    assert pick([Draw((1,), (-1.0,))], min_lift=0.3) is None  # not scored without the hint: no lift to pass
    assert pick([Draw((1,), (-1.0,))]) == 0


def test_an_echo_of_the_question_is_never_picked():
    echo = Draw((5, 6), (-0.1, -0.1), (-3.0, -3.0), echo=True)
    other = Draw((7,), (-1.0,), (-1.2,))
    assert pick([echo, other]) == 1 and pick([echo]) is None


def test_the_question_is_the_last_user_message_and_blanking_it_leaves_the_rest():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is rain?"},
                {"role": "assistant", "content": "Water falling."}, {"role": "user", "content": [
                    {"type": "text", "text": "And snow?"}]}]
    assert question_of(messages) == (3, "And snow?")
    assert question_of(messages[:2]) == (1, "What is rain?")
    assert question_of(messages[:1]) is None
    injected = [*messages, {"role": "user", "content": f"{INTERNAL_CONTEXT_MARKER} runtime context"}]
    assert question_of(injected) == (3, "And snow?")  # an agent's injected context is no question
    blank = without_question(messages, 3)
    assert blank[3] == {"role": "user", "content": ""} and blank[:3] == messages[:3]
    assert messages[3]["content"] == [{"type": "text", "text": "And snow?"}]  # the input is untouched


def test_a_rewrite_needs_one_logprob_and_one_advantage_per_token():
    with pytest.raises(ValueError, match="one logprob and one advantage per token"):
        Rewrite((1, 2), (-1.0,), (1.0, 1.0))
    with pytest.raises(ValueError):
        Rewrite((), (), ())


def test_the_store_keeps_a_rewrite_with_its_sample(data_dir: Path):
    settings = settings_for(data_dir)
    with Store.open(settings.db_url) as store:
        tid, plain = record_turns(store, 2)
        sid, _ = store.create_sample(tid, "combine", state="pending")
        n = len(store.get_turn(tid).completion_ids)
        rw = Rewrite((5, 6, 7), (-0.5, -1.25, -2.0), (1.0, 1.0, 1.0))
        store.set_sample_advantages(sid, (0.5,) * n, reward=-1.0, hint="shorter", rewrite=rw)
        other, _ = store.create_sample(plain, "combine", state="pending")
        store.set_sample_advantages(other, (1.0,) * len(store.get_turn(plain).completion_ids), reward=1.0)
    with Store.open(settings.db_url) as store:  # a new process reads the same
        s, t = store.get_samples([sid, other])
        assert s.rewrite == rw and t.rewrite is None
        own, demo = to_datums(s)
        assert own.completion_ids == s.completion_ids and own.advantages == (0.5,) * n
        assert (demo.prompt_ids, demo.completion_ids, demo.logprobs) == (s.prompt_ids, rw.ids, rw.logprobs)
        assert len(to_datums(t)) == 1
        # top-k distillation: the answer learns the teacher's distribution, and the rewrite too
        # unless opd_topk_rewrite is off (a draw the hint favours is not distilled)
        taught = to_datums(s, (9, 9))
        assert [d.teacher_prompt_ids for d in taught] == [(9, 9), (9, 9)]
        own_only = to_datums(s, (9, 9), distil_rewrite=False)
        assert [d.teacher_prompt_ids for d in own_only] == [(9, 9), None]
        assert [replace(d, teacher_prompt_ids=None) for d in own_only] == [replace(d, teacher_prompt_ids=None) for d in taught]


async def test_a_corrected_turn_trains_the_teachers_rewrite_beside_its_own_answer(data_dir: Path):
    # the tiny random model's 8-token draws answer nothing: the relevance floor is off here
    settings = settings_for(data_dir, rewrites=3, w_rewrite=0.5, batch_size=2, gate="off", rewrite_min_relevance=-1e9, rewrite_min_lift=-1e9)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        turns = short_turns(store, ["Thanks, that's perfect.", "Too long. Please answer in one short sentence."])
        collector = collector_for(settings, backend, store)
        assert await collector.run_once() == 2
        thanked, corrected = (next(s for s in store.pending_samples() if s.turn_id == t) for t in turns)
        assert thanked.hint is None and thanked.rewrite is None
        rw = corrected.rewrite
        assert corrected.hint and rw is not None
        assert rw.advantages == (0.5,) * len(rw.ids) and rw.ids != corrected.completion_ids
        assert 1 <= len(rw.ids) <= 8
        # log pi_old of the rewrite is the policy's, under the turn's own prompt (no hint)
        again = await backend.score(corrected.prompt_ids, rw.ids, model="policy", temperature=1.0)
        assert again == pytest.approx(rw.logprobs, abs=1e-4)

        result = await Trainer(settings.training, backend, store).step_once()
        assert result is not None and result.metrics["rewrites"] == 1.0
        own_tokens = sum(len(s.completion_ids) for s in (thanked, corrected))
        assert result.metrics["tokens"] == own_tokens + len(rw.ids)  # the rewrite trained too
        assert {s.state for s in store.get_samples([thanked.id, corrected.id])} == {"trained"}
    finally:
        await backend.close()
        store.close()


@pytest.mark.timeout(240)
async def test_one_pass_settles_its_turns_together_each_with_its_own_rewrite(data_dir: Path):
    """The collector settles a pass's samples concurrently (the engine batches their teacher
    draws): the backend sees more than one turn's draws in flight, and each corrected turn still
    gets a rewrite of its own, scored under its own prompt."""
    settings = settings_for(data_dir, rewrites=2, batch_size=4, gate="off", rewrite_min_relevance=-1e9, rewrite_min_lift=-1e9)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        turns = short_turns(store, ["Too long. Please answer in one short sentence."] * 4)
        collector = collector_for(settings, backend, store)
        in_flight, peak = 0, 0
        real = backend.sample

        async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await real(*args, **kwargs)
            finally:
                in_flight -= 1

        backend.sample = counted  # type: ignore[method-assign]
        assert await collector.run_once() == 4
        assert peak > 1
        samples = {s.turn_id: s for s in store.pending_samples()}
        assert set(samples) == set(turns) and len({s.id for s in samples.values()}) == 4
        for t in turns:
            s = samples[t]
            assert s.hint and s.rewrite is not None
            again = await backend.score(s.prompt_ids, s.rewrite.ids, model="policy", temperature=1.0)
            # scored alone here, beside the pass's other rewrites there: fp32 sums in another
            # order differ in the fifth significant digit (seen: 1.06e-4 at -10.76), never more
            assert again == pytest.approx(s.rewrite.logprobs, rel=1e-4, abs=1e-4)
    finally:
        await backend.close()
        store.close()


async def test_with_w_negative_0_a_correction_trains_only_its_rewrite(data_dir: Path):
    """Nothing the model said is pushed down: the corrected answer's own tokens (all negative in
    combine: r = -1) weigh 0 and leave the batch, its rewrite trains; the thanked answer trains."""
    settings = settings_for(data_dir, rewrites=2, w_negative=0.0, batch_size=2, gate="off", rewrite_min_relevance=-1e9, rewrite_min_lift=-1e9)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        turns = short_turns(store, ["Thanks, that's perfect.", "Too long. Please answer in one short sentence."])
        assert await collector_for(settings, backend, store).run_once() == 2
        thanked, corrected = (next(s for s in store.pending_samples() if s.turn_id == t) for t in turns)
        assert corrected.advantages is not None and min(corrected.advantages) >= 0.0
        assert corrected.rewrite is not None and min(thanked.advantages or (0.0,)) > 0
        own_negative_only = not any(corrected.advantages)
        datums = to_datums(corrected)
        assert datums[-1].completion_ids == corrected.rewrite.ids
        assert len(datums) == (1 if own_negative_only else 2)
        result = await Trainer(settings.training, backend, store).step_once()
        assert result is not None and result.metrics["rewrites"] == 1.0
    finally:
        await backend.close()
        store.close()


@contextlib.asynccontextmanager
async def one_corrected_turn(data_dir: Path) -> AsyncIterator[tuple[LocalBackend, Renderer, StoredTurn]]:
    """The real local backend (tiny model), its renderer, and one stored turn the user corrected."""
    settings = settings_for(data_dir, gate="off")
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        [tid] = short_turns(store, ["Too long."])
        turn = store.get_turn(tid)
        assert turn is not None
        yield backend, Renderer(backend.tokenizer()), turn
    finally:
        await backend.close()
        store.close()


async def test_the_relevance_floor_is_the_teachers_gain_from_the_question(data_dir: Path):
    """write_rewrite through the real backend: a draw's relevance is its sampling logprob minus
    the teacher's score with the question blanked, and a floor above every draw's leaves the turn
    without a rewrite."""
    async with one_corrected_turn(data_dir) as (backend, renderer, turn):
        kept = await write_rewrite(backend, renderer, turn, "Be brief.", samples=3, weight=1.0, min_relevance=-1e9)
        assert kept is not None
        assert await write_rewrite(backend, renderer, turn, "Be brief.", samples=3, weight=1.0, min_relevance=1e9) is None
        blank = renderer.render(teacher_messages(without_question(turn.messages, 0), "Be brief."))
        assert blank != renderer.render(teacher_messages(turn.messages, "Be brief."))
        alone = await backend.score(blank, kept.ids, model="base", temperature=1.0)
        assert len(alone) == len(kept.ids) and all(x <= 0 for x in alone)


async def test_the_lift_floor_leaves_a_turn_whose_draws_the_hint_did_not_lift_without_a_rewrite(data_dir: Path):
    """write_rewrite through the real backend: the floor applies to the lift as scored (with −
    without the hint, by the teacher's model), whichever rule picks."""
    async with one_corrected_turn(data_dir) as (backend, renderer, turn):
        for rule in ("lift", "surest"):
            kept = await write_rewrite(backend, renderer, turn, "Be brief.", samples=3, weight=1.0, rule=rule,
                                       min_relevance=-1e9, min_lift=-1e9)
            assert kept is not None
            assert await write_rewrite(backend, renderer, turn, "Be brief.", samples=3, weight=1.0, rule=rule,
                                       min_relevance=-1e9, min_lift=1e9) is None


async def test_the_anchor_pulls_every_trained_token_toward_the_base_model(data_dir: Path):
    """kl_anchor on the real backend: A_t -= beta * (log pi_old - log pi_base) on the turn's own
    tokens and on its rewrite's. While the policy is the base model the rewrite's anchor is
    exactly zero (the policy's logprobs are the base's: there is no KL to pull back); after one
    trained step it is not, and the stored advantages are the anchored ones, computed here from
    scores the test takes itself. It applies after w_negative, so its push-back survives w_negative 0,
    and only to samples that carry feedback: a neutral reply's turn is still dropped."""
    beta = 0.5
    settings = settings_for(data_dir, rewrites=2, w_rewrite=1.0, w_negative=0.0, batch_size=2, gate="off",
                            rewrite_min_relevance=-1e9, rewrite_min_lift=-1e9, kl_anchor=beta, learning_rate=1e-2)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        replies = ["Thanks, that's perfect.", "Too long. Please answer in one short sentence."]
        collector = collector_for(settings, backend, store)
        short_turns(store, replies)
        assert await collector.run_once() == 2
        [first] = [s for s in store.pending_samples() if s.rewrite is not None]
        assert first.rewrite is not None and first.rewrite.advantages == pytest.approx((1.0,) * len(first.rewrite.ids), abs=1e-4)
        assert await Trainer(settings.training, backend, store).step_once() is not None

        thanked_id, corrected_id, neutral_id = short_turns(store, [*replies, "ok"], first=2)
        assert await collector.run_once() == 3
        assert neutral_id not in {s.turn_id for s in store.pending_samples()}  # no feedback: dropped, anchor or not
        thanked, corrected = (next(s for s in store.pending_samples() if s.turn_id == t) for t in (thanked_id, corrected_id))
        rw = corrected.rewrite
        assert rw is not None
        base = await backend.score(corrected.prompt_ids, rw.ids, model="base", temperature=1.0)
        assert rw.advantages == pytest.approx(anchored((1.0,) * len(rw.ids), rw.logprobs, base, beta), abs=1e-4)
        assert max(abs(a - 1.0) for a in rw.advantages) > 1e-3  # the trained policy moved: the anchor acts

        base = await backend.score(thanked.prompt_ids, thanked.completion_ids, model="base", temperature=1.0)
        plain = sample_advantages("combine", 1.0, False, None, thanked.logprobs)
        assert plain is not None and thanked.advantages is not None
        assert thanked.advantages == pytest.approx(anchored(plain, thanked.logprobs, base, beta), abs=1e-4)
        assert min(thanked.advantages) < 0  # pushed back past zero, and kept: w_negative 0 scales feedback only

        # the corrected answer's own tokens: anchored only when feedback left them an advantage
        own = scale_negatives(sample_advantages("combine", -1.0, True, corrected.teacher_logprobs,
                                                corrected.logprobs) or (), 0.0)
        base = await backend.score(corrected.prompt_ids, corrected.completion_ids, model="base", temperature=1.0)
        want = anchored(own, corrected.logprobs, base, beta) if any(own) else (0.0,) * len(corrected.completion_ids)
        assert corrected.advantages == pytest.approx(want, abs=1e-4)
    finally:
        await backend.close()
        store.close()


async def test_the_lift_is_scored_by_the_teachers_model_and_only_the_kept_draw_by_the_policy(data_dir: Path):
    """write_rewrite through the real backend, its `score` calls recorded: every usable draw is
    scored under the turn's own prompt by the teacher's model (the base), and the policy scores
    the kept draw alone, whose scores are the rewrite's old logprobs."""
    settings = settings_for(data_dir, gate="off")
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    calls: list[tuple[tuple[int, ...], tuple[int, ...], str]] = []
    real_score = backend.score

    async def recorded(prompt_ids, completion_ids, *, model="policy", temperature=1.0):  # type: ignore[no-untyped-def]
        calls.append((tuple(prompt_ids), tuple(completion_ids), model))
        return await real_score(prompt_ids, completion_ids, model=model, temperature=temperature)

    backend.score = recorded  # type: ignore[method-assign]
    priorities = record_priorities(backend)
    try:
        [tid] = short_turns(store, ["Too long."])
        turn = store.get_turn(tid)
        assert turn is not None
        kept = await write_rewrite(backend, Renderer(backend.tokenizer()), turn, "Be brief.", samples=3, weight=1.0)
        assert kept is not None
        assert priorities == ["background"]  # the teacher's draws wait behind a user's request
        own = [c for c in calls if c[0] == tuple(turn.prompt_ids)]
        *lift, last = own
        assert lift and {m for *_, m in lift} == {"base"} and kept.ids in {ids for _, ids, _ in lift}
        assert last == (tuple(turn.prompt_ids), kept.ids, "policy")
    finally:
        await backend.close()
        store.close()


async def test_draws_cut_at_max_tokens_are_scored_only_when_no_finished_draw_passes(data_dir: Path):
    """write_rewrite through the real backend, the teacher's draws relabelled as they come back
    (the tiny model's 8-token draws are all cut): with one finished draw among cut ones only it is
    scored and kept, as `pick` keeps a finished draw over any cut one; when its lift is below the
    floor the cut draws are scored, and the kept one is what `pick` chooses among them."""
    async with one_corrected_turn(data_dir) as (backend, renderer, turn):
        finished: set[int] = set()  # which draw of each `sample` call comes back as having ended by itself
        real_sample, real_score = backend.sample, backend.score
        scored_ids: list[tuple[int, ...]] = []

        async def relabelled(prompt_ids, params, *, n=1, version=None, priority="user"):  # type: ignore[no-untyped-def]
            got = await real_sample(prompt_ids, params, n=n, version=version, priority=priority)
            return [replace(c, finish_reason="stop" if i in finished else "length") for i, c in enumerate(got)]

        async def recorded(prompt_ids, completion_ids, *, model="policy", temperature=1.0):  # type: ignore[no-untyped-def]
            if model == "base":
                scored_ids.append(tuple(completion_ids))
            return await real_score(prompt_ids, completion_ids, model=model, temperature=temperature)

        backend.sample, backend.score = relabelled, recorded  # type: ignore[method-assign]
        finished.add(1)
        kept = await write_rewrite(backend, renderer, turn, "Be brief.", samples=4, weight=1.0,
                                   min_relevance=-1e9, min_lift=-1e9)
        assert kept is not None and len(set(scored_ids)) == 1 and kept.ids == scored_ids[0]
        assert len(scored_ids) == 2  # its relevance and its lift, nothing else

        scored_ids.clear()
        kept = await write_rewrite(backend, renderer, turn, "Be brief.", samples=4, weight=1.0,
                                   min_relevance=-1e9, min_lift=1e9)  # no lift passes: nothing kept ...
        assert kept is None and len(set(scored_ids)) == 4  # ... after every draw, finished and cut, was scored

        finished.clear()
        scored_ids.clear()
        kept = await write_rewrite(backend, renderer, turn, "Be brief.", samples=4, weight=1.0,
                                   min_relevance=-1e9, min_lift=-1e9)
        assert kept is not None and len(set(scored_ids)) == 4 and kept.ids in set(scored_ids)
