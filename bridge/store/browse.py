"""The page's queries (`clawbridge.ui`): recent turns with their verdicts, one conversation, the
versions with the reactions to each, what is waiting, and a change token the page polls.

Every query is bounded by an index: turns page by (created_at, id) or (session_id, idx) with a
keyset cursor, never an offset; a page's judgments, samples and next states come by turn id
(their unique keys and primary key); counts of waiting samples are ranges of (state, id). The
one aggregate over history, the reactions per version, keeps the sums of settled samples and
adds only the newer ones (measured on a 100 000-turn store: `bench/ui_queries.py`, docs/ui.md).

Each query reads every user's data, or one user's (`user`: the turns of their sessions and
what hangs off them, their preferences); the versions, steps and gate decisions are the one
shared adapter's, everyone's.

Plain functions of a connection, returning JSON-ready dicts (the page is their only reader);
`Browse` runs them in read transactions on a `Store`.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase
from clawbridge.store.history import GateRecord, history_mark, read_history, read_preferences
from clawbridge.store.turn_text import last_user_text, message_view, turn_status
from clawbridge.store.users import user_turn_ids, user_turns

R = TypeVar("R")
JSON = dict[str, Any]

MAX_PAGE = 200
WAITING_WINDOW = 1_000  # the newest turns counted for "waiting for the judge"
HINT_WINDOW = 5_000  # the newest samples whose hints are listed


class BadCursor(ValueError):
    """A cursor the page did not get from us."""


# --- pure helpers -------------------------------------------------------------------------------
def encode_cursor(*parts: Any) -> str:
    raw = "\x1f".join(p.isoformat() if isinstance(p, datetime) else str(p) for p in parts)
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, n: int) -> list[str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        raise BadCursor("the cursor is not one this page gave out") from None
    parts = raw.split("\x1f")
    if len(parts) != n:
        raise BadCursor("the cursor is not one this page gave out")
    return parts


def _limit(n: int) -> int:
    return max(1, min(int(n), MAX_PAGE))


def _iso(d: datetime | None) -> str | None:
    return None if d is None else d.isoformat()


# --- the queries --------------------------------------------------------------------------------
_TURN_COLS = (
    t.turns.c.id, t.turns.c.session_id, t.turns.c.idx, t.turns.c.turn_type, t.turns.c.train,
    t.turns.c.version, t.turns.c.finish_reason, t.turns.c.n_completion, t.turns.c.total_ms,
    t.turns.c.created_at, t.turns.c.messages, t.turns.c.response,
)


def _annotate(conn: sa.Connection, rows: Sequence[Any], *, whole: bool) -> list[JSON]:
    """Each turn row with its next state, judgments and sample: three lookups by turn id."""
    ids = [r.id for r in rows]
    if not ids:
        return []
    se = t.sessions.c
    owner = dict(conn.execute(sa.select(se.id, se.user_name).where(se.id.in_({r.session_id for r in rows}))).all())
    nxt = {r.turn_id: r.messages for r in conn.execute(
        sa.select(t.next_states.c.turn_id, t.next_states.c.messages).where(t.next_states.c.turn_id.in_(ids)))}
    judged: dict[str, list[Any]] = {}
    j = t.judgments.c
    for r in conn.execute(sa.select(j.turn_id, j.kind, j.judge, j.votes, j.reward, j.hint).where(j.turn_id.in_(ids))
                          .order_by(j.id)):
        judged.setdefault(r.turn_id, []).append(r)
    s = t.samples.c
    samples: dict[str, JSON] = {}
    for r in conn.execute(sa.select(s.turn_id, s.id, s.method, s.state, s.reason, s.reward, s.hint, s.step,
                                    s.rewrite_ids.is_not(None).label("rewrite")).where(s.turn_id.in_(ids))
                          .order_by(s.id)):
        samples[r.turn_id] = {"id": r.id, "method": r.method, "state": r.state, "reason": r.reason,
                              "reward": r.reward, "hint": r.hint, "step": r.step, "rewrite": bool(r.rewrite)}
    out = []
    for r in rows:
        js = judged.get(r.id, [])
        votes = [v.get("value") for jj in js if jj.kind == "prm" for v in (jj.votes or []) if isinstance(v, dict)]
        hint = next((jj.hint for jj in js if jj.hint), None)
        feedback = next((jj.reward for jj in js if jj.kind == "feedback" and jj.reward is not None), None)
        prm = next((jj.reward for jj in js if jj.kind == "prm" and jj.reward is not None), None)
        sample = samples.get(r.id)
        reward = sample["reward"] if sample and sample["reward"] is not None else (
            feedback if feedback is not None else prm)
        state, words = turn_status(r.turn_type, bool(r.train), r.id in nxt, sample)
        messages = list(r.messages or [])
        item: JSON = {
            "id": r.id, "session_id": r.session_id, "user": owner.get(r.session_id), "index": r.idx,
            "turn_type": r.turn_type, "version": r.version, "created_at": _iso(r.created_at),
            "finish_reason": r.finish_reason,
            "completion_tokens": r.n_completion, "total_ms": r.total_ms,
            "asked": last_user_text(messages),
            "answer": message_view(r.response)["text"],
            "next": [message_view(m) for m in nxt[r.id]] if r.id in nxt else None,
            "reward": reward, "votes": votes, "feedback": feedback,
            "hint": (sample or {}).get("hint") or hint,
            "judges": sorted({f"{jj.kind}:{jj.judge}" for jj in js}),
            "state": state, "status": words, "sample": sample,
        }
        if whole:
            item["messages"] = [message_view(m) for m in messages]
            item["answer_tool_calls"] = message_view(r.response).get("tool_calls")
        out.append(item)
    return out


def recent_turns(conn: sa.Connection, *, before: str | None = None, limit: int = 30, learning: bool = False,
                 user: str | None = None) -> JSON:
    """The newest turns first, `limit` at a time; `next` is the cursor of the page after.
    `learning`: only the turns that can train (main, not opted out), not side turns or probes;
    `user`: only that user's."""
    tu = t.turns.c
    q = sa.select(*_TURN_COLS)
    if user is not None:
        q = q.where(user_turns(user))
    if learning:
        q = q.where(tu.turn_type == "main", tu.train == sa.true())
    if before:
        at, tid = decode_cursor(before, 2)
        try:
            when = datetime.fromisoformat(at)
        except ValueError:
            raise BadCursor("the cursor is not one this page gave out") from None
        # (created_at, id) < (at, tid), spelled out so both SQLite and PostgreSQL use the index
        q = q.where(sa.or_(tu.created_at < when, sa.and_(tu.created_at == when, tu.id < tid)))
    n = _limit(limit)
    rows = conn.execute(q.order_by(tu.created_at.desc(), tu.id.desc()).limit(n + 1)).all()
    more, rows = len(rows) > n, rows[:n]
    return {"turns": _annotate(conn, rows, whole=False),
            "next": encode_cursor(rows[-1].created_at, rows[-1].id) if more else None}


