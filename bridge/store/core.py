"""The store: the source of truth every loop resumes from after a crash.

Sync core (SQLAlchemy Core over SQLite in WAL mode or PostgreSQL), with async entry points that
never block the event loop: writes go through the group-commit `AsyncWriter`, reads through a
worker thread (`Store.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from functools import partial
from importlib import resources
from pathlib import Path
from typing import IO, Any, ParamSpec, TypeVar

import sqlalchemy as sa
from clawbridge.chat.prefix import shared_prefix, snapshot
from clawbridge.store import codec
from clawbridge.store import schema as t
from clawbridge.store.fast import Prepared, existing_ids_sql
from clawbridge.store.records import (
    JSONObject,
    Judgment,
    PolicyVersionRow,
    Sample,
    SessionRow,
    SessionSource,
    StoredTurn,
    StoreStats,
    TrainingStep,
    TurnRecord,
    pack_floats,
    utcnow,
)
from clawbridge.store.writer import AsyncWriter
from clawbridge.types import SampleState
from sqlalchemy.dialects import postgresql, sqlite

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_THREADS = 4
# A turn stores only the messages it adds to a recent turn of its session (`messages_base`);
# every MAX_MESSAGE_CHAIN turns in a chain one stores its whole list, so reading a turn back never
# walks more than that many rows. RECENT_SESSIONS bounds what the writer remembers.
MAX_MESSAGE_CHAIN = 32
RECENT_SESSIONS = 256
RECENT_PER_SESSION = 2  # the last main and side turns, say: each extends its own kind
# Which states a sample may move to, and from where. `trained` and `dropped` are final: that is
# what makes "no sample is trained twice" a property of the database, not of the trainer.
TRANSITIONS: dict[str, frozenset[str]] = {
    "pending": frozenset(),
    "judged": frozenset({"pending"}),
    "trained": frozenset({"judged"}),
    "dropped": frozenset({"pending", "judged"}),
}


class StoreError(RuntimeError):
    """A request the store refuses (inside, typed; the API edge maps it)."""


class SampleStateError(StoreError):
    """A sample is not in a state the requested transition starts from."""


@dataclass(frozen=True)
class _Recent:
    """A turn the writer recorded lately: what the session's next turns may extend."""

    turn_id: str
    messages: list[Any]  # its whole list, snapshotted (the caller's dicts may change later)
    depth: int  # turns between it and the nearest turn that stores its whole list


