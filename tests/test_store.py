"""The store on a real SQLite file (WAL) and a real PostgreSQL 15 cluster: every test runs on
both. PostgreSQL tests skip, saying why, where its binaries are missing."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from clawbridge.store import (
    JudgeVote,
    Judgment,
    PolicyVersionRow,
    SampleStateError,
    Store,
    TrainingStep,
    TurnRecord,
    codec,
    schema,
)
from clawbridge.store.base import alembic_config
from clawbridge.store.schema import metadata
from clawbridge.types import SamplingParams, TokenLogprob
from pg import PgCluster


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'nested' / 'dir' / 'clawbridge.db'}"
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    return cluster.create_schema()


def turn(session: str = "s1", n: int = 4, **kw: Any) -> TurnRecord:
    args: dict[str, object] = dict(
        session_id=session,
        messages=[{"role": "user", "content": "hi"}],
        prompt_ids=tuple(range(100, 110)),
        completion_ids=tuple(range(200, 200 + n)),
        logprobs=tuple(-0.5 - i / 7 for i in range(n)),
        version=0,
        finish_reason="stop",
        response={"role": "assistant", "content": "hello"},
    )
    args.update(kw)
    return TurnRecord(**args)  # type: ignore[arg-type]


def all_turn_ids(store: Store) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT id FROM turns")).scalars())


# --- capture ------------------------------------------------------------------------------------
def test_a_turn_round_trips_with_exact_token_ids_and_logprobs(store: Store) -> None:
    logprobs = (-0.1, -1e-300, 5e-324, -0.0, -math.inf, -2.718281828459045, -1 / 3, -7.25e-08)
    rec = turn(
        messages=[
            {"role": "system", "content": "Be brief. ✓ ünïcode 中文"},
            {"role": "user", "content": "weather?", "name": "al"},
        ],
        tools=[{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
        prompt_ids=(0, 1, 49151, 151_935, 2**31 - 1, 7),
        completion_ids=(11, 22, 33, 44, 55, 66, 77, 88),
        logprobs=logprobs,
        top_logprobs=tuple((TokenLogprob(i, -0.25), TokenLogprob(i + 1, -1.5)) for i in range(8)),
        sampling=SamplingParams(max_tokens=64, temperature=0.7, stop=("\n\n",), stop_token_ids=(2,)),
        request_params={"model": "m", "max_completion_tokens": 64},
        version=3,
        finish_reason="tool_calls",
        response={"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
        turn_type="side",
        tagged=False,
        train=False,
        session_source="header",
        queued_ms=0.5,
        ttft_ms=12.25,
        total_ms=80.0,
    )
    assert store.record_turn(rec) == rec.id
    got = store.get_turn(rec.id)
    assert got is not None
    assert got.prompt_ids == rec.prompt_ids
    assert got.completion_ids == rec.completion_ids
    # Bit for bit, signed zero and -inf included.
    assert [x.hex() for x in got.logprobs] == [x.hex() for x in logprobs]
    assert got.top_logprobs == rec.top_logprobs
    assert got.sampling == rec.sampling
    for name in ("messages", "tools", "request_params", "response", "version", "finish_reason",
                 "turn_type", "tagged", "train", "session_source", "queued_ms", "ttft_ms", "total_ms", "created_at"):
        assert getattr(got, name) == getattr(rec, name), name
    assert got.index == 0 and got.next_state is None


def test_the_capture_path_writes_the_row_sqlalchemy_would(store: Store) -> None:
    """Turns are inserted on the DBAPI cursor (`store/fast.py`); the stored bytes must be what
    SQLAlchemy itself writes for the same row, NULLs, JSON, blobs and times included."""
    rec = turn(
        "fast", tools=None, top_logprobs=None, ttft_ms=None,
        messages=[{"role": "user", "content": "ünïcode \ud83d"}], request_params={"n": 1},
    )
    store.record_turn(rec)
    row = codec.turn_row(rec, 0)
    with store._write() as conn:
        conn.execute(schema.turns.insert(), {**row, "id": "via-sqlalchemy"})

    def stored(turn_id: str) -> tuple[Any, ...]:
        with store.engine.connect() as conn:
            r = conn.exec_driver_sql(
                "SELECT * FROM turns WHERE id = " + ("?" if store.dialect == "sqlite" else "%(id)s"),
                (turn_id,) if store.dialect == "sqlite" else {"id": turn_id},
            ).one()
        return tuple(bytes(v) if isinstance(v, memoryview) else v for v in r[1:])

    assert stored(rec.id) == stored("via-sqlalchemy")


def test_awkward_client_text_and_long_ids_are_stored_not_lost(store: Store) -> None:
    # JSON lets clients send lone surrogates and NULs; session ids come from headers.
    msgs = [{"role": "user", "content": "half an emoji \ud83d, a NUL \x00, 中文"}]
    rec = turn("s" * 500, messages=msgs, response={"role": "assistant", "content": "\udfff"})
    store.record_turn(rec)
    got = store.get_turn(rec.id)
    assert got is not None and got.messages == msgs and got.response == rec.response
    assert got.session_id == "s" * 500


def test_turns_get_consecutive_indexes_and_create_their_session(store: Store) -> None:
    recs = [turn("a"), turn("b", turn_type="side"), turn("a"), turn("a", turn_type="side")]
    for r in recs:
        store.record_turn(r)
    assert [t.index for t in store.session_turns("a")] == [0, 1, 2]
    sess = store.get_session("a")
    assert sess is not None and (sess.turns, sess.main_turns, sess.done) == (3, 2, False)
    last = store.last_turn("a")
    assert last is not None and last.id == recs[2].id


def test_recording_the_same_turn_twice_is_a_no_op(store: Store) -> None:
    rec = turn()
    store.record_turn(rec)
    store.record_turn(rec)
    assert len(store.session_turns("s1")) == 1
    assert store.stats().turns == 1


async def test_a_turn_sent_twice_in_one_batch_is_stored_once(store: Store) -> None:
    a, b = turn("s1"), turn("s1")
    ids = await asyncio.gather(*(store.record_turn_async(r) for r in [a, b, a, turn("s2"), b]))
    assert ids[0] == ids[2] == a.id and ids[1] == ids[4] == b.id
    assert [t.id for t in store.session_turns("s1")] == [a.id, b.id]
    assert [t.index for t in store.session_turns("s1")] == [0, 1]
    sess = store.get_session("s1")
    assert sess is not None and sess.turns == 2


def test_a_turn_with_mismatched_logprobs_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="3 completion tokens but 2 logprobs"):
        turn(completion_ids=(1, 2, 3), logprobs=(-0.1, -0.2))


def test_the_next_state_is_attached_once_and_the_first_wins(store: Store) -> None:
    rec = turn()
    store.record_turn(rec)
    assert store.attach_next_state(rec.id, [{"role": "user", "content": "thanks!"}])
    assert not store.attach_next_state(rec.id, [{"role": "user", "content": "later"}])
    got = store.get_turn(rec.id)
    assert got is not None and got.next_state == [{"role": "user", "content": "thanks!"}]
    assert got.next_state_at is not None


def test_sessions_upsert_close_and_idle(store: Store) -> None:
    assert store.upsert_session("x", "body")
    assert not store.upsert_session("x", "header")
    sess = store.get_session("x")
    assert sess is not None and sess.source == "body"
    assert store.idle_sessions(datetime.now(UTC) + timedelta(seconds=1)) == ["x"]
    assert store.idle_sessions(datetime.now(UTC) - timedelta(hours=1)) == []
    assert store.close_session("x", "client")
    assert not store.close_session("x", "idle")
    sess = store.get_session("x")
    assert sess is not None and sess.done and sess.done_reason == "client"
    assert store.idle_sessions(datetime.now(UTC) + timedelta(seconds=1)) == []


# --- migrations ---------------------------------------------------------------------------------
def test_migrations_build_the_schema_from_empty_and_match_the_tables(db_url: str) -> None:
    s = Store.open(db_url)
    try:
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        with s.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == head
            # The hand-written migrations and the live table definitions agree exactly.
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), metadata
            )
            assert diff == []
    finally:
        s.close()
    # Opening again migrates nothing and keeps the data.
    s = Store.open(db_url)
    s.record_turn(turn())
    s.close()
    s = Store.open(db_url)
    assert s.stats().turns == 1
    s.close()


def test_processes_opening_a_fresh_store_at_once_migrate_it_once(db_url: str) -> None:
    # Separate processes, as when a proxy and `clawbridge export` start together.
    code = "import sys; from clawbridge.store import Store; Store.open(sys.argv[1]).close()"
    procs = [subprocess.Popen([sys.executable, "-c", code, db_url]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    with Store.open(db_url) as s, s.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar() == 1


# --- concurrency and group commit ---------------------------------------------------------------
async def test_concurrent_writers_lose_nothing(store: Store) -> None:
    n_threads, per_thread, n_async = 6, 25, 300

    def sync_writer(k: int) -> list[str]:
        return [store.record_turn(turn(f"sync{k % 3}")) for _ in range(per_thread)]

    threads_done = asyncio.gather(
        *(asyncio.to_thread(sync_writer, k) for k in range(n_threads))
    )
    async_ids = await asyncio.gather(
        *(store.record_turn_async(turn(f"async{i % 10}")) for i in range(n_async))
    )
    sync_ids = [i for ids in await threads_done for i in ids]
    assert len(set(async_ids)) == n_async
    assert all_turn_ids(store) == set(async_ids) | set(sync_ids)
    assert len(sync_ids) == n_threads * per_thread
    # Indexes in each session are exactly 0..n-1: no duplicates, no gaps.
    for sid in [f"sync{k}" for k in range(3)] + [f"async{k}" for k in range(10)]:
        idx = [t.index for t in store.session_turns(sid)]
        assert sorted(idx) == list(range(len(idx)))


async def test_the_writer_groups_concurrent_writes_into_few_commits(store: Store) -> None:
    ids = await asyncio.gather(*(store.record_turn_async(turn(f"s{i % 7}")) for i in range(200)))
    assert len(set(ids)) == 200 and len(all_turn_ids(store)) == 200
    assert store.writer.written == 200
    assert store.writer.batches <= 50, store.writer.batches


@pytest.mark.slow
async def test_the_writer_sustains_hundreds_of_turns_per_second(store: Store) -> None:
    # 2,000-token prompts, 200-token completions, 64 requests in flight. Measured ~360/s
    # (SQLite) and ~190/s (PostgreSQL) on 2 busy cores; the floors leave room for a slow CI.
    n = 600
    recs = [turn(f"s{i % 20}", n=200, prompt_ids=tuple(range(2000))) for i in range(n)]
    gate = asyncio.Semaphore(64)

    async def one(r: TurnRecord) -> str:
        async with gate:
            return await store.record_turn_async(r)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r) for r in recs))
    rate = n / (time.perf_counter() - t0)
    print(f"{store.dialect}: {rate:.0f} turns/s, {n / store.writer.batches:.1f} turns per commit")
    assert rate >= (100 if store.dialect == "sqlite" else 40)


async def test_a_failing_write_fails_alone_in_its_batch(store: Store) -> None:
    good = [turn() for _ in range(20)]
    bad = turn(messages=[{"role": "user", "content": {1, 2}}])  # a set is not JSON
    results = await asyncio.gather(
        *(store.record_turn_async(r) for r in [*good[:10], bad, *good[10:]]),
        return_exceptions=True,
    )
    assert isinstance(results[10], Exception)
    assert all_turn_ids(store) == {r.id for r in good}


async def test_async_reads_and_session_writes_run_off_the_event_loop(store: Store) -> None:
    assert await store.upsert_session_async("z", "path")
    rec = turn("z")
    await store.record_turn_async(rec)
    assert await store.attach_next_state_async(rec.id, [{"role": "user", "content": "ok"}])
    assert await store.close_session_async("z", "client")
    stats = await store.run(store.stats)
    assert (stats.turns, stats.sessions_done) == (1, 1)


async def test_the_writer_replaces_its_kept_connection_when_it_dies(store: Store) -> None:
    """The writer keeps one connection between commits (no pool check-out, no pre-ping); when
    it died meanwhile (a database restart), the write is retried on a fresh one, not failed."""
    first, second = turn("kept"), turn("kept")
    await store.record_turn_async(first)
    kept = store._writer_conn
    assert kept is not None
    kept.connection.dbapi_connection.close()  # type: ignore[union-attr]
    assert await store.record_turn_async(second) == second.id
    assert store._writer_conn is not kept
    assert [t.id for t in store.session_turns("kept")] == [first.id, second.id]


async def test_a_write_whose_caller_gave_up_before_it_began_is_skipped(store: Store) -> None:
    started, gate, ran = threading.Event(), threading.Event(), []
    blocker = store.writer.submit(lambda conn: started.set() or gate.wait(10))  # holds the writer
    assert await asyncio.to_thread(started.wait, 10)
    task = asyncio.ensure_future(store.writer.write(lambda conn: ran.append("cancelled one")))
    kept = asyncio.ensure_future(store.writer.write(lambda conn: ran.append("kept") or 7))
    await asyncio.sleep(0.05)
    task.cancel()
    gate.set()
    assert await kept == 7 and blocker.result(5) is True
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran == ["kept"]


def test_a_closed_writer_refuses_new_writes(db_url: str) -> None:
    from clawbridge.store import WriterClosed

    s = Store.open(db_url)
    w = s.writer
    fut = w.submit(lambda conn: 42)
    s.close()
    assert fut.result(timeout=5) == 42  # queued before close: still done
    with pytest.raises(WriterClosed):
        w.submit(lambda conn: 1)


# --- judging and samples ------------------------------------------------------------------------
def _judged_turn(store: Store, session: str = "s1", **kw: Any) -> str:
    rec = turn(session, **kw)
    store.record_turn(rec)
    store.attach_next_state(rec.id, [{"role": "user", "content": "no, shorter"}])
    return rec.id


def test_turns_awaiting_judgment_are_main_trainable_with_a_next_state(store: Store) -> None:
    ready = _judged_turn(store)
    _judged_turn(store, turn_type="side")
    _judged_turn(store, train=False)
    store.record_turn(turn())  # no next state yet
    assert [t.id for t in store.turns_awaiting_judgment()] == [ready]
    store.add_judgment(Judgment(turn_id=ready, judge="rules", kind="prm", votes=(), reward=1.0))
    assert store.turns_awaiting_judgment() == []
    # A loop that judges prm and hint resumes with the kind that is missing.
    waiting = store.turns_awaiting_judgment(kinds=("prm", "hint"))
    assert [t.id for t in waiting] == [ready] and waiting[0].judged_kinds == {"prm"}


def test_judgments_keep_every_vote_and_are_idempotent(store: Store) -> None:
    tid = _judged_turn(store)
    votes = (
        JudgeVote(raw="... \\boxed{1}", value=1.0),
        JudgeVote(raw="\\boxed{-1}", value=-1.0),
        JudgeVote(raw="", value=None, error="timeout after 30s"),
    )
    j = Judgment(turn_id=tid, judge="prm:gpt", kind="prm", votes=votes, reward=0.0)
    first = store.add_judgment(j)
    again = store.add_judgment(Judgment(turn_id=tid, judge="prm:gpt", kind="prm", votes=(), reward=1.0))
    assert first == again
    hint_id = store.add_judgment(
        Judgment(turn_id=tid, judge="hint:gpt", kind="hint", votes=(JudgeVote(raw="[HINT]be brief[/HINT]", value="be brief"),), hint="be brief")
    )
    assert hint_id != first
    got = store.judgments(tid)
    assert [(g.kind, g.votes, g.reward, g.hint) for g in got] == [
        ("prm", votes, 0.0, None),
        ("hint", (JudgeVote(raw="[HINT]be brief[/HINT]", value="be brief"),), None, "be brief"),
    ]


def test_a_turn_yields_at_most_one_sample_per_method(store: Store) -> None:
    tid = _judged_turn(store, version=2)
    sid, created = store.create_sample(tid, "binary", reward=1.0, advantages=[1.0] * 4)
    again, created_again = store.create_sample(tid, "binary", reward=-1.0, advantages=[-1.0] * 4)
    assert created and not created_again and sid == again
    other, created_other = store.create_sample(tid, "opd", state="pending", hint="be brief")
    assert created_other and other != sid
    [s] = store.pending_samples()
    assert (s.id, s.reward, s.advantages, s.version) == (sid, 1.0, (1.0,) * 4, 2)
    assert s.prompt_ids == tuple(range(100, 110)) and s.completion_ids == (200, 201, 202, 203)
    assert s.logprobs == turn().logprobs and s.temperature == 1.0


def test_advantages_must_cover_every_completion_token(store: Store) -> None:
    tid = _judged_turn(store)
    from clawbridge.store import StoreError

    with pytest.raises(StoreError, match="3 advantages for a completion of 4 tokens"):
        store.create_sample(tid, "binary", advantages=[1.0] * 3)


def test_sample_states_only_move_forward(store: Store) -> None:
    tids = [_judged_turn(store) for _ in range(3)]
    a, _ = store.create_sample(tids[0], "opd", state="pending")
    b, _ = store.create_sample(tids[1], "binary", advantages=[1.0] * 4)
    c, _ = store.create_sample(tids[2], "binary", advantages=[-1.0] * 4)
    assert [s.id for s in store.pending_samples(state="pending")] == [a]
    store.set_sample_advantages(a, [0.5] * 4, teacher_logprobs=[-0.1] * 4, reward=0.0)
    with pytest.raises(SampleStateError):
        store.set_sample_advantages(a, [0.5] * 4)  # no longer pending
    assert [s.id for s in store.pending_samples()] == [a, b, c]
    assert store.pending_samples(method="opd")[0].teacher_logprobs == (-0.1,) * 4

    store.mark_samples([c], "dropped", reason="zero advantage")
    # All or nothing: c is dropped, so b must not move either.
    with pytest.raises(SampleStateError, match="dropped"):
        store.mark_samples([b, c], "trained", step=1)
    assert [s.state for s in store.get_samples([a, b, c])] == ["judged", "judged", "dropped"]
    with pytest.raises(SampleStateError):
        store.mark_samples([b], "pending")
    with pytest.raises(SampleStateError, match="missing"):
        store.mark_samples([b, 99_999], "dropped")
    assert store.get_samples([c])[0].reason == "zero advantage"


def test_stale_samples_are_dropped(store: Store) -> None:
    old = _judged_turn(store, version=1)
    new = _judged_turn(store, version=5)
    store.create_sample(old, "binary", advantages=[1.0] * 4)
    store.create_sample(new, "binary", advantages=[1.0] * 4)
    assert store.drop_stale_samples(oldest_fresh=2) == 1
    [kept] = store.pending_samples()
    assert kept.turn_id == new
    assert store.stats().samples["dropped"] == 1


# --- training steps: no sample trained twice ----------------------------------------------------
def test_a_crash_inside_the_training_step_leaves_samples_judged_and_none_trains_twice(
    store: Store,
) -> None:
    ids = [store.create_sample(_judged_turn(store), "binary", advantages=[1.0] * 4)[0] for _ in range(3)]
    step1 = TrainingStep(step=1, version_before=0, version_after=1, metrics={"loss": 0.5})

    def crash(conn: sa.Connection) -> None:
        raise RuntimeError("power cut between marking and commit")

    sa.event.listen(store.engine, "commit", crash)
    try:
        with pytest.raises(RuntimeError, match="power cut"):
            store.record_training_step(step1, ids, PolicyVersionRow(version=1, path="/a/v1"))
    finally:
        sa.event.remove(store.engine, "commit", crash)
    # Nothing of the step happened: samples are still waiting, no step row, no new version.
    assert [s.id for s in store.pending_samples()] == ids
    assert store.training_steps() == [] and store.latest_version() is None

    store.record_training_step(step1, ids, PolicyVersionRow(version=1, path="/a/v1", step=1))
    assert store.pending_samples() == []
    assert {s.step for s in store.get_samples(ids)} == {1}
    [row] = store.training_steps()
    assert (row.step, row.samples, row.metrics) == (1, 3, {"loss": 0.5})
    latest = store.latest_version()
    assert latest is not None and (latest.version, latest.path) == (1, "/a/v1")

    # A trainer that resumes and tries the same samples again is refused, atomically.
    fresh = store.create_sample(_judged_turn(store), "binary", advantages=[1.0] * 4)[0]
    step2 = TrainingStep(step=2, version_before=1, version_after=2)
    with pytest.raises(SampleStateError, match="trained"):
        store.record_training_step(step2, [ids[0], fresh])
    assert [s.id for s in store.pending_samples()] == [fresh]
    assert {s.step for s in store.get_samples(ids)} == {1}
    assert len(store.training_steps()) == 1


def test_policy_versions_are_listed_in_order_and_never_rewritten(store: Store) -> None:
    from clawbridge.store import VersionReused

    assert store.latest_version() is None
    store.record_policy_version(PolicyVersionRow(version=0))
    store.record_policy_version(PolicyVersionRow(version=2, path="tinker://x/2", step=2, samples=32))
    store.record_policy_version(PolicyVersionRow(version=1, path="/ckpt/1", mean_reward=0.25))
    with pytest.raises(VersionReused):  # append-only: a number is never reused or overwritten
        store.record_policy_version(PolicyVersionRow(version=1, path="/ckpt/1b", mean_reward=0.5))
    assert [(v.version, v.path) for v in store.versions()] == [
        (0, None), (1, "/ckpt/1"), (2, "tinker://x/2")
    ]
    latest = store.latest_version()
    assert latest is not None and latest.version == 2 and latest.samples == 32


def test_meta_keeps_json_values(store: Store) -> None:
    assert store.get_meta("served_version", -1) == -1
    store.set_meta("served_version", 3)
    store.set_meta("served_version", {"v": 4, "path": "/x"})
    assert store.get_meta("served_version") == {"v": 4, "path": "/x"}


def test_stats_count_sessions_turns_judgments_samples_and_steps(store: Store) -> None:
    a = _judged_turn(store, "s1")
    _judged_turn(store, "s2", turn_type="side", tagged=False)
    store.record_turn(turn("s2", tagged=False))
    store.record_turn(turn("s3", train=False))
    store.close_session("s3", "client")
    store.add_judgment(Judgment(turn_id=a, judge="rules", kind="prm", votes=(), reward=1.0))
    sid, _ = store.create_sample(a, "binary", advantages=[1.0] * 4)
    store.record_training_step(TrainingStep(step=1, version_before=0, version_after=1), [sid])
    store.record_policy_version(PolicyVersionRow(version=1))
    st = store.stats()
    assert (st.sessions, st.sessions_done) == (3, 1)
    assert (st.turns, st.main_turns, st.side_turns, st.untagged_turns) == (4, 3, 1, 2)
    assert (st.opted_out_turns, st.awaiting_next_state, st.judged_turns) == (1, 2, 1)
    assert st.samples == {"pending": 0, "judged": 0, "trained": 1, "dropped": 0}
    assert (st.steps, st.latest_version) == (1, 1)


# --- export -------------------------------------------------------------------------------------
def test_export_jsonl_writes_every_turn_with_ids_logprobs_and_judgments(
    store: Store, tmp_path: Path
) -> None:
    t0 = datetime.now(UTC)
    early = turn("e", created_at=t0 - timedelta(hours=1))
    store.record_turn(early)
    recs = [turn("s1", logprobs=(-0.1, -0.2, -1 / 3, -math.inf)) for _ in range(250)]  # > a page
    for r in recs:
        store.record_turn(r)
    store.attach_next_state(recs[0].id, [{"role": "user", "content": "thanks"}])
    votes = (JudgeVote(raw="\\boxed{1}", value=1.0),)
    store.add_judgment(Judgment(turn_id=recs[0].id, judge="prm", kind="prm", votes=votes, reward=1.0))
    store.create_sample(recs[0].id, "binary", reward=1.0, advantages=[1.0] * 4)

    path = tmp_path / "out" / "turns.jsonl"
    assert store.export_jsonl(path) == 251
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [o["id"] for o in lines] == [early.id] + [r.id for r in recs]
    first = lines[1]
    assert first["prompt_ids"] == list(range(100, 110))
    assert first["completion_ids"] == [200, 201, 202, 203]
    assert first["logprobs"][:3] == [-0.1, -0.2, -1 / 3] and first["logprobs"][3] == -math.inf
    assert first["next_state"] == [{"role": "user", "content": "thanks"}]
    assert first["judgments"][0]["votes"] == [{"raw": "\\boxed{1}", "value": 1.0, "error": None}]
    assert first["samples"][0]["method"] == "binary"

    buf = io.StringIO()
    assert store.export_jsonl(buf, since=t0 - timedelta(minutes=1)) == 250
    assert early.id not in buf.getvalue()


# --- crash durability ---------------------------------------------------------------------------
WRITER_SCRIPT = r"""
import asyncio, sys
from clawbridge.store import Store, TurnRecord

