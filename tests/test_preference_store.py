"""The preferences in the store (SQLite and PostgreSQL): states kept and changed in one transaction,
the gate's learned/applied, forgetting one (its samples not trained yet dropped), the turn's
instruction, and migration 0008 up and down."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from clawbridge.learning import preferences as prefs
from clawbridge.store import Preference, Store, TurnRecord
from clawbridge.store.base import alembic_config
from clawbridge.store.schema import UTCDateTime

NOW = datetime(2026, 1, 1, tzinfo=UTC)
BRIEF = "Too long. Please answer in one short sentence, under 20 words."


def turn(store: Store, sid: str, instruction: str | None = None) -> str:
    return store.record_turn(TurnRecord(
        session_id=sid, messages=[{"role": "user", "content": "What is rain?"}], prompt_ids=(1, 2, 3),
        completion_ids=(4, 5), logprobs=(-1.0, -2.0), version=0, finish_reason="stop",
        response={"role": "assistant", "content": "Water."}, instruction=instruction))


def hear(store: Store, text: str, turn_id: str, version: int = 0) -> list[Preference]:
    return store.update_preferences(lambda known: prefs.merge(known, [(text, turn_id)], version, NOW))


def test_a_turn_records_the_instruction_it_was_served_with(store: Store) -> None:
    with_it, without = turn(store, "a", "Be brief."), turn(store, "b")
    assert store.get_turn(with_it).instruction == "Be brief."  # type: ignore[union-attr]
    assert store.get_turn(without).instruction is None  # type: ignore[union-attr]


def test_hearing_twice_applies_and_the_states_round_trip(store: Store) -> None:
    t1, t2 = turn(store, "a"), turn(store, "b")
    assert hear(store, BRIEF, t1)[0].state == "heard"
    assert hear(store, BRIEF, t1) == list(store.preferences())  # the same turn again: nothing changes
    out = hear(store, BRIEF, t2, version=3)
    stored = store.preferences()
    assert list(stored) == out and stored[0].id == 1
    p = stored[0]
    assert (p.state, p.kind, p.count, p.count_since, p.turns, p.applied_version) == (
        "applied", "length", 2, 2, (t1, t2), 3)
    assert p.applied_at == NOW and p.state_at == NOW and store.history().preferences == stored
    assert prefs.served_instruction(stored) == BRIEF


def test_the_gate_sets_a_preference_learned_and_back_to_applied(store: Store) -> None:
    for t in (turn(store, "a"), turn(store, "b")):
        hear(store, BRIEF, t)
    learned = store.set_preference_state(1, "learned", 5)
    assert (learned.state, learned.learned_version) == ("learned", 5)
    assert prefs.served_instruction(store.preferences()) is None  # the weights carry it
    assert prefs.wanted_instruction(store.preferences()) == BRIEF  # the twin is still asked with it
    back = store.set_preference_state(1, "applied", 7)
    assert (back.state, back.learned_version, back.applied_version) == ("applied", None, 7)
    assert prefs.served_instruction(store.preferences()) == BRIEF


def test_forgetting_drops_the_instruction_and_the_samples_not_trained_yet(store: Store) -> None:
    turns = [turn(store, s) for s in "abc"]
    for t in turns:
        hear(store, BRIEF, t)
    other = turn(store, "d")
    samples = [store.create_sample(t, "combine", advantages=(1.0, 1.0))[0] for t in [*turns, other]]
    store.mark_samples([samples[0]], "trained", step=1)  # trained already: stays trained
    p = store.forget_preference(1)
    assert p.state == "dropped" and p.dropped_at is not None
    assert prefs.served_instruction(store.preferences()) is None  # at once, before any sample is touched
    assert store.drop_preference_samples(1) == 2
    states = {s.turn_id: (s.state, s.reason) for s in store.get_samples(samples)}
    assert states[turns[0]] == ("trained", None)
    assert states[turns[1]] == states[turns[2]] == ("dropped", "the user dropped preference 1")
    assert states[other][0] == "judged"
    assert prefs.served_instruction(store.preferences()) is None


def _columns(conn: sa.Connection, table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(conn).get_columns(table)}


def test_migration_0008_adds_the_states_and_the_instruction_and_takes_them_away(db_url: str) -> None:
    s = Store.open(db_url, migrate=False)
    s.migrate("0007")
    old = sa.table("preferences", sa.column("position", sa.Integer), sa.column("text", sa.Text),
                   sa.column("count", sa.Integer), sa.column("turns", sa.JSON), sa.column("first_version", sa.Integer),
                   sa.column("updated_at", UTCDateTime()))
    with s.engine.begin() as conn:  # a preference as 0007 kept it: hints counted, no state
        conn.execute(old.insert().values(position=0, text=BRIEF, count=3, turns=["t1", "t2", "t3"], first_version=1,
                                         updated_at=NOW))
    s.migrate()
    p = s.preferences()[0]
    assert (p.id, p.text, p.count, p.state, p.count_since, p.confirmed, p.kind) == (1, BRIEF, 3, "heard", 3, False, None)
    assert prefs.reheard(s.preferences())[0].state == "applied"
    s.save_preferences([replace(p, state="applied", kind="length")])
    with s.engine.begin() as conn:
        assert {"state", "kind", "confirmed", "count_since", "applied_version"} <= _columns(conn, "preferences")
        assert "instruction" in _columns(conn, "turns")
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0007")
    with s.engine.connect() as conn:
        assert "state" not in _columns(conn, "preferences") and "instruction" not in _columns(conn, "turns")
        assert conn.execute(sa.text("SELECT text, count FROM preferences")).one() == (BRIEF, 3)
    s.migrate()
    assert s.preferences()[0].state == "heard"
    s.close()


async def test_the_collector_hears_each_judged_correction_once_and_a_dropped_ones_samples_never_train(
        data_dir: Path) -> None:
    """The rules judge's hint is the user's correction: heard twice (turns 1 and 4 of six), it is
    applied; a second pass, or a pending sample settled again after a crash, hears nothing twice;
    once the user dropped it, a new sample whose hint counts for it is dropped."""
    from clawbridge.backends.local import LocalBackend
    from helpers.learning import REPLIES, collector_for, record_turns, settings_for

    settings = settings_for(data_dir)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    told: list[str | None] = []
    try:
        tids = record_turns(store, 6)
        collector = collector_for(settings, backend, store)
        collector.on_preferences = lambda _user, known: told.append(prefs.served_instruction(known))
        await collector.run_once()
        [p] = store.preferences()
        # (samples settle concurrently: the turns in the order they were heard)
        assert (p.text, p.count, p.state, set(p.turns)) == (REPLIES[1], 2, "applied", {tids[1], tids[4]})
        assert told[-1] == REPLIES[1]
        again = store.get_turn(tids[1])
        assert again is not None and await collector.hear(again, REPLIES[1]) == p  # a re-run hears nothing
        assert store.preferences() == (p,) and await collector.run_once() == 0
        store.forget_preference(1)
        [more] = record_turns(store, 2)[1:]  # a new session whose reply is the same correction
        await collector.run_once()
        [dropped] = [s for s in store.get_samples(list(range(1, 100))) if s.turn_id == more]
        assert dropped.state == "dropped" and dropped.reason == "the user dropped preference 1"
        assert store.preferences()[0].state == "dropped" and store.preferences()[0].count == 3
    finally:
        await backend.close()
        store.close()


async def test_forget_stops_the_instruction_at_once_and_drops_samples_only_between_training_steps(
        store: Store) -> None:
    """A step commits its batch as trained all or nothing, so a forget waits for the learner's
    lock before it drops samples; the instruction stops before that, at once."""
    import asyncio

    from clawbridge.learning import standing

    turns = [turn(store, s) for s in "ab"]
    for t in turns:
        hear(store, BRIEF, t)
    samples = [store.create_sample(t, "combine", advantages=(1.0, 1.0))[0] for t in turns]
    step = asyncio.Lock()
    stopped: list[str | None] = []

    async def served() -> None:
        stopped.append(prefs.served_instruction(await store.run(store.preferences)))

    async with step:  # a training step runs
        forgetting = asyncio.create_task(standing.forget(store, 1, serving=2, stopped=served, lock=step))
        await asyncio.sleep(0.5)
        assert stopped == [None] and not forgetting.done()
        assert {s.state for s in store.get_samples(samples)} == {"judged"}
    out = await forgetting
    assert out.samples_dropped == 2 and out.rollback_to == 0 and out.preference.state == "dropped"
    assert standing.forgotten_view(out)["rollback_command"] == "clawbridge rollback 0"


async def test_the_quick_pass_hears_a_correction_without_the_engine_and_the_settle_pass_judges_nothing_twice(
        data_dir: Path) -> None:
    """The collector's quick pass (`judge_once`) opens, judges and hears each new turn with the
    engine not even started (the preference applies while the engine is busy with the user); the
    settle pass then finishes those samples reading the judgments back, and the two passes run
    side by side call the judges once per turn."""
    import asyncio

    from clawbridge.backends.local import LocalBackend
    from helpers.learning import REPLIES, collector_for, record_turns, settings_for

    settings = settings_for(data_dir)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    try:
        tids = record_turns(store, 6)
        collector = collector_for(settings, backend, store)
        judged: list[int] = []

        class Counted:  # the rules judges, each call counted and taking a remote judge's while
            def __init__(self, judges: Any) -> None:
                self.judges = judges

            async def run(self, ctx: Any, kinds: Any) -> Any:
                judged.append(len(kinds))
                await asyncio.sleep(0.2)
                return await self.judges.run(ctx, kinds)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.judges, name)

        collector.judges = Counted(collector.judges)  # type: ignore[assignment]
        assert await asyncio.wait_for(collector.judge_once(), 30) == 6
        [p] = store.preferences()
        assert (p.text, p.state, set(p.turns)) == (REPLIES[1], "applied", {tids[1], tids[4]})
        assert {s.state for s in store.get_samples(list(range(1, 7)))} == {"pending"}
        assert len(judged) == 6
        await backend.start()
        more = record_turns(store, 3)
        settled, _again = await asyncio.gather(collector.run_once(), collector.judge_once())
        assert settled + await collector.run_once() == 9 and len(judged) == 6 + len(more)
        assert store.preferences()[0].count == 3  # the new session's correction, heard once
        assert "pending" not in {s.state for s in store.get_samples(list(range(1, 10)))}
    finally:
        await backend.close()
        store.close()