class Store:
    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._writer: AsyncWriter | None = None
        # Reads get their own threads: a slow query must not starve the event loop's default
        # executor, which the rest of the process shares.
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="clawbridge-store")
        self._recent: OrderedDict[str, list[_Recent]] = OrderedDict()  # session id -> newest first
        self._recent_lock = threading.Lock()
        self._writer_conn: sa.Connection | None = None  # the writer thread's own connection
        # The capture path's statements, compiled once and run on the DBAPI cursor (`fast.py`).
        dialect = engine.dialect
        self._insert_turn = Prepared(t.turns.insert(), dialect)
        ins = self._insert(t.sessions)
        upsert = ins.on_conflict_do_update(
            index_elements=[t.sessions.c.id],
            set_={
                "turns": t.sessions.c.turns + ins.excluded.turns,
                "main_turns": t.sessions.c.main_turns + ins.excluded.main_turns,
                "updated_at": ins.excluded.updated_at,
            },
        ).returning(t.sessions.c.turns)
        self._upsert_session_for_turns = Prepared(upsert, dialect)
        # One statement: insert the next state if its turn exists and has none yet.
        insert_next_state = (
            self._insert(t.next_states)
            .from_select(
                ["turn_id", "created_at", "messages"],
                sa.select(
                    t.turns.c.id,
                    sa.bindparam("at", type_=t.next_states.c.created_at.type),
                    sa.bindparam("messages", type_=t.next_states.c.messages.type),
                ).where(t.turns.c.id == sa.bindparam("turn_id")),
            )
            .on_conflict_do_nothing()
            .returning(t.next_states.c.turn_id)
        )
        self._insert_next_state = Prepared(insert_next_state, dialect)

    # --- opening ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls, url: str, *, migrate: bool = True, sqlite_synchronous: str = "NORMAL"
    ) -> Store:
        """Open (creating the directory of a SQLite file) and bring the schema to the newest
        migration. `sqlite_synchronous="FULL"` makes every commit survive a power loss too, at
        one fsync per commit (per group commit with the writer)."""
        if sqlite_synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise StoreError(f"sqlite_synchronous must be NORMAL, FULL or EXTRA, not {sqlite_synchronous}")
        sa_url = sa.make_url(url)
        if sa_url.get_backend_name() == "sqlite":
            if not sa_url.database or sa_url.database == ":memory:":
                raise StoreError("the store needs a SQLite file (sqlite:///path/clawbridge.db)")
            Path(sa_url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            engine = sa.create_engine(
                sa_url,
                json_serializer=codec.dumps,
                connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
                pool_size=8,
                max_overflow=16,
            )
            _configure_sqlite(engine, sqlite_synchronous.upper())
        else:
            engine = sa.create_engine(sa_url, json_serializer=codec.dumps, pool_pre_ping=True)
        store = cls(engine)
        if migrate:
            store.migrate()
        return store

    def migrate(self, revision: str = "head") -> None:
        from alembic import command

        with self._write() as conn:
            if self.dialect == "postgresql":
                # Two processes opening a fresh database at once: one migrates, one waits.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7411290305)"))
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._writer_conn is not None:
            self._writer_conn.close()
            self._writer_conn = None
        self._readers.shutdown(wait=True)
        self.engine.dispose()

    async def aclose(self) -> None:
        """`close()` off the event loop (it waits for the writer to drain)."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transactions -------------------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        """A write transaction; on SQLite it takes the write lock at BEGIN (IMMEDIATE), so a
        read-then-write never fails on a stale snapshot."""
        with self.engine.connect() as conn:
            conn.execution_options(clawbridge_write=True)
            with conn.begin():
                yield conn

    @contextmanager
    def _writer_txn(self) -> Iterator[sa.Connection]:
        """A write transaction for the writer thread, on a connection it keeps: checking one out
        of the pool for every group commit costs more than the commit. After a failure the
        connection is dropped and the next transaction opens a fresh one."""
        conn = self._writer_conn
        if conn is None:
            conn = self._writer_conn = self.engine.connect()
            conn.execution_options(clawbridge_write=True)
        try:
            with conn.begin():
                yield conn
        except BaseException:
            self._writer_conn = None
            with contextlib.suppress(Exception):
                conn.close()
            raise

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def _insert(self, table: sa.Table) -> Any:
        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(table)

    # --- async --------------------------------------------------------------------------------
    @property
    def writer(self) -> AsyncWriter:
        if self._writer is None:
            self._writer = AsyncWriter(self._writer_txn)
        return self._writer

    async def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Any sync method, in a worker thread: `await store.run(store.stats)`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, partial(fn, *args, **kwargs))

    async def record_turn_async(self, rec: TurnRecord) -> str:
        """Durable (committed, group-committed with concurrent writes) when it returns."""
        return await self.writer.write_many(self._record_turns, rec)

    async def attach_next_state_async(
        self, turn_id: str, next_state: list[JSONObject], at: datetime | None = None
    ) -> bool:
        return await self.writer.write(partial(self._attach_next_state, turn_id, next_state, at))

    async def upsert_session_async(self, session_id: str, source: SessionSource = "new") -> bool:
        return await self.writer.write(partial(self._upsert_session, session_id, source))

    async def close_session_async(self, session_id: str, reason: str) -> bool:
        return await self.writer.write(partial(self._close_session, session_id, reason))

    # --- sessions -----------------------------------------------------------------------------
    def upsert_session(self, session_id: str, source: SessionSource = "new") -> bool:
        """Create the session if it is new (True); otherwise only touch `updated_at`."""
        with self._write() as conn:
            return self._upsert_session(session_id, source, conn)

    def _upsert_session(self, session_id: str, source: str, conn: sa.Connection) -> bool:
        now = utcnow()
        exists = conn.execute(
            sa.update(t.sessions).where(t.sessions.c.id == session_id).values(updated_at=now)
        ).rowcount
        if exists:
            return False
        conn.execute(
            t.sessions.insert().values(
                id=session_id, source=source, created_at=now, updated_at=now, turns=0,
                main_turns=0, done=False,
            )
        )
        return True

    def close_session(self, session_id: str, reason: str) -> bool:
        """Mark the session done (True if it was open)."""
        with self._write() as conn:
            return self._close_session(session_id, reason, conn)

    def _close_session(self, session_id: str, reason: str, conn: sa.Connection) -> bool:
        now = utcnow()
        res = conn.execute(
            sa.update(t.sessions)
            .where(t.sessions.c.id == session_id, t.sessions.c.done == sa.false())
            .values(done=True, done_reason=reason, done_at=now, updated_at=now)
        )
        return bool(res.rowcount)

    def get_session(self, session_id: str) -> SessionRow | None:
        with self._read() as conn:
            row = conn.execute(sa.select(t.sessions).where(t.sessions.c.id == session_id)).first()
        return None if row is None else SessionRow(**row._asdict())

    def idle_sessions(self, updated_before: datetime) -> list[str]:
        """Open sessions with no activity since `updated_before` (for the idle timeout)."""
        with self._read() as conn:
            rows = conn.execute(
                sa.select(t.sessions.c.id).where(
                    t.sessions.c.done == sa.false(), t.sessions.c.updated_at < updated_before
                )
            )
            return [r.id for r in rows]

    # --- turns --------------------------------------------------------------------------------
    def record_turn(self, rec: TurnRecord) -> str:
        """Commit one turn (and create or touch its session); durable when it returns. Recording
        the same turn id twice is a no-op, so a retry after a lost acknowledgement is safe."""
        with self._write() as conn:
            return self._record_turns(conn, [rec])[0]

    def _record_turns(self, conn: sa.Connection, recs: list[TurnRecord]) -> list[str]:
        """Insert many turns with a few statements: one lookup for ids already stored, one
        session upsert per session (its turn count numbers the new turns), one multi-row
        insert; on the DBAPI cursor (`fast.py`), since every answer waits for this."""
        with closing(conn.connection.cursor()) as cur:
            return self._insert_turns(cur, recs)

    def _insert_turns(self, cur: Any, recs: list[TurnRecord]) -> list[str]:
        ids = [r.id for r in recs]
        with self._recent_lock:
            recent = {r.session_id: list(self._recent.get(r.session_id, ())) for r in recs}
        # One lookup: which of these turns are stored already, and which remembered turns (the
        # bases the new ones may extend) really are committed.
        lookup = ids + [c.turn_id for cs in recent.values() for c in cs]
        sql, bind = existing_ids_sql(self.engine.dialect, t.turns, len(lookup))
        stored = {row[0] for row in cur.execute(sql, bind(lookup)).fetchall()}
        seen = {i for i in ids if i in stored}
        by_session: dict[str, list[TurnRecord]] = {}
        for rec in recs:
            if rec.id not in seen:
                seen.add(rec.id)
                by_session.setdefault(rec.session_id, []).append(rec)
        rows: list[dict[str, Any]] = []
        for session_id, new in by_session.items():
            main = sum(r.turn_type == "main" for r in new)
            # The session row is the per-session lock: its turn count gives the turns' indexes.
            count = self._upsert_session_for_turns.execute(
                cur,
                {
                    "id": session_id, "source": new[0].session_source,
                    "created_at": new[0].created_at,
                    "updated_at": max(r.created_at for r in new),
                    "turns": len(new), "main_turns": main, "done": False,
                },
            ).fetchone()[0]
            bases = [c for c in recent[session_id] if c.turn_id in stored]
            for k, r in enumerate(new):
                base, keep = _best_base(bases, r.messages)
                rows.append(codec.turn_row(r, count - len(new) + k, base.turn_id if base else None, keep))
                if base is None:
                    mine = _Recent(r.id, [snapshot(m) for m in r.messages], 0)
                else:
                    tail = [snapshot(m) for m in r.messages[keep:]]
                    mine = _Recent(r.id, base.messages[:keep] + tail, base.depth + 1)
                bases = [mine, *bases][:RECENT_PER_SESSION]
            recent[session_id] = bases
        if rows:
            self._insert_turn.executemany(cur, rows)
        # Remembered before the commit: if it fails, the next batch's lookup finds these ids
        # missing and stores whole lists again.
        with self._recent_lock:
            for session_id in by_session:
                self._recent[session_id] = recent[session_id]
                self._recent.move_to_end(session_id)
            while len(self._recent) > RECENT_SESSIONS:
                self._recent.popitem(last=False)
        return ids

    def attach_next_state(
        self, turn_id: str, next_state: list[JSONObject], at: datetime | None = None
    ) -> bool:
        """Attach the turn's next state; the first one wins (True if this call attached it)."""
        with self._write() as conn:
            return self._attach_next_state(turn_id, next_state, at, conn)

    def _attach_next_state(
        self, turn_id: str, next_state: list[JSONObject], at: datetime | None, conn: sa.Connection
    ) -> bool:
        params = {"turn_id": turn_id, "messages": next_state, "at": at or utcnow()}
        with closing(conn.connection.cursor()) as cur:
            return self._insert_next_state.execute(cur, params).fetchone() is not None

    def get_turn(self, turn_id: str) -> StoredTurn | None:
        with self._read() as conn:
            found = self._turns(conn, t.turns.c.id == turn_id)
        return found[0] if found else None

    def session_turns(self, session_id: str) -> list[StoredTurn]:
        with self._read() as conn:
            return self._turns(conn, t.turns.c.session_id == session_id)

    def last_turn(self, session_id: str, turn_type: str = "main") -> StoredTurn | None:
        with self._read() as conn:
            found = self._turns(
                conn,
                sa.and_(t.turns.c.session_id == session_id, t.turns.c.turn_type == turn_type),
                order=t.turns.c.idx.desc(),
                limit=1,
            )
        return found[0] if found else None

    def turns_awaiting_judgment(
        self, kinds: Sequence[str] = ("prm",), limit: int = 100
    ) -> list[StoredTurn]:
        """Main, trainable turns that have a next state but lack a judgment of one of `kinds`
        (oldest first). `StoredTurn.judged_kinds` says which kinds they already have, so a
        judge loop that crashed half-way resumes with the missing ones."""
        j = t.judgments
        missing = sa.or_(
            *(~sa.exists().where(j.c.turn_id == t.turns.c.id, j.c.kind == k) for k in kinds)
        )
        with self._read() as conn:
            return self._turns(
                conn,
                sa.and_(
                    t.turns.c.turn_type == "main",
                    t.turns.c.train == sa.true(),
                    t.next_states.c.turn_id.is_not(None),
                    missing,
                ),
                limit=limit,
            )

    def _turns(
        self,
        conn: sa.Connection,
        where: sa.ColumnElement[bool],
        *,
        order: Any = None,
        limit: int | None = None,
    ) -> list[StoredTurn]:
        ns = t.next_states.c
        q = (
            sa.select(
                t.turns,
                t.sessions.c.source.label("session_source"),
                ns.messages.label("next_state"),
                ns.created_at.label("next_state_at"),
            )
            .join(t.sessions, t.sessions.c.id == t.turns.c.session_id)
            .outerjoin(t.next_states, ns.turn_id == t.turns.c.id)
            .where(where)
            .order_by(
                order if order is not None else t.turns.c.created_at, t.turns.c.id
            )
        )
        if limit is not None:
            q = q.limit(limit)
        rows = conn.execute(q).all()
        kinds: dict[str, set[str]] = {}
        if rows:
            for tid, kind in conn.execute(
                sa.select(t.judgments.c.turn_id, t.judgments.c.kind).where(
                    t.judgments.c.turn_id.in_([r.id for r in rows])
                )
            ):
                kinds.setdefault(tid, set()).add(kind)
        whole = self._whole_messages(conn, rows)
        return [codec.turn_from_row(r, frozenset(kinds.get(r.id, ())), whole[r.id]) for r in rows]

    def _whole_messages(self, conn: sa.Connection, rows: Sequence[Any]) -> dict[str, list[JSONObject]]:
        """Each row's whole message list: its base's first `messages_keep` messages, then its
        own. The bases outside `rows` come in one recursive query, up to the turns that store a
        whole list (at most MAX_MESSAGE_CHAIN away)."""
        parts: dict[str, tuple[str | None, int, list[JSONObject]]] = {
            r.id: (r.messages_base, r.messages_keep, r.messages) for r in rows
        }
        missing = {r.messages_base for r in rows if r.messages_base is not None} - parts.keys()
        if missing:
            tu = t.turns
            chain = (
                sa.select(tu.c.id, tu.c.messages_base)
                .where(tu.c.id.in_(sorted(missing)))
                .cte("chain", recursive=True)
            )
            chain = chain.union(
                sa.select(tu.c.id, tu.c.messages_base).join(chain, tu.c.id == chain.c.messages_base)
            )
            for r in conn.execute(
                sa.select(tu.c.id, tu.c.messages_base, tu.c.messages_keep, tu.c.messages).where(
                    tu.c.id.in_(sa.select(chain.c.id))
                )
            ):
                parts[r.id] = (r.messages_base, r.messages_keep, r.messages)
        whole: dict[str, list[JSONObject]] = {}

        def resolve(turn_id: str) -> None:
            # Iterative: walk up to a whole list (or one resolved already), then back down.
            path = []
            while turn_id not in whole:
                base, _, own = parts[turn_id]
                if base is None:
                    whole[turn_id] = own
                    break
                path.append(turn_id)
                turn_id = base
            for tid in reversed(path):
                base, keep, own = parts[tid]
                assert base is not None
                whole[tid] = whole[base][:keep] + own

        for r in rows:
            resolve(r.id)
        return whole

    # --- judgments ----------------------------------------------------------------------------
    def add_judgment(self, judgment: Judgment) -> int:
        """Store a judgment with every vote. Idempotent per (turn, kind, judge): a second call
        returns the first judgment's id and changes nothing."""
        with self._write() as conn:
            ins = (
                self._insert(t.judgments)
                .values(
                    turn_id=judgment.turn_id,
                    judge=judgment.judge,
                    kind=judgment.kind,
                    votes=[asdict(v) for v in judgment.votes],
                    reward=judgment.reward,
                    hint=judgment.hint,
                    created_at=judgment.created_at,
                )
                .on_conflict_do_nothing()
                .returning(t.judgments.c.id)
            )
            new_id = conn.execute(ins).scalar()
            if new_id is not None:
                return int(new_id)
            return int(
                conn.execute(
                    sa.select(t.judgments.c.id).where(
                        t.judgments.c.turn_id == judgment.turn_id,
                        t.judgments.c.kind == judgment.kind,
                        t.judgments.c.judge == judgment.judge,
                    )
                ).scalar_one()
            )

    def judgments(self, turn_id: str) -> list[Judgment]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(t.judgments)
                .where(t.judgments.c.turn_id == turn_id)
                .order_by(t.judgments.c.id)
            ).all()
        return [codec.judgment_from_row(r) for r in rows]

    # --- samples ------------------------------------------------------------------------------
    def create_sample(
        self,
        turn_id: str,
        method: str,
        *,
        state: SampleState = "judged",
        reward: float | None = None,
        hint: str | None = None,
        teacher_logprobs: Sequence[float] | None = None,
        advantages: Sequence[float] | None = None,
        reason: str | None = None,
    ) -> tuple[int, bool]:
        """Create the turn's sample for `method`, or find the one that exists: returns
        (id, created). The policy version is the turn's."""
        if state not in ("pending", "judged", "dropped"):
            raise SampleStateError(f"a sample starts pending, judged or dropped, not {state}")
        with self._write() as conn:
            turn = conn.execute(
                sa.select(t.turns.c.version, t.turns.c.n_completion).where(t.turns.c.id == turn_id)
            ).first()
            if turn is None:
                raise StoreError(f"no turn {turn_id}")
            _check_len(turn.n_completion, advantages, "advantages")
            _check_len(turn.n_completion, teacher_logprobs, "teacher logprobs")
            now = utcnow()
            new_id = conn.execute(
                self._insert(t.samples)
                .values(
                    turn_id=turn_id, method=method, state=state, reason=reason, reward=reward,
                    hint=hint,
                    teacher_logprobs=codec.pack_opt(teacher_logprobs),
                    advantages=codec.pack_opt(advantages),
                    version=turn.version, created_at=now, updated_at=now,
                )
                .on_conflict_do_nothing()
                .returning(t.samples.c.id)
            ).scalar()
            if new_id is not None:
                return int(new_id), True
            old = conn.execute(
                sa.select(t.samples.c.id).where(
                    t.samples.c.turn_id == turn_id, t.samples.c.method == method
                )
            ).scalar_one()
            return int(old), False

    def set_sample_advantages(
        self,
        sample_id: int,
        advantages: Sequence[float],
        *,
        teacher_logprobs: Sequence[float] | None = None,
        reward: float | None = None,
        hint: str | None = None,
    ) -> None:
        """Complete a pending sample (e.g. once the teacher scored it): pending -> judged."""
        with self._write() as conn:
            n = conn.execute(
                sa.select(t.turns.c.n_completion)
                .join(t.samples, t.samples.c.turn_id == t.turns.c.id)
                .where(t.samples.c.id == sample_id)
            ).scalar()
            if n is None:
                raise StoreError(f"no sample {sample_id}")
            _check_len(n, advantages, "advantages")
            _check_len(n, teacher_logprobs, "teacher logprobs")
            values: dict[str, Any] = {
                "state": "judged", "advantages": pack_floats(advantages), "updated_at": utcnow()
            }
            if teacher_logprobs is not None:
                values["teacher_logprobs"] = pack_floats(teacher_logprobs)
            if reward is not None:
                values["reward"] = reward
            if hint is not None:
                values["hint"] = hint
            res = conn.execute(
                sa.update(t.samples)
                .where(t.samples.c.id == sample_id, t.samples.c.state == "pending")
                .values(**values)
            )
            if res.rowcount != 1:
                raise SampleStateError(f"sample {sample_id} is not pending")

    def pending_samples(
        self,
        limit: int | None = None,
        *,
        method: str | None = None,
        state: SampleState = "judged",
    ) -> list[Sample]:
        """Samples waiting for the trainer (state `judged`: advantages ready), oldest first.
        `state="pending"` lists those still waiting for their advantages."""
        s = t.samples
        q = (
            sa.select(
                s,
                t.turns.c.prompt_ids,
                t.turns.c.completion_ids,
                t.turns.c.logprobs,
                t.turns.c.sampling,
            )
            .join(t.turns, t.turns.c.id == s.c.turn_id)
            .where(s.c.state == state)
            .order_by(s.c.id)
        )
        if method is not None:
            q = q.where(s.c.method == method)
        if limit is not None:
            q = q.limit(limit)
        with self._read() as conn:
            return [codec.sample_from_row(r) for r in conn.execute(q)]

    def get_samples(self, ids: Sequence[int]) -> list[Sample]:
        s = t.samples
        q = (
            sa.select(
                s, t.turns.c.prompt_ids, t.turns.c.completion_ids, t.turns.c.logprobs,
                t.turns.c.sampling,
            )
            .join(t.turns, t.turns.c.id == s.c.turn_id)
            .where(s.c.id.in_(list(ids)))
            .order_by(s.c.id)
        )
        with self._read() as conn:
            return [codec.sample_from_row(r) for r in conn.execute(q)]

    def mark_samples(
        self,
        ids: Sequence[int],
        state: SampleState,
        reason: str | None = None,
        step: int | None = None,
    ) -> int:
        """Move every sample in `ids` to `state`, all or none: if any is not in a state that
        `state` may follow (see TRANSITIONS), nothing changes and SampleStateError is raised."""
        with self._write() as conn:
            return self._mark(conn, ids, state, reason, step)

    def _mark(
        self,
        conn: sa.Connection,
        ids: Sequence[int],
        state: str,
        reason: str | None,
        step: int | None,
    ) -> int:
        wanted = set(ids)
        if not wanted:
            return 0
        sources = TRANSITIONS.get(state)
        if not sources:
            raise SampleStateError(f"no sample can move to {state!r}")
        res = conn.execute(
            sa.update(t.samples)
            .where(t.samples.c.id.in_(sorted(wanted)), t.samples.c.state.in_(sorted(sources)))
            .values(state=state, reason=reason, step=step, updated_at=utcnow())
        )
        if res.rowcount != len(wanted):
            current = {
                r.id: r.state
                for r in conn.execute(
                    sa.select(t.samples.c.id, t.samples.c.state).where(
                        t.samples.c.id.in_(sorted(wanted))
                    )
                )
            }
            bad = {i: current.get(i, "missing") for i in wanted if current.get(i) not in sources}
            raise SampleStateError(f"cannot move samples to {state}: {bad}")
        return len(wanted)

    def drop_stale_samples(self, current_version: int, max_staleness: int) -> int:
        """Drop untrained samples produced more than `max_staleness` versions ago."""
        with self._write() as conn:
            res = conn.execute(
                sa.update(t.samples)
                .where(
                    t.samples.c.state.in_(("pending", "judged")),
                    t.samples.c.version < current_version - max_staleness,
                )
                .values(state="dropped", reason="stale", updated_at=utcnow())
            )
            return int(res.rowcount)

    # --- training -----------------------------------------------------------------------------
    def record_training_step(
        self,
        step: TrainingStep,
        sample_ids: Sequence[int],
        policy: PolicyVersionRow | None = None,
    ) -> None:
        """In ONE transaction: the step row, its samples judged -> trained, and (optionally) the
        policy version it published. A crash before the commit leaves every sample judged (it
        will be trained again, as the weights of that step were never recorded either); a
        sample already trained makes the whole step fail. Either way none is trained twice."""
        with self._write() as conn:
            n = self._mark(conn, sample_ids, "trained", None, step.step)
            conn.execute(
                t.training_steps.insert().values(
                    step=step.step,
                    version_before=step.version_before,
                    version_after=step.version_after,
                    metrics=step.metrics,
                    samples=n,
                    created_at=step.created_at,
                )
            )
            if policy is not None:
                self._put_version(conn, policy)

    def training_steps(self) -> list[TrainingStep]:
        with self._read() as conn:
            rows = conn.execute(sa.select(t.training_steps).order_by(t.training_steps.c.step))
            return [TrainingStep(**r._asdict()) for r in rows]

    def record_policy_version(self, row: PolicyVersionRow) -> None:
        with self._write() as conn:
            self._put_version(conn, row)

    def _put_version(self, conn: sa.Connection, row: PolicyVersionRow) -> None:
        values = asdict(row)
        ins = self._insert(t.policy_versions).values(**values)
        conn.execute(
            ins.on_conflict_do_update(
                index_elements=[t.policy_versions.c.version],
                set_={k: ins.excluded[k] for k in values if k != "version"},
            )
        )

    def latest_version(self) -> PolicyVersionRow | None:
        with self._read() as conn:
            row = conn.execute(
                sa.select(t.policy_versions).order_by(t.policy_versions.c.version.desc()).limit(1)
            ).first()
        return None if row is None else PolicyVersionRow(**row._asdict())

    def versions(self) -> list[PolicyVersionRow]:
        with self._read() as conn:
            rows = conn.execute(sa.select(t.policy_versions).order_by(t.policy_versions.c.version))
            return [PolicyVersionRow(**r._asdict()) for r in rows]

    # --- meta ---------------------------------------------------------------------------------
    def get_meta(self, key: str, default: Any = None) -> Any:
        with self._read() as conn:
            row = conn.execute(sa.select(t.meta.c.value).where(t.meta.c.key == key)).first()
        return default if row is None else row.value

    def set_meta(self, key: str, value: Any) -> None:
        with self._write() as conn:
            ins = self._insert(t.meta).values(key=key, value=value, updated_at=utcnow())
            conn.execute(
                ins.on_conflict_do_update(
                    index_elements=[t.meta.c.key],
                    set_={"value": ins.excluded.value, "updated_at": ins.excluded.updated_at},
                )
            )

    # --- status and export --------------------------------------------------------------------
    def stats(self) -> StoreStats:
        tu, se, sm = t.turns.c, t.sessions.c, t.samples.c

        def count(conn: sa.Connection, table: sa.Table, *where: Any) -> int:
            return int(conn.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar_one())

        with self._read() as conn:
            by_state = {s: 0 for s in TRANSITIONS}
            for state, n in conn.execute(sa.select(sm.state, sa.func.count()).group_by(sm.state)):
                by_state[state] = int(n)
            latest = conn.execute(sa.select(sa.func.max(t.policy_versions.c.version))).scalar()
            return StoreStats(
                sessions=count(conn, t.sessions),
                sessions_done=count(conn, t.sessions, se.done == sa.true()),
                turns=count(conn, t.turns),
                main_turns=count(conn, t.turns, tu.turn_type == "main"),
                side_turns=count(conn, t.turns, tu.turn_type == "side"),
                untagged_turns=count(conn, t.turns, tu.tagged == sa.false()),
                opted_out_turns=count(conn, t.turns, tu.train == sa.false()),
                awaiting_next_state=count(
                    conn, t.turns, tu.turn_type == "main",
                    ~sa.exists().where(t.next_states.c.turn_id == tu.id),
                ),
                judged_turns=int(
                    conn.execute(sa.select(sa.func.count(sa.distinct(t.judgments.c.turn_id)))).scalar_one()
                ),
                samples=by_state,
                steps=count(conn, t.training_steps),
                latest_version=int(latest or 0),
            )

    def backup(self, dest: str | Path) -> Path:
        """A consistent copy of a SQLite store while it keeps serving (SQLite's online backup
        API). For PostgreSQL use pg_dump; the store does not shell out."""
        if self.dialect != "sqlite":
            raise StoreError("backup() copies SQLite files; back PostgreSQL up with pg_dump")
        import sqlite3

        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        target = sqlite3.connect(dest)
        try:
            with self.engine.connect() as conn:
                raw = conn.connection.dbapi_connection
                assert raw is not None
                raw.backup(target)
        finally:
            target.close()
        return dest

    def export_jsonl(self, dest: str | Path | IO[str], since: datetime | None = None) -> int:
        from clawbridge.store.export import export_jsonl

        return export_jsonl(self, dest, since)