async def main(url: str) -> None:
    store = Store.open(url)
    async def client(w: int) -> None:
        n = 0
        while True:
            rec = TurnRecord(
                session_id=f"s{w}", messages=[{"role": "user", "content": "x" * 200}],
                prompt_ids=tuple(range(500)), completion_ids=tuple(range(64)),
                logprobs=tuple(-0.01 * i for i in range(64)), version=0,
                finish_reason="stop", response={"role": "assistant", "content": "y" * 200},
                id=f"t-{w}-{n}",
            )
            await store.record_turn_async(rec)
            # Acknowledged: this is where the proxy would send the response.
            sys.stdout.write(rec.id + "\n")
            sys.stdout.flush()
            n += 1
    await asyncio.gather(*(client(w) for w in range(16)))

asyncio.run(main(sys.argv[1]))
"""


def test_every_acknowledged_turn_survives_kill_9(db_url: str, tmp_path: Path) -> None:
    Store.open(db_url).close()  # migrate first, so the kill lands in the write load
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), db_url], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    acked: list[str] = []
    try:
        assert proc.stdout is not None
        while len(acked) < 200:
            line = proc.stdout.readline()
            if not line:
                break
            acked.append(line.strip())
        os.kill(proc.pid, signal.SIGKILL)
        acked += [line.strip() for line in proc.stdout if line.endswith("\n")]
        proc.wait(timeout=10)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) >= 200
    s = Store.open(db_url)
    try:
        stored = all_turn_ids(s)
        missing = set(acked) - stored
        assert not missing, f"{len(missing)} acknowledged turns lost"
        if s.dialect == "sqlite":
            with s.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
    finally:
        s.close()


def test_a_sqlite_store_backs_up_while_open_and_postgresql_says_to_use_pg_dump(
    store: Store, tmp_path: Path
) -> None:
    from clawbridge.store import StoreError

    rec = turn()
    store.record_turn(rec)
    if store.dialect != "sqlite":
        with pytest.raises(StoreError, match="pg_dump"):
            store.backup(tmp_path / "b.db")
        return
    copy = store.backup(tmp_path / "backups" / "b.db")
    with Store.open(f"sqlite:///{copy}") as restored:
        got = restored.get_turn(rec.id)
        assert got is not None and got.logprobs == rec.logprobs


def test_opening_creates_the_sqlite_directory_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c.db"
    with Store.open(f"sqlite:///{path}") as s, s.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    assert path.exists()


# --- message deltas: a turn stores only what it adds ----------------------------------------------
def growing_session(turns: int, session: str = "s1") -> list[TurnRecord]:
    """OpenClaw-shaped requests: a big system prompt, history, and a rebuilt last message that
    the next request drops."""
    system = {"role": "system", "content": "You are an agent. " * 500}
    history: list[dict[str, Any]] = [system]
    recs = []
    for i in range(turns):
        history.append({"role": "user", "content": f"step {i} ✓"})
        internal = {"role": "user", "content": [{"type": "text", "text": f"<<<INTERNAL>>> {i}"}]}
        recs.append(turn(session, messages=[*history, internal]))
        history.append({"role": "assistant", "content": f"done {i}", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": '{"n": 1}'}}]})
        history.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"})
    return recs


def stored_messages(store: Store) -> dict[str, tuple[str | None, int, list[Any]]]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, messages_base, messages_keep, messages FROM turns"))
        return {r.id: (r.messages_base, r.messages_keep, json.loads(r.messages) if isinstance(r.messages, str) else r.messages) for r in rows}


async def test_a_growing_session_stores_only_the_messages_each_turn_adds(store: Store) -> None:
    recs = growing_session(6)
    for rec in recs:
        await store.record_turn_async(rec)
    raw = stored_messages(store)
    assert raw[recs[0].id][0] is None and len(raw[recs[0].id][2]) == 3  # the first is whole
    for prev, rec in itertools.pairwise(recs):
        base, keep, own = raw[rec.id]
        # extends the previous turn without its rebuilt last message: new are the assistant's
        # reply, the tool result, the user's message and the new internal context
        assert (base, keep) == (prev.id, len(prev.messages) - 1)
        assert own == rec.messages[keep:] and len(own) == 4
    # every reader gets the whole list back, exactly
    assert [t.messages for t in store.session_turns("s1")] == [r.messages for r in recs]
    assert store.get_turn(recs[-1].id).messages == recs[-1].messages  # type: ignore[union-attr]
    out = io.StringIO()
    store.export_jsonl(out)
    assert [json.loads(line)["messages"] for line in out.getvalue().splitlines()] == [r.messages for r in recs]
    store.attach_next_state(recs[-1].id, [{"role": "user", "content": "thanks"}])
    assert [t.messages for t in store.turns_awaiting_judgment()] == [recs[-1].messages]


def test_reading_a_turn_walks_a_bounded_chain_of_deltas(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from clawbridge.store import capture

    monkeypatch.setattr(capture, "MAX_MESSAGE_CHAIN", 3)
    recs = growing_session(9)
    for rec in recs:
        store.record_turn(rec)
    raw = stored_messages(store)

    def depth(turn_id: str) -> int:
        base = raw[turn_id][0]
        return 0 if base is None else 1 + depth(base)

    assert max(depth(r.id) for r in recs) == 3  # then a turn stores its whole list again
    assert sum(raw[r.id][0] is None for r in recs) >= 2
    assert store.get_turn(recs[7].id).messages == recs[7].messages  # type: ignore[union-attr]
    assert [t.messages for t in store.session_turns("s1")] == [r.messages for r in recs]


def test_changing_a_recorded_message_list_afterwards_changes_nothing_stored(store: Store) -> None:
    a = turn(messages=[{"role": "user", "content": "one"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}])
    store.record_turn(a)
    a.messages[0]["content"] = "changed in place"
    a.messages[1]["content"][0]["text"] = "changed too"
    b = turn(messages=[{"role": "user", "content": "changed in place"}, {"role": "user", "content": [{"type": "text", "text": "changed too"}]}, {"role": "user", "content": "two"}])
    store.record_turn(b)
    assert store.get_turn(b.id).messages == b.messages  # type: ignore[union-attr]
    assert store.get_turn(a.id).messages[0]["content"] == "one"  # type: ignore[union-attr]


def test_values_python_calls_equal_but_json_does_not_are_never_shared(store: Store) -> None:
    a = turn(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "n": 1}]}])
    b = turn(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "n": True}]}, {"role": "user", "content": "y"}])
    store.record_turn(a)
    store.record_turn(b)
    got = store.get_turn(b.id)
    assert got is not None and got.messages[0]["content"][0]["n"] is True


def test_side_turns_between_main_turns_do_not_break_the_main_chain(store: Store) -> None:
    recs = growing_session(4)
    side = turn(messages=[{"role": "user", "content": "title for this chat?"}], turn_type="side")
    store.record_turn(recs[0])
    store.record_turn(side)
    for rec in recs[1:]:
        store.record_turn(rec)
    raw = stored_messages(store)
    assert raw[side.id][0] is None
    assert raw[recs[1].id][0] == recs[0].id
    by_index = sorted(store.session_turns("s1"), key=lambda t: t.index)
    assert [t.messages for t in by_index] == [recs[0].messages, side.messages, *(r.messages for r in recs[1:])]


def test_choices_of_one_request_and_a_reopened_store_stay_whole(db_url: str) -> None:
    recs = growing_session(2)
    s = Store.open(db_url)
    s.record_turn(recs[0])
    twin = turn(messages=recs[0].messages)  # n = 2: the second choice has the same messages
    s.record_turn(twin)
    s.close()
    s = Store.open(db_url)  # remembers nothing: its first turn of the session is stored whole
    s.record_turn(recs[1])
    raw = stored_messages(s)
    assert raw[twin.id][:2] == (recs[0].id, len(recs[0].messages)) and raw[twin.id][2] == []
    assert raw[recs[1].id][0] is None
    by_index = sorted(s.session_turns("s1"), key=lambda t: t.index)
    assert [t.messages for t in by_index] == [recs[0].messages, recs[0].messages, recs[1].messages]
    s.close()


def test_downgrading_writes_whole_lists_back(tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'down.db'}"
    s = Store.open(url)
    recs = growing_session(4)
    for rec in recs:
        s.record_turn(rec)
    with s.engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0001")
    with s.engine.connect() as conn:
        rows = dict(conn.execute(sa.text("SELECT id, messages FROM turns")).all())
    assert {i: json.loads(m) for i, m in rows.items()} == {r.id: r.messages for r in recs}
    s.close()


def test_a_store_written_before_deltas_and_next_state_rows_upgrades_in_place(db_url: str) -> None:
    """Revision 0001 data (whole message lists, next states on the turn row) reads back the
    same after `Store.open` migrates to head."""
    from clawbridge.store.records import pack_floats, pack_ids

    s = Store.open(db_url, migrate=False)
    s.migrate("0001")
    now = datetime.now(UTC)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi ✓"}]
    with s.engine.begin() as conn:
        md = sa.MetaData()
        sessions = sa.Table("sessions", md, autoload_with=conn)
        turns = sa.Table("turns", md, autoload_with=conn)
        conn.execute(sessions.insert().values(id="old", source="header", created_at=now, updated_at=now,
                                              turns=2, main_turns=2, done=False))
        for i, (tid, ns) in enumerate((("t-old-0", [{"role": "user", "content": "thanks"}]), ("t-old-1", None))):
            conn.execute(turns.insert().values(
                id=tid, session_id="old", idx=i, turn_type="main", tagged=True, train=True, version=0,
                finish_reason="stop", n_prompt=2, n_completion=1, created_at=now,
                next_state_at=now if ns else None, next_state=ns, sampling={}, request_params={},
                response={"role": "assistant", "content": "yo"}, completion_ids=pack_ids([5]),
                logprobs=pack_floats([-0.5]), messages=messages, prompt_ids=pack_ids([1, 2]),
            ))
    s.close()
    s = Store.open(db_url)
    got = {t.id: t for t in s.session_turns("old")}
    assert got["t-old-0"].messages == messages and got["t-old-0"].next_state == [{"role": "user", "content": "thanks"}]
    assert got["t-old-0"].next_state_at is not None and got["t-old-1"].next_state is None
    assert s.stats().awaiting_next_state == 1
    # and the session goes on with deltas from there
    rec = turn("old", messages=[*messages, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}])
    s.record_turn(rec)
    assert s.get_turn(rec.id).messages == rec.messages  # type: ignore[union-attr]
    s.close()
