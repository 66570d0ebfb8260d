"""Baking an applied preference into the weights (bridge/learning/baking.py, docs/methods.md#the-weights-later)."""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import UTC, datetime

import pytest
from clawbridge.learning.baking import LOSS_MARGIN, MIN_LIFT, Kept, carried, lost, retired, verdict
from clawbridge.store import Preference, Store


def test_the_share_is_how_far_the_weights_came_from_the_base_to_the_twin():
    # two answers, 2 + 1 tokens: the twin likes them 0.3 nats a token more than the base does
    base_without = [[-1.0, -2.0], [-0.5]]
    base_with = [[-0.7, -1.7], [-0.2]]
    c = carried(base_with, base_without, base_without)  # the base itself: nothing carried
    assert c.lift == pytest.approx(0.3) and c.carried == pytest.approx(0.0) and c.share == pytest.approx(0.0)
    c = carried(base_with, base_without, base_with)  # weights that answer alone as the twin asked does
    assert c.share == pytest.approx(1.0) and (c.tokens, c.turns) == (3, 2)
    half = [[-0.85, -1.85], [-0.35]]
    assert carried(base_with, base_without, half).share == pytest.approx(0.5)
    # share = 1 - KL(twin || version) / KL(twin || base), token-averaged on the twin's answers
    kl_twin_base = sum(sum(a) - sum(b) for a, b in zip(base_with, base_without, strict=True)) / 3
    kl_twin_half = sum(sum(a) - sum(b) for a, b in zip(base_with, half, strict=True)) / 3
    assert carried(base_with, base_without, half).share == pytest.approx(1 - kl_twin_half / kl_twin_base)


def test_an_instruction_that_hardly_moves_its_answers_is_not_measured():
    tiny = MIN_LIFT / 2
    c = carried([[-1.0 + tiny]], [[-1.0]], [[0.0]])
    assert c.share is None
    assert verdict(None, learned=False, retire_share=0.8, restore_share=0.5) is False
    assert verdict(None, learned=True, retire_share=0.8, restore_share=0.5) is True
    assert carried([], [], []).share is None


def test_mismatched_scores_are_refused():
    with pytest.raises(ValueError):
        carried([[-1.0, -1.0]], [[-1.0]], [[-1.0]])


def test_retired_at_the_retire_share_and_back_only_below_the_restore_share():
    assert verdict(0.79, learned=False, retire_share=0.8, restore_share=0.5) is False
    assert verdict(0.8, learned=False, retire_share=0.8, restore_share=0.5) is True
    # between the two a learned preference stays learned and an applied one stays applied: no flapping
    assert verdict(0.6, learned=True, retire_share=0.8, restore_share=0.5) is True
    assert verdict(0.6, learned=False, retire_share=0.8, restore_share=0.5) is False
    assert verdict(0.49, learned=True, retire_share=0.8, restore_share=0.5) is False


def test_a_learned_preference_is_lost_only_when_clearly_less_is_carried():
    """Paired on the serving version's answers, a candidate is held back only past the margin,
    and never on what could not be measured."""
    kept = Kept(9, (), 0.86)
    assert lost(kept, 0.68)  # the serving version carried 0.86, the candidate 0.68: more than 0.1 less
    assert not lost(kept, 0.86 - LOSS_MARGIN + 0.01)  # within the margin
    assert not lost(kept, 0.95)  # carries more
    assert not lost(kept, None) and not lost(None, 0.1)  # nothing to pair with


def test_retired_changes_only_what_was_measured_and_leaves_a_dropped_one_alone():
    now = datetime(2026, 11, 28, tzinfo=UTC)
    known = [
        Preference("Answer in one sentence.", 3, ("a", "b", "c"), 0, id=1, state="applied", kind="length"),
        Preference("Use bullet points.", 2, ("d", "e"), 0, id=2, state="learned", kind="format", learned_version=3),
        Preference("Reply in French.", 2, ("f", "g"), 0, id=3, state="dropped", kind="language"),
    ]
    out = retired(known, {1: True, 2: False, 3: True}, 5, now)
    assert (out[0].state, out[0].learned_version, out[0].state_at) == ("learned", 5, now)
    assert (out[1].state, out[1].learned_version) == ("applied", None)
    assert out[2] == known[2]  # the user dropped it meanwhile: a measurement never brings it back


# --- on the real engine path (tiny random model) --------------------------------------------------

INSTRUCTION = "Answer in one short sentence."