def conversation(conn: sa.Connection, session_id: str, *, after: int = -1, limit: int = 50,
                 user: str | None = None) -> JSON | None:
    """One session's turns in order from index `after + 1`, with each turn's own messages; None
    when there is no such session, or (`user` given) it is another user's."""
    se = conn.execute(sa.select(t.sessions).where(t.sessions.c.id == session_id)).first()
    if se is None or (user is not None and se.user_name != user):
        return None
    tu = t.turns.c
    n = _limit(limit)
    rows = conn.execute(sa.select(*_TURN_COLS).where(tu.session_id == session_id, tu.idx > after)
                        .order_by(tu.idx).limit(n + 1)).all()
    more, rows = len(rows) > n, rows[:n]
    return {
        "session": {"id": se.id, "user": se.user_name, "source": se.source, "created_at": _iso(se.created_at),
                    "updated_at": _iso(se.updated_at), "turns": se.turns, "main_turns": se.main_turns,
                    "done": bool(se.done), "done_reason": se.done_reason},
        "turns": _annotate(conn, rows, whole=True),
        "next": str(rows[-1].idx) if more else None,
    }


def _reaction_sums(conn: sa.Connection, *where: Any) -> dict[int, list[float]]:
    """Per version: [judged, +1, -1, sum of rewards] over the samples matching `where`."""
    s = t.samples.c
    q = (sa.select(s.version, sa.func.count(s.reward), sa.func.sum(sa.case((s.reward > 0, 1), else_=0)),
                   sa.func.sum(sa.case((s.reward < 0, 1), else_=0)), sa.func.sum(s.reward))
         .where(s.reward.is_not(None), *where).group_by(s.version))
    return {int(v): [float(n), float(up or 0), float(down or 0), float(total or 0)] for v, n, up, down, total in conn.execute(q)}