# --- SQLite set-up ------------------------------------------------------------------------------
def _configure_sqlite(engine: sa.Engine, synchronous: str) -> None:
    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # We emit BEGIN ourselves (below): pysqlite's implicit transactions break savepoints and
        # cannot take the write lock up front.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")  # first: WAL needs a lock
        cur.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit survives a crash of the process (kill -9); only a power
        # loss can take back the last commits. FULL would fsync every commit.
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get("clawbridge_write", False)
        conn.connection.dbapi_connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")  # type: ignore[union-attr]


def _best_base(bases: Sequence[_Recent], messages: Sequence[Any]) -> tuple[_Recent | None, int]:
    """The remembered turn sharing the longest message prefix with `messages` (none if no
    message is shared, or its chain is as long as allowed)."""
    best, keep = None, 0
    for c in bases:  # newest first
        if c.depth >= MAX_MESSAGE_CHAIN:
            continue
        k = shared_prefix(c.messages, messages)
        if k > keep:
            best, keep = c, k
        if k and k >= len(c.messages) - 1:  # extends it (its rebuilt last message aside): done
            break
    return best, keep


def alembic_config() -> Any:
    from alembic.config import Config

    ini = resources.files("clawbridge").joinpath("alembic.ini")
    with resources.as_file(ini) as path:
        cfg = Config(str(path))
    cfg.set_main_option("script_location", "clawbridge:migrations")
    return cfg


def _check_len(n: int, xs: Sequence[float] | None, what: str) -> None:
    if xs is not None and len(xs) != n:
        raise StoreError(f"{len(xs)} {what} for a completion of {n} tokens")
