"""The capture path: sessions and turns, written by the proxy through the group-commit writer
with exact token ids and logprobs, and read back by the learning loop and the export. A turn
stores only the messages it adds to a recent turn of its session."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

import sqlalchemy as sa
from clawbridge.chat.prefix import shared_prefix, snapshot
from clawbridge.store import codec
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase
from clawbridge.store.fast import Prepared, existing_ids_sql
from clawbridge.store.records import (
    DEFAULT_USER,
    JSONObject,
    SessionRow,
    SessionSource,
    StoredTurn,
    TurnRecord,
    utcnow,
)

log = logging.getLogger(__name__)


# A turn stores only the messages it adds to a recent turn of its session (`messages_base`);
# every MAX_MESSAGE_CHAIN turns in a chain one stores its whole list, so reading a turn back never
# walks more than that many rows. RECENT_SESSIONS bounds what the writer remembers.
MAX_MESSAGE_CHAIN = 32
RECENT_SESSIONS = 256
RECENT_PER_SESSION = 2  # the last main and side turns, say: each extends its own kind


@dataclass(frozen=True)
class _Recent:
    """A turn the writer recorded lately: what the session's next turns may extend."""

    turn_id: str
    messages: list[Any]  # its whole list, snapshotted (the caller's dicts may change later)
    depth: int  # turns between it and the nearest turn that stores its whole list


@dataclass(frozen=True)
class NextStateWrite:
    """A next state to attach (`attach_next_state`), as a spool replays it."""

    turn_id: str
    messages: list[JSONObject]
    at: datetime


@dataclass(frozen=True)
class CloseWrite:
    """A session to close (`close_session`), as a spool replays it."""

    session_id: str
    reason: str


CaptureWrite = TurnRecord | NextStateWrite | CloseWrite


class CaptureStore(StoreBase):
    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(engine)
        self._recent: OrderedDict[str, list[_Recent]] = OrderedDict()  # session id -> newest first
        self._recent_lock = threading.Lock()
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

    async def record_turn_async(self, rec: TurnRecord) -> str:
        """Durable (committed, group-committed with concurrent writes) when it returns."""
        return await self.writer.write_many(self._record_turns, rec)

    async def attach_next_state_async(
        self, turn_id: str, next_state: list[JSONObject], at: datetime | None = None
    ) -> bool:
        return await self.writer.write(partial(self._attach_next_state, turn_id, next_state, at))

    async def upsert_session_async(self, session_id: str, source: SessionSource = "new",
                                   user: str = DEFAULT_USER) -> bool:
        return await self.writer.write(partial(self._upsert_session, session_id, source, user))

    async def close_session_async(self, session_id: str, reason: str) -> bool:
        return await self.writer.write(partial(self._close_session, session_id, reason))

    async def replay_async(self, writes: Sequence[CaptureWrite]) -> None:
        """Apply spooled writes in their order, in one transaction: all of them or none. Each is
        idempotent (a turn already stored, a next state already attached, a session already
        closed are no-ops), so a replay of writes that partly landed before is safe."""
        await self.writer.write(partial(self._replay, list(writes)))

    def _replay(self, writes: list[CaptureWrite], conn: sa.Connection) -> None:
        for w in writes:
            if isinstance(w, TurnRecord):
                self._record_turns(conn, [w])
            elif isinstance(w, NextStateWrite):
                self._attach_next_state(w.turn_id, w.messages, w.at, conn)
            else:
                self._close_session(w.session_id, w.reason, conn)

    # --- sessions -----------------------------------------------------------------------------
    def upsert_session(self, session_id: str, source: SessionSource = "new", user: str = DEFAULT_USER) -> bool:
        """Create the session, for `user`, if it is new (True); otherwise only touch `updated_at`."""
        with self._write() as conn:
            return self._upsert_session(session_id, source, user, conn)

    def _upsert_session(self, session_id: str, source: str, user: str, conn: sa.Connection) -> bool:
        now = utcnow()
        exists = conn.execute(
            sa.update(t.sessions).where(t.sessions.c.id == session_id).values(updated_at=now)
        ).rowcount
        if exists:
            return False
        conn.execute(
            t.sessions.insert().values(
                id=session_id, source=source, created_at=now, updated_at=now, turns=0,
                main_turns=0, done=False, user_name=user,
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
        if row is None:
            return None
        fields = row._asdict()
        user = fields.pop("user_name")
        return SessionRow(**fields, user=user)

    def session_user(self, session_id: str) -> str | None:
        """The user a stored session belongs to (None: no such session)."""
        with self._read() as conn:
            return conn.execute(sa.select(t.sessions.c.user_name).where(t.sessions.c.id == session_id)).scalar()

    def turn_users(self, turn_ids: Sequence[str]) -> dict[str, str]:
        """The user of each stored turn among `turn_ids` (its session's); unknown ids are left out."""
        if not turn_ids:
            return {}
        tu, se = t.turns, t.sessions
        with self._read() as conn:
            rows = conn.execute(sa.select(tu.c.id, se.c.user_name).join(se, se.c.id == tu.c.session_id)
                                .where(tu.c.id.in_(sorted(set(turn_ids)))))
            return {r.id: r.user_name for r in rows}

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
                    "user_name": new[0].user,
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

    def open_session_turns(self, updated_since: datetime, per_session: int = 8) -> list[StoredTurn]:
        """The last `per_session` turns of every open session active since `updated_since`, in
        order within each session: what the proxy rebuilds its session index from at start, so
        a conversation open before a restart continues after it (and gets its next states)."""
        tu, se = t.turns, t.sessions
        rank = sa.func.row_number().over(partition_by=tu.c.session_id, order_by=tu.c.idx.desc()).label("rank")
        recent = (
            sa.select(tu.c.id, rank)
            .join(se, se.c.id == tu.c.session_id)
            .where(se.c.done == sa.false(), se.c.updated_at >= updated_since)
            .subquery()
        )
        with self._read() as conn:
            return self._turns(conn, tu.c.id.in_(sa.select(recent.c.id).where(recent.c.rank <= per_session)),
                               order=tu.c.idx)

    def turns_awaiting_judgment(
        self, kinds: Sequence[str] = ("prm",), limit: int = 100
    ) -> list[StoredTurn]:
        """Main, trainable turns that have a next state but lack a judgment of one of `kinds`
        (oldest first). `StoredTurn.judged_kinds` says which kinds they already have, so a
        judge loop that crashed half-way resumes with the missing ones. Turns of an episode are
        left out: their group's outcomes train them (`learning.episodes`)."""
        j, ep = t.judgments, t.episodes.c
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
                    ~sa.exists().where(ep.session_id == t.turns.c.session_id, ep.turn_id.is_(None)),
                    ~sa.exists().where(ep.turn_id == t.turns.c.id),
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
                t.sessions.c.user_name.label("user"),
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