def _add(into: dict[int, list[float]], more: dict[int, list[float]]) -> dict[int, list[float]]:
    for v, xs in more.items():
        into[v] = [a + b for a, b in zip(into.get(v, [0.0] * 4), xs, strict=True)]
    return into


class Reactions:
    """Per version that served the turns: how many were judged +1, -1 and 0, and their mean.

    A sample's reward is final once it leaves `pending` (only `set_sample_advantages` writes it
    later, and only from pending), so the sums over every sample below the oldest pending one
    are kept, and each call adds only the samples past the mark: a primary-key range, not the
    whole table (docs/ui.md has the cost of summing afresh)."""

    def __init__(self) -> None:
        self.mark = 0  # every sample with id <= mark is in `sums`
        self.sums: dict[int, list[float]] = {}
        self.lock = threading.Lock()

    def __call__(self, conn: sa.Connection) -> dict[int, JSON]:
        s = t.samples.c
        oldest_pending = conn.execute(sa.select(sa.func.min(s.id)).where(s.state == "pending")).scalar()
        newest = conn.execute(sa.select(sa.func.max(s.id))).scalar() or 0
        settled = newest if oldest_pending is None else oldest_pending - 1
        if conn.dialect.name != "sqlite":
            # PostgreSQL's sequences can commit out of order (id 10 after id 11 is visible): a
            # mark could pass a sample not yet committed. SQLite has one writer: ids commit in order.
            settled = self.mark
        with self.lock:
            if settled > self.mark:
                _add(self.sums, _reaction_sums(conn, s.id > self.mark, s.id <= settled))
                self.mark = settled
            sums = _add({v: list(xs) for v, xs in self.sums.items()}, _reaction_sums(conn, s.id > self.mark))
        return reaction_view(sums)


def reaction_view(sums: dict[int, list[float]]) -> dict[int, JSON]:
    """Per version, its [judged, +1, -1, sum] as the page shows them (versions none judged left out)."""
    out: dict[int, JSON] = {}
    for v, (n, up, down, total) in sorted(sums.items()):
        if n:
            out[v] = {"judged": int(n), "up": int(up), "down": int(down), "neutral": int(n - up - down),
                      "mean_reward": total / n}
    return out


def reactions(conn: sa.Connection, user: str | None = None) -> dict[int, JSON]:
    """The reactions per version, summed afresh (`Reactions` keeps the settled part of
    everyone's); `user`: to that user's turns alone."""
    if user is None:
        return Reactions()(conn)
    return reaction_view(_reaction_sums(conn, t.samples.c.turn_id.in_(user_turn_ids(user))))


def versions(conn: sa.Connection, user: str | None = None) -> list[JSON]:
    """Every published version, oldest first (v0, the base model, included), each with its user;
    `user`: that user's lineage alone."""
    pv = t.policy_versions.c
    q = sa.select(pv.version, pv.step, pv.samples, pv.mean_reward, pv.path, pv.created_at, pv.user_name)
    if user is not None:
        q = q.where(sa.or_(pv.user_name == user, pv.version == 0))
    rows = conn.execute(q.order_by(pv.version)).all()
    out: list[JSON] = [] if any(r.version == 0 for r in rows) else [
        {"version": 0, "step": None, "samples": 0, "train_mean_reward": None, "path": None, "created_at": None,
         "user": None}]
    out += [{"version": r.version, "step": r.step, "samples": r.samples, "train_mean_reward": r.mean_reward,
             "path": r.path, "created_at": _iso(r.created_at), "user": r.user_name if r.version else None}
            for r in rows]
    return out


def waiting(conn: sa.Connection, user: str | None = None) -> JSON:
    """What the learning loop has in front of it: samples being judged, samples judged and
    waiting for a step (ranges of the (state, id) index), and among the newest turns those
    with a next state and no sample yet (the judge's queue; the collector takes oldest first).
    `user`: of that user's samples and turns alone."""
    s, tu = t.samples.c, t.turns.c
    mine = [] if user is None else [s.turn_id.in_(user_turn_ids(user))]
    counts = {state: int(conn.execute(sa.select(sa.func.count()).select_from(t.samples)
                                      .where(s.state == state, *mine)).scalar_one())
              for state in ("pending", "judged")}
    newest_q = sa.select(tu.id, tu.turn_type, tu.train)
    if user is not None:
        newest_q = newest_q.where(user_turns(user))
    newest = newest_q.order_by(tu.created_at.desc()).limit(WAITING_WINDOW).subquery()
    to_judge = conn.execute(
        sa.select(sa.func.count()).select_from(newest)
        .where(newest.c.turn_type == "main", newest.c.train == sa.true(),
               sa.exists().where(t.next_states.c.turn_id == newest.c.id),
               ~sa.exists().where(s.turn_id == newest.c.id))).scalar_one()
    return {"samples_being_judged": counts["pending"], "samples_to_train": counts["judged"],
            "turns_to_judge": int(to_judge), "turns_window": WAITING_WINDOW}


