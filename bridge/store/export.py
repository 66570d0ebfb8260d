"""`clawbridge export`: one JSON object per turn, with its exact token ids, logprobs, judgments
and samples; every user's turns, or one user's (their sessions' turns, and what hangs off them).
Streams in pages so a large store never sits in memory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.codec import dumps
from clawbridge.store.records import JSONObject, StoredTurn

if TYPE_CHECKING:
    from clawbridge.store.capture import CaptureStore as Store

PAGE = 200


def export_jsonl(store: Store, dest: str | Path | IO[str], since: datetime | None = None,
                 user: str | None = None) -> int:
    """Write every turn created at or after `since` (all when None), of `user`'s sessions only
    when given; returns the count."""
    if isinstance(dest, str | Path):
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "w", encoding="utf-8") as f:
            return _write(store, f, since, user)
    return _write(store, dest, since, user)


def _write(store: Store, out: IO[str], since: datetime | None, user: str | None) -> int:
    n = 0
    for obj in iter_export(store, since, user):
        out.write(dumps(obj))
        out.write("\n")
        n += 1
    out.flush()
    return n


def iter_export(store: Store, since: datetime | None = None, user: str | None = None) -> Iterator[JSONObject]:
    # Keyset pagination on (created_at, id): stable while the proxy keeps writing.
    after: tuple[datetime, str] | None = None
    while True:
        where: list[Any] = []
        if since is not None:
            where.append(t.turns.c.created_at >= since)
        if user is not None:  # the turns are joined with their sessions
            where.append(t.sessions.c.user_name == user)
        if after is not None:
            where.append(sa.tuple_(t.turns.c.created_at, t.turns.c.id) > sa.tuple_(*after))
        with store._read() as conn:
            turns = store._turns(conn, sa.and_(sa.true(), *where), limit=PAGE)
            ids = [tu.id for tu in turns]
            judg = conn.execute(
                sa.select(t.judgments).where(t.judgments.c.turn_id.in_(ids)).order_by(t.judgments.c.id)
            ).all() if ids else []
            samp = conn.execute(
                sa.select(t.samples).where(t.samples.c.turn_id.in_(ids)).order_by(t.samples.c.id)
            ).all() if ids else []
        if not turns:
            return
        by_turn_j: dict[str, list[JSONObject]] = {}
        for j in judg:
            by_turn_j.setdefault(j.turn_id, []).append(
                {"judge": j.judge, "kind": j.kind, "votes": j.votes, "reward": j.reward,
                 "hint": j.hint, "created_at": j.created_at.isoformat()}
            )
        by_turn_s: dict[str, list[JSONObject]] = {}
        for s in samp:
            by_turn_s.setdefault(s.turn_id, []).append(
                {"id": s.id, "method": s.method, "state": s.state, "reason": s.reason,
                 "reward": s.reward, "hint": s.hint, "version": s.version, "step": s.step}
            )
        for tu in turns:
            yield _turn_json(tu, by_turn_j.get(tu.id, []), by_turn_s.get(tu.id, []))
        after = (turns[-1].created_at, turns[-1].id)


def _turn_json(tu: StoredTurn, judgments: list[JSONObject], samples: list[JSONObject]) -> JSONObject:
    return {
        "id": tu.id,
        "session_id": tu.session_id,
        "session_source": tu.session_source,
        "user": tu.user,
        "index": tu.index,
        "turn_type": tu.turn_type,
        "tagged": tu.tagged,
        "train": tu.train,
        "created_at": tu.created_at.isoformat(),
        "version": tu.version,
        "messages": tu.messages,
        "tools": tu.tools,
        "instruction": tu.instruction,
        "request_params": tu.request_params,
        "sampling": asdict(tu.sampling),
        "prompt_ids": list(tu.prompt_ids),
        "completion_ids": list(tu.completion_ids),
        "logprobs": list(tu.logprobs),
        "finish_reason": tu.finish_reason,
        "response": tu.response,
        "timings_ms": {"queued": tu.queued_ms, "ttft": tu.ttft_ms, "total": tu.total_ms},
        "next_state": tu.next_state,
        "next_state_at": tu.next_state_at.isoformat() if tu.next_state_at else None,
        "judgments": judgments,
        "samples": samples,
    }
