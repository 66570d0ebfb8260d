"""The store: the source of truth every loop resumes from after a crash (docs/design.md#the-store).

`Store` is the capture path (`capture.py`: sessions, turns) and the learning state
(`training.py`: judgments, samples, steps, versions) over one database (`base.py`: engine,
transactions, writer, readers). Sync core (SQLAlchemy Core over SQLite in WAL mode or
PostgreSQL), with async entry points that never block the event loop: writes go through the
group-commit `AsyncWriter`, reads through a worker thread (`Store.run`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreError
from clawbridge.store.capture import CaptureStore
from clawbridge.store.continuation import ContinuationStore
from clawbridge.store.episodes import EpisodeStore
from clawbridge.store.export import export_jsonl
from clawbridge.store.history import HistoryStore
from clawbridge.store.lease import LeaseStore, hold_file
from clawbridge.store.records import (
    StoreStats,
)
from clawbridge.store.training import TRANSITIONS, TrainingStore
from clawbridge.store.users import UserStore, user_turn_ids, user_turns

log = logging.getLogger(__name__)



class Store(CaptureStore, TrainingStore, EpisodeStore, ContinuationStore, LeaseStore, HistoryStore, UserStore):
    """Everything the loops keep, in one database."""

    def claim_serving(self) -> None:
        """A server is about to serve from this store. SQLite: refused (StoreInUse) while another
        process serves from the same file; the claim lasts until `close`. PostgreSQL: any
        number of processes may (docs/scale-out.md)."""
        if self.dialect == "sqlite":
            db = self.engine.url.database
            assert db is not None
            self._held.append(hold_file(Path(db).expanduser()))

    # --- status and export --------------------------------------------------------------------
    def stats(self, user: str | None = None) -> StoreStats:
        """Counts for the status line: every user's, or `user`'s alone (`clawbridge status
        --user`); the training steps and the newest version are the one adapter's, everyone's."""
        tu, se, sm, ju = t.turns.c, t.sessions.c, t.samples.c, t.judgments.c
        sessions: list[Any] = [] if user is None else [se.user_name == user]
        turns: list[Any] = [] if user is None else [user_turns(user)]
        samples: list[Any] = [] if user is None else [sm.turn_id.in_(user_turn_ids(user))]
        judgments: list[Any] = [] if user is None else [ju.turn_id.in_(user_turn_ids(user))]

        def count(conn: sa.Connection, table: sa.Table, *where: Any) -> int:
            return int(conn.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar_one())

        with self._read() as conn:
            by_state = {s: 0 for s in TRANSITIONS}
            for state, n in conn.execute(sa.select(sm.state, sa.func.count()).where(*samples).group_by(sm.state)):
                by_state[state] = int(n)
            latest = conn.execute(sa.select(sa.func.max(t.policy_versions.c.version))).scalar()
            return StoreStats(
                sessions=count(conn, t.sessions, *sessions),
                sessions_done=count(conn, t.sessions, se.done == sa.true(), *sessions),
                turns=count(conn, t.turns, *turns),
                main_turns=count(conn, t.turns, tu.turn_type == "main", *turns),
                side_turns=count(conn, t.turns, tu.turn_type == "side", *turns),
                untagged_turns=count(conn, t.turns, tu.tagged == sa.false(), *turns),
                opted_out_turns=count(conn, t.turns, tu.train == sa.false(), *turns),
                awaiting_next_state=count(
                    conn, t.turns, tu.turn_type == "main",
                    ~sa.exists().where(t.next_states.c.turn_id == tu.id), *turns,
                ),
                judged_turns=int(
                    conn.execute(sa.select(sa.func.count(sa.distinct(ju.turn_id))).where(*judgments)).scalar_one()
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

    def export_jsonl(self, dest: str | Path | IO[str], since: datetime | None = None, user: str | None = None) -> int:
        """Every turn (created at or after `since`), or `user`'s only; returns the count."""
        return export_jsonl(self, dest, since, user)