def change_token(conn: sa.Connection, user: str | None = None) -> str:
    """Changes whenever something the page shows changes: a turn, a next state, a judgment, a
    sample, a step, a version (with its origin), a gate decision or a preference. Each part is
    an index's last entry (or a primary-key lookup), so polling it costs microseconds.
    `user`: changes with that user's data alone (and the shared steps, versions and gate), so
    it says nothing of anyone else's; it reads the user's turns (`Browse.token` reads it only
    after everyone's token moved)."""
    if user is not None:
        return _user_change_token(conn, user)
    parts: list[Any] = [
        conn.execute(sa.select(sa.func.max(t.turns.c.created_at))).scalar(),
        _next_states_mark(conn),
        conn.execute(sa.select(sa.func.max(t.judgments.c.id))).scalar(),
        conn.execute(sa.select(sa.func.max(t.samples.c.id))).scalar(),
        conn.execute(sa.select(sa.func.max(t.training_steps.c.step))).scalar(),
        conn.execute(sa.select(sa.func.max(t.policy_versions.c.version))).scalar(),
    ]
    s = t.samples.c
    for state in ("pending", "judged"):  # a sample settled (judged -> trained, pending -> dropped)
        parts.append(conn.execute(sa.select(sa.func.count()).select_from(t.samples).where(s.state == state)).scalar())
    parts.extend(history_mark(conn))
    return encode_cursor(*parts)


def _user_change_token(conn: sa.Connection, user: str) -> str:
    tu, s, j, n = t.turns.c, t.samples.c, t.judgments.c, t.next_states.c
    turns = user_turn_ids(user)

    def one(q: sa.Select[Any]) -> Any:
        return conn.execute(q).scalar()

    parts: list[Any] = [
        one(sa.select(sa.func.max(tu.created_at)).where(user_turns(user))),
        one(sa.select(sa.func.count()).select_from(t.next_states).where(n.turn_id.in_(turns))),
        one(sa.select(sa.func.max(j.id)).where(j.turn_id.in_(turns))),
        one(sa.select(sa.func.max(s.id)).where(s.turn_id.in_(turns))),
        one(sa.select(sa.func.max(t.training_steps.c.step))),
        one(sa.select(sa.func.max(t.policy_versions.c.version))),
        *(one(sa.select(sa.func.count()).select_from(t.samples).where(s.state == state, s.turn_id.in_(turns)))
          for state in ("pending", "judged")),
        one(sa.select(sa.func.max(t.gate_decisions.c.id))),
        one(sa.select(sa.func.max(t.preferences.c.updated_at)).where(t.preferences.c.user_name == user)),
    ]
    return encode_cursor(*parts)


def _next_states_mark(conn: sa.Connection) -> Any:
    """Moves whenever a next state is attached. Rows are only ever inserted: on SQLite the
    newest rowid (the table's b-tree key: one page read); elsewhere a count."""
    if conn.dialect.name == "sqlite":
        return conn.execute(sa.text("SELECT max(rowid) FROM next_states")).scalar()
    return conn.execute(sa.select(sa.func.count()).select_from(t.next_states)).scalar()


def hints(conn: sa.Connection, limit: int = 20, user: str | None = None) -> list[JSON]:
    """The hints the newest samples carry (what the user asked for, in the judge's words),
    de-duplicated, newest first, with how many samples carried each and how many trained.
    `user`: of that user's samples alone."""
    s = t.samples.c
    mine = [] if user is None else [s.turn_id.in_(user_turn_ids(user))]
    top = conn.execute(sa.select(sa.func.max(s.id)).where(*mine)).scalar() or 0
    q = (sa.select(s.hint, sa.func.count().label("n"),
                   sa.func.sum(sa.case((s.state == "trained", 1), else_=0)).label("trained"),
                   sa.func.max(s.updated_at).label("last"))
         .where(s.id > top - HINT_WINDOW, s.hint.is_not(None), *mine)
         .group_by(s.hint).order_by(sa.func.max(s.updated_at).desc()).limit(_limit(limit)))
    return [{"hint": r.hint, "samples": int(r.n), "trained": int(r.trained or 0), "last": _iso(r.last)}
            for r in conn.execute(q)]