async def _instructed_turns(backend, renderer, store, n: int, reply: str = "ok", first: int = 0) -> list[str]:
    """n turns served under INSTRUCTION as the proxy serves them: the prompt rendered with it, the
    answer sampled there with its logprobs, the client's messages and the instruction recorded."""
    from clawbridge.chat.instructions import instructed
    from clawbridge.store import TurnRecord
    from clawbridge.types import SamplingParams

    ids = []
    for i in range(first, first + n):
        messages = [{"role": "user", "content": f"Tell me about topic number {i}."}]
        prompt = renderer.render(instructed(messages, INSTRUCTION))
        [c] = await backend.sample(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
        rec = TurnRecord(session_id=f"s{i}", messages=messages, prompt_ids=tuple(prompt), completion_ids=c.tokens,
                         logprobs=c.logprobs, version=0, finish_reason=c.finish_reason, instruction=INSTRUCTION,
                         response={"role": "assistant", "content": renderer.parse(c.tokens, c.finish_reason).content})
        tid = store.record_turn(rec)
        store.attach_next_state(tid, [{"role": "user", "content": reply}])
        ids.append(tid)
    return ids


async def test_a_turn_served_under_an_instruction_distils_it_from_the_students_view(tmp_path):
    """The user said nothing useful ("ok": no reward, no hint), yet the turn trains: its teacher is
    asked with the instruction, its student sees the prompt without it, and its log pi_old is
    re-scored there, so the PPO ratio starts at 1."""
    from clawbridge.backends.local import LocalBackend
    from clawbridge.chat.instructions import instructed
    from clawbridge.chat.renderer import Renderer
    from clawbridge.learning.advantages import opd_advantages
    from clawbridge.server import build_learning
    from helpers.learning import settings_for

    settings = settings_for(tmp_path, method="opd", w_negative=1.0, kl_anchor=0.0)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    store = Store.open(settings.db_url)
    try:
        renderer = Renderer(backend.tokenizer())
        [tid] = await _instructed_turns(backend, renderer, store, 1)
        parts = build_learning(settings, backend, store, renderer)
        assert await parts.collector.run_once() == 1
        [sample] = store.pending_samples(8, method="opd")
        turn = store.get_turn(tid)
        plain = renderer.render(turn.messages)
        student = await backend.score(plain, turn.completion_ids, model="policy")
        teacher = await backend.score(renderer.render(instructed(turn.messages, INSTRUCTION)), turn.completion_ids,
                                      model="base")
        assert sample.advantages == pytest.approx(opd_advantages(teacher, student, settings.learning.opd_clip))
        assert any(sample.advantages)  # without the instruction "ok" is no signal: the sample would be dropped
        [datum] = await parts.trainer.distillation.datums(sample)
        assert list(datum.prompt_ids) == plain != list(turn.prompt_ids)  # the student's view
        assert list(datum.logprobs) == pytest.approx(student)  # re-scored: ratio 1 at the first step
        assert list(datum.logprobs) != pytest.approx(list(turn.logprobs))  # not the instructed prompt's
    finally:
        store.close()
        await backend.close()


async def test_the_twin_measures_what_the_newest_weights_carry_of_an_instruction(tmp_path):
    """Before training the newest weights are the base's: they carry nothing of the instruction.
    Trained on turns served under it, they come closer to the twin: KL(twin || new) falls below
    KL(twin || base), so `carried` (their difference) turns positive. (The random model hardly
    heeds an instruction, so its lift stays below what `share` measures against: the nats are
    compared here.)"""
    from clawbridge.backends.local import LocalBackend
    from clawbridge.chat.renderer import Renderer
    from clawbridge.learning.baking import Twin
    from clawbridge.server import build_learning
    from clawbridge.types import SamplingParams
    from helpers.learning import settings_for

    settings = settings_for(tmp_path, method="opd", w_negative=1.0, batch_size=8, learning_rate=2e-2, gate="off")
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    store = Store.open(settings.db_url)
    try:
        renderer = Renderer(backend.tokenizer())
        twin = Twin(backend, renderer, SamplingParams(max_tokens=12, temperature=1.0, seed=0), samples=2)
        prompts = [([{"role": "user", "content": f"Tell me about topic number {i}."}], None) for i in range(4)]
        before = await twin.measure(prompts, INSTRUCTION)
        assert before.lift > 0 and before.carried == pytest.approx(0.0, abs=1e-6)
        parts = build_learning(settings, backend, store, renderer)
        for k in range(3):  # three steps, each of eight turns served under the instruction
            await _instructed_turns(backend, renderer, store, 8, first=8 * k)
            assert await parts.collector.run_once() == 8
            assert await parts.trainer.step_once() is not None
        after = await twin.measure(prompts, INSTRUCTION)
        assert after.lift == pytest.approx(before.lift)  # the twin's answers and the base's scores are kept
        assert after.carried > 0.2 * after.lift
    finally:
        store.close()
        await backend.close()


async def test_a_corrected_turn_under_an_instruction_still_distils_its_teachers_top_k(tmp_path):
    """With `w_negative` 0 a corrected answer's advantages are all zero and, with no rewrite, it
    would train nothing. Served under an instruction it is kept when the trainer distils the
    teacher's top-k: its datum learns the instruction's (and the hint's) distribution on every
    position. The same correction on an uninstructed turn is dropped, as before."""
    from clawbridge.backends.local import LocalBackend
    from clawbridge.chat.instructions import instructed
    from clawbridge.chat.renderer import Renderer
    from clawbridge.judges import teacher_view
    from clawbridge.server import build_learning
    from helpers.learning import record_turns, settings_for

    settings = settings_for(tmp_path, method="combine", w_negative=0.0, rewrites=0, opd_topk=5, opd_draws=0)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    store = Store.open(settings.db_url)
    try:
        renderer = Renderer(backend.tokenizer())
        correction = "Too long. Please answer in one short sentence."
        [served] = await _instructed_turns(backend, renderer, store, 1, reply=correction)
        [plain] = record_turns(store, 2)[1:]  # the helper's second reply is the same correction
        parts = build_learning(settings, backend, store, renderer)
        await parts.collector.run_once()
        by_turn = {s.turn_id: s for s in store.get_samples(range(1, 10))}
        assert by_turn[plain].state == "dropped"
        kept = by_turn[served]
        assert kept.state == "judged" and not any(kept.advantages or ())
        [datum] = await parts.trainer.distillation.datums(kept)
        turn = store.get_turn(served)
        assert list(datum.prompt_ids) == renderer.render(turn.messages)
        assert list(datum.teacher_prompt_ids or ()) == renderer.render(teacher_view(turn.messages, kept.hint, INSTRUCTION))
        assert renderer.render(instructed(turn.messages, INSTRUCTION)) != list(datum.teacher_prompt_ids or ())  # the hint too
    finally:
        store.close()
        await backend.close()


async def test_the_gate_asks_the_candidate_with_the_instruction_only_where_one_is_served(tmp_path):
    """With instant preferences off nothing is served as an instruction, so the gate asks the
    candidate plain (asked with the instruction it would be judged on answers it never gives) and
    nothing retires; the twin is asked with the applied preferences either way."""
    from clawbridge.backends.local import LocalBackend
    from clawbridge.chat.renderer import Renderer
    from clawbridge.learning.promotion import what_was_asked
    from clawbridge.server import build_learning
    from helpers.learning import settings_for

    store = Store.open(settings_for(tmp_path).db_url)
    try:
        store.save_preferences([Preference(INSTRUCTION, 2, ("a", "b"), 0, id=1, state="applied", kind="length")])
        on, off = await what_was_asked(store, served=True), await what_was_asked(store, served=False)
        assert on.wanted == off.wanted == INSTRUCTION
        assert on.served == INSTRUCTION and off.served is None
    finally:
        store.close()
    for instant in (True, False):
        settings = settings_for(tmp_path / str(instant), instant_preferences=instant)
        backend = LocalBackend.from_settings(settings)
        store = Store.open(settings.db_url)
        try:
            parts = build_learning(settings, backend, store, Renderer(backend.tokenizer()))
            assert (parts.trainer.promotion.retirement is not None) is instant
        finally:
            store.close()


@contextlib.asynccontextmanager
async def _applied(tmp_path, **kw):
    """The local backend on the tiny model, a store holding INSTRUCTION as an applied preference,
    and the learning parts as the composition root builds them (gate on, opd, batches of 8)."""
    from clawbridge.backends.local import LocalBackend
    from clawbridge.chat.renderer import Renderer
    from clawbridge.server import build_learning
    from helpers.learning import settings_for

    settings = settings_for(tmp_path, method="opd", w_negative=1.0, batch_size=8, learning_rate=2e-2, gate="on",
                            gate_probes=4, gate_probes_max=4, **kw)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    store = Store.open(settings.db_url)
    try:
        renderer = Renderer(backend.tokenizer())
        store.save_preferences([Preference(INSTRUCTION, 2, ("a", "b"), 0, id=1, state="applied", kind="length")])
        yield backend, store, renderer, build_learning(settings, backend, store, renderer)
    finally:
        store.close()
        await backend.close()


async def test_the_gate_judges_a_candidate_without_the_instructions_its_weights_carry(tmp_path):
    """Each candidate is reviewed before the gate: an applied preference its weights carry alone
    (share >= retire_share) is left out of the instruction it is judged with, as it would be
    served (asked for it again on top of weights that learned it, a candidate answers worse than
    with either); one they do not carry is kept. The review applies only when the version serves.
    Steps on turns served under the instruction move the weights (the random model heeds an
    instruction faintly: its lift is measured from 0 here, so its shares swing both ways, and the
    test follows each verdict rather than a trajectory)."""
    async with _applied(tmp_path, retire_share=0.3, restore_share=0.1) as (backend, store, renderer, parts):
        promotion = parts.trainer.promotion
        assert promotion.gate is not None and promotion.retirement is not None
        promotion.retirement.min_lift = 0.0
        promotion.retirement.loss_margin = float("inf")  # a lost preference holds back: the next test's
        shares: list[float | None] = []
        judged: list[str | None] = []
        states: list[str] = []
        review, evaluate = promotion.retirement.review, promotion.gate.evaluate

        async def reviewed(prompts, instructions):  # the real review, its shares kept for the test
            out = await review(prompts, instructions)
            shares.append(out[0].share)
            return out

        async def watched(candidate, serving, **kw):  # what the real gate is asked with; the second held back
            judged.append(kw["asked"].candidate)
            states.append(store.history().preferences[0].state)  # what the versions before it left
            decision = await evaluate(candidate, serving, **kw)
            return dataclasses.replace(decision, decision="rejected") if len(judged) == 2 else decision

        promotion.retirement.review, promotion.gate.evaluate = reviewed, watched  # type: ignore[method-assign]
        for k in range(4):
            await _instructed_turns(backend, renderer, store, 8, first=8 * k)
            assert await parts.collector.run_once() == 8
            assert await parts.trainer.step_once() is not None
        assert len(shares) == len(judged) == 4
        carried = [s is not None and s >= 0.3 for s in shares]
        assert any(carried) and not all(carried), shares  # the test sees both cases
        learned = False  # the stored state: changed only by a version that serves
        for share, asked, decision, state in zip(shares, judged, promotion.decisions, states, strict=True):
            assert state == ("learned" if learned else "applied"), (shares, judged, states)
            carries = learned if share is None else share >= (0.1 if learned else 0.3)
            assert asked == (None if carries else INSTRUCTION), (shares, judged)  # judged as it would serve
            if decision.decision == "accepted":
                learned = carries
        [pref] = store.history().preferences
        assert pref.state == ("learned" if learned else "applied")
        # a version served without it (learned), and one held back whose review changed nothing
        assert any(a is None and d.decision == "accepted" for a, d in zip(judged, promotion.decisions, strict=True))
        assert promotion.decisions[1].decision == "rejected"


async def test_the_gate_asks_its_references_while_the_learner_waits_for_a_batch(tmp_path):
    """With no batch to train, the learner asks v0 and the twin (the applied preference's
    instruction) the whole general probe, so the first candidate's gate asks only the candidate;
    two askers of the same version share one asking (each probe answered once)."""
    import asyncio

    from clawbridge.backends.local import LocalBackend
    from clawbridge.chat.renderer import Renderer
    from clawbridge.learning.learner import Learner
    from clawbridge.server import build_learning
    from helpers.learning import settings_for

    settings = settings_for(tmp_path, gate="on", gate_probes=4, gate_probes_max=8)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    store = Store.open(settings.db_url)
    try:
        store.save_preferences([Preference(INSTRUCTION, 2, ("a", "b"), 0, id=1, state="applied", kind="length")])
        learner = Learner(settings, poll_s=0.05)
        learner.bind(build_learning(settings, backend, store, Renderer(backend.tokenizer())))
        assert learner.trainer is not None
        gate = learner.trainer.promotion.gate
        assert gate is not None
        run = asyncio.create_task(learner.run())
        try:
            async with asyncio.timeout(60):
                while len(gate._scores.get((0, INSTRUCTION), ())) < 2:
                    await asyncio.sleep(0.05)
        finally:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        assert [len(t) for t in gate._scores[(0, None)]] == [len(t) for t in gate._scores[(0, INSTRUCTION)]] == [4, 4]
        assert learner.last_step is None and learner.errors == 0
        first, second = await asyncio.gather(gate.scores(0, 2, "Be brief."), gate.scores(0, 2, "Be brief."))
        assert first == second and len(gate.answers[(0, "Be brief.")]) == 8  # asked once, not twice
    finally:
        store.close()
        await backend.close()


def test_a_hint_that_repeats_an_applied_preference_is_not_asked_of_the_teacher_twice():
    """The user repeats a correction already served as an instruction: the teacher is asked with
    the instruction alone (the same request twice made the embedded teacher answer about the
    request: "that's too long for your request. This is just 2 lines: ..."); a hint that says
    something else still follows the instruction, and with no instruction the hint is the teacher's."""
    from clawbridge.chat.instructions import instructed, restates
    from clawbridge.judges import teacher_view

    asked = [{"role": "user", "content": "What is rain?"}]
    instruction = "Too long. Please answer in one short sentence.\nUse plain words."
    assert restates(instruction, "  too long.  please answer in ONE short sentence!")
    assert not restates(instruction, "Too long.") and not restates(None, "Use plain words.") and not restates(instruction, "")
    assert teacher_view(asked, "too long. Please answer in one short sentence", instruction) == instructed(asked, instruction)
    stacked = teacher_view(asked, "That doesn't answer my question.", instruction)
    assert stacked != instructed(asked, instruction) and "doesn't answer" in stacked[0]["content"]
    assert "Too long" in teacher_view(asked, "Too long. Please answer in one short sentence.", None)[0]["content"]


async def test_a_candidate_carrying_a_learned_preference_clearly_less_than_the_serving_one_is_held_back(tmp_path):
    """The version that serves keeps its measurement of each instruction (`Retirement.serves`); a
    later candidate is measured again on the same twin answers (paired: weights equal to the
    serving version's carry exactly as much) and, where the preference is learned (served by the
    weights alone), held back when it carries more than LOSS_MARGIN less, without the probes.
    Here the candidate's weights are the base model's: they carry nothing."""
    async with _applied(tmp_path, gate_every=1, gate_patience=1, retire_share=1e9,
                        restore_share=0.1) as (backend, store, renderer, parts):
        promotion = parts.trainer.promotion
        assert promotion.gate is not None and promotion.retirement is not None
        retirement = promotion.retirement
        retirement.min_lift = 0.0
        evaluated: list[int] = []
        evaluate = promotion.gate.evaluate

        async def watched(candidate, serving, **kw):  # the real gate; its verdict on a random model is not under test
            evaluated.append(candidate)
            return dataclasses.replace(await evaluate(candidate, serving, **kw), decision="accepted")

        promotion.gate.evaluate = watched  # type: ignore[method-assign]
        for k in range(3):  # three versions serve, each trained on turns served under the instruction
            await _instructed_turns(backend, renderer, store, 8, first=8 * k)
            assert await parts.collector.run_once() == 8
            assert (await parts.trainer.step_once()).served == k + 1
        kept = retirement.kept[INSTRUCTION]
        assert kept.version == 3 and len(kept.prompts) == 8
        assert kept.share > LOSS_MARGIN, kept.share  # the trained weights carry some of it: the case under test
        store.update_preferences(lambda known: [dataclasses.replace(p, state="learned", learned_version=3) for p in known])

        await _instructed_turns(backend, renderer, store, 8, first=24)
        assert await parts.collector.run_once() == 8
        batch = store.pending_samples(8, method="opd")
        base = await backend.rollback(0)  # a candidate whose weights are the base model's
        assert await promotion.promote(batch, base.version, 3) == 3
        decision = promotion.decisions[-1]
        assert (decision.candidate, decision.decision) == (base.version, "rejected")
        assert "learned preference 1 lost" in decision.reason and f"where v3 carries {kept.share:.2f}" in decision.reason
        assert base.version not in evaluated  # held back before the probes
        assert store.history().preferences[0].state == "learned"

        same = await backend.rollback(3)  # the serving version's weights again: paired, they carry as much
        [reviewed] = await retirement.review(kept.prompts, [(INSTRUCTION, True)])
        assert reviewed.share_on_kept == pytest.approx(kept.share) and not reviewed.lost
        assert await promotion.promote(batch, same.version, 3) == same.version
        assert same.version in evaluated and promotion.decisions[-1].decision == "accepted"
        assert retirement.kept[INSTRUCTION].version == same.version  # what serves now is kept to
