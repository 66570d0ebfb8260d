"""Conversations through the store, for several proxies on one database (docs/scale-out.md).

Every turn carries two structural fingerprints (`serving.sessions`): `prompt_key`, of the
history it answered, and `reply_key`, of that history plus its reply. A request that continues
a conversation starts with a turn's history + reply, so one indexed lookup of the request's
prefixes finds the turn it continues, whichever proxy served that turn: the session of an
untagged request, and the turns whose next state the request carries. One process alone keeps
the same knowledge in memory (`Sessions`) and never asks. A conversation is looked up among the
sessions of the request's user only: two users' identical histories never continue each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase
from clawbridge.store.records import DEFAULT_USER

AWAITING_SPAN = 64  # turns of a session looked through for the newest request's choices


@dataclass(frozen=True)
class KeyedTurn:
    """A turn as a conversation's continuation sees it."""

    id: str
    session_id: str
    turn_type: str
    idx: int
    prompt_key: bytes | None
    reply_key: bytes | None
    answered: bool  # it has its next state


@dataclass(frozen=True)
class Continuation:
    """What the store knows about the conversation a request continues."""

    session_id: str | None  # the session asked about, or the one of the longest prefix found
    # the turns whose `reply_key` is one of the request's prefixes (in that session when one
    # was asked about), oldest first
    matches: tuple[KeyedTurn, ...] = ()
    # the session's main turns awaiting a next state: the newest main request's choices and the
    # same prompt sampled again (none once one of them has its next state), oldest first
    awaiting: tuple[KeyedTurn, ...] = ()


class ContinuationStore(StoreBase):
    @property
    def shared(self) -> bool:
        """Whether other processes may serve from this store (PostgreSQL): conversations are then
        continued through it. A SQLite store has one serving process (`store.lease.hold_file`)."""
        return self.dialect != "sqlite"

    def continuation(self, session_id: str | None, keys: Sequence[bytes], user: str = DEFAULT_USER) -> Continuation:
        """The conversation a request for `user` continues: `keys`, the fingerprints of its
        history's prefixes that end with an assistant message (a reply); `session_id`, the session
        it names, if any. Without one, the session is that of the user's turn whose reply is the
        longest prefix of the request (the newest such turn when several are)."""
        tu, ns, se = t.turns, t.next_states, t.sessions
        cols = (tu.c.id, tu.c.session_id, tu.c.turn_type, tu.c.idx, tu.c.prompt_key, tu.c.reply_key,
                ns.c.turn_id.is_not(None).label("answered"))

        def select(*where: Any) -> sa.Select[Any]:
            return sa.select(*cols).outerjoin(ns, ns.c.turn_id == tu.c.id).where(*where)

        with self._read() as conn:
            matches: list[KeyedTurn] = []
            if keys:
                mine = sa.select(se.c.id).where(se.c.id == tu.c.session_id, se.c.user_name == user).exists()
                q = select(tu.c.reply_key.in_(list(keys)), mine)
                if session_id is not None:
                    q = q.where(tu.c.session_id == session_id)
                matches = [_keyed(r) for r in conn.execute(q.order_by(tu.c.created_at, tu.c.idx))]
            sid = session_id
            if sid is None and matches:
                where = {k: i for i, k in enumerate(keys)}
                longest = max(where[m.reply_key] for m in matches if m.reply_key is not None)
                sid = [m for m in matches if m.reply_key == keys[longest]][-1].session_id
            if sid is None:
                return Continuation(None, tuple(matches))
            main = (tu.c.session_id == sid, tu.c.turn_type == "main")
            newest = conn.execute(select(*main).order_by(tu.c.idx.desc()).limit(1)).first()
            awaiting: list[KeyedTurn] = []
            if newest is not None and newest.prompt_key is not None and not newest.answered:
                same = conn.execute(
                    select(*main, tu.c.prompt_key == newest.prompt_key, tu.c.idx > newest.idx - AWAITING_SPAN)
                    .order_by(tu.c.idx)
                )
                awaiting = [_keyed(r) for r in same]
                if any(a.answered for a in awaiting):
                    awaiting = []
        return Continuation(sid, tuple(m for m in matches if m.session_id == sid), tuple(awaiting))


def _keyed(r: Any) -> KeyedTurn:
    return KeyedTurn(r.id, r.session_id, r.turn_type, r.idx,
                     None if r.prompt_key is None else bytes(r.prompt_key),
                     None if r.reply_key is None else bytes(r.reply_key), bool(r.answered))