def steps(conn: sa.Connection, limit: int = 50, user: str | None = None) -> list[JSON]:
    """The newest training steps (step, versions, samples, loss and reward), oldest first;
    `user`: of that user's adapter alone."""
    ts = t.training_steps.c
    q = sa.select(ts.step, ts.version_before, ts.version_after, ts.samples, ts.metrics, ts.created_at)
    if user is not None:
        q = q.where(ts.user_name == user)
    rows = conn.execute(q.order_by(ts.step.desc()).limit(_limit(limit))).all()
    out = []
    for r in reversed(rows):
        m = r.metrics or {}
        out.append({"step": r.step, "version_before": r.version_before, "version_after": r.version_after,
                    "samples": r.samples, "created_at": _iso(r.created_at),
                    "metrics": {k: v for k, v in m.items() if isinstance(v, int | float)}})
    return out


class Browse:
    """The queries above in read transactions of a store (`await store.run(browse.turns, ...)`)."""

    def __init__(self, store: StoreBase) -> None:
        self.store = store
        self.reactions = Reactions()
        # what `waiting` and `progress` answered, by the change token they were read at: every
        # open page polls, and between two changes they all get the same answer
        self._memo: dict[str, tuple[str, JSON]] = {}
        self._memo_lock = threading.Lock()

    def memo(self, name: str, token: str, read: Callable[[], JSON]) -> JSON:
        """`read()`, or what it returned at `token` (the caller's change token) if nothing moved."""
        with self._memo_lock:
            hit = self._memo.get(name)
        if hit is not None and hit[0] == token:
            return hit[1]
        out = read()
        with self._memo_lock:
            self._memo[name] = (token, out)
        return out

    @contextmanager
    def _conn(self) -> Iterator[sa.Connection]:
        with self.store.engine.connect() as conn, conn.begin():
            yield conn

    def _in(self, fn: Callable[..., R], *args: Any, **kw: Any) -> R:
        with self._conn() as conn:
            return fn(conn, *args, **kw)

    def turns(self, before: str | None = None, limit: int = 30, learning: bool = False,
              user: str | None = None) -> JSON:
        return self._in(recent_turns, before=before, limit=limit, learning=learning, user=user)

    def conversation(self, session_id: str, after: int = -1, limit: int = 50, user: str | None = None) -> JSON | None:
        return self._in(conversation, session_id, after=after, limit=limit, user=user)

    def progress(self, user: str | None = None) -> JSON:
        """Versions with their reactions, gate decisions and rollbacks; the steps; the hints; and
        the stored preferences (`store.Preference`s, first heard first, each in its state).
        `user`: that user's own adapter's versions, decisions and steps, and the reactions, hints
        and preferences of that user alone."""
        with self._conn() as conn:
            vs = versions(conn, user)
            react = self.reactions(conn) if user is None else reactions(conn, user)
            history = read_history(conn, user)
            gate = history.by_version()
            for v in vs:
                v["reactions"] = react.get(v["version"])
                v["gate"] = gate_view(g, user) if (g := gate.get(v["version"])) is not None else None
                v["restores"] = history.copies.get(v["version"])
            prefs = history.preferences if user is None else read_preferences(conn, user)
            return {"versions": vs, "steps": steps(conn, user=user), "hints": hints(conn, user=user), "preferences": prefs}

    def waiting(self, user: str | None = None) -> JSON:
        return self._in(waiting, user)

    def token(self, user: str | None = None) -> str:
        """The change token (`change_token`); a user's is read afresh only once everyone's moved."""
        everyone = self._in(change_token)
        if user is None:
            return everyone
        return str(self.memo(f"token:{user}", everyone, lambda: {"token": self._in(change_token, user)})["token"])

    def users(self) -> list[str]:
        return self._in(known_users)


def gate_view(record: GateRecord, user: str | None) -> JSON:
    """A gate decision as the page shows it; to one user, their own candidates' only, each with
    the instruction it asked (made of that user's preferences alone)."""
    out = record.as_json()
    if user is not None and record.user != user:
        out["asked"] = None
    return out


def known_users(conn: sa.Connection) -> list[str]:
    """Every user with a session or a preference, by name (the page's user picker)."""
    names = sa.union(sa.select(t.sessions.c.user_name), sa.select(t.preferences.c.user_name)).subquery()
    return sorted(str(u) for (u,) in conn.execute(sa.select(names.c.user_name)))
