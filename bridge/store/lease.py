"""Who may do what only one process may do (docs/scale-out.md).

- `LeaseStore`: a role held through the store (the trainer): the holder claims it for a few
  seconds and renews the claim before it runs out; another process takes the role over once the
  claim has run out (its holder died) or was released (its holder stopped). The clock is the
  database's on PostgreSQL, so processes on machines whose clocks differ agree on it.
- `hold_file`: a SQLite store is served by one process. SQLite's locks would let a second one
  write, but each process would keep its conversations, its trainer and its versions to itself;
  the second is refused, and told to use PostgreSQL.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase, StoreError
from clawbridge.store.records import utcnow


class StoreInUse(StoreError):
    """A SQLite store another process serves from."""


@dataclass(frozen=True)
class LeaseRow:
    name: str
    holder: str
    acquired_at: datetime
    expires_at: datetime


class LeaseStore(StoreBase):
    def _now(self, conn: sa.Connection) -> datetime:
        if self.dialect == "postgresql":
            now = conn.execute(sa.select(sa.func.clock_timestamp())).scalar_one()
            assert isinstance(now, datetime)
            return now
        return utcnow()

    def claim_lease(self, name: str, holder: str, ttl_s: float) -> LeaseRow:
        """Take `name` for `holder` for `ttl_s` seconds, or renew it, if it is free, has run out
        or is `holder`'s already. Returns the lease as it stands: `holder` holds it iff
        `.holder == holder`."""
        le = t.leases.c
        with self._write() as conn:
            now = self._now(conn)
            until = now + timedelta(seconds=ttl_s)
            row = conn.execute(sa.select(t.leases).where(le.name == name).with_for_update()).first()
            if row is None:
                ins = self._insert(t.leases).values(name=name, holder=holder, acquired_at=now, expires_at=until)
                conn.execute(ins.on_conflict_do_nothing())
            elif row.holder == holder:
                conn.execute(sa.update(t.leases).where(le.name == name).values(expires_at=until))
            elif _aware(row.expires_at) <= now:
                conn.execute(sa.update(t.leases).where(le.name == name)
                             .values(holder=holder, acquired_at=now, expires_at=until))
            got = conn.execute(sa.select(t.leases).where(le.name == name)).one()
        return LeaseRow(got.name, got.holder, got.acquired_at, got.expires_at)

    def release_lease(self, name: str, holder: str) -> bool:
        """Give `name` up at once, if `holder` holds it (True)."""
        with self._write() as conn:
            res = conn.execute(sa.delete(t.leases).where(t.leases.c.name == name, t.leases.c.holder == holder))
        return bool(res.rowcount)

    def lease(self, name: str) -> LeaseRow | None:
        """The lease's last claim (it may have run out: compare `expires_at` with the time)."""
        with self._read() as conn:
            row = conn.execute(sa.select(t.leases).where(t.leases.c.name == name)).first()
        return None if row is None else LeaseRow(row.name, row.holder, row.acquired_at, row.expires_at)


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=utcnow().tzinfo)


def hold_file(db_file: Path) -> IO[str]:
    """Mark the SQLite store at `db_file` as served by this process, for as long as the returned
    file stays open (the lock goes with the process, however it ends). Raises StoreInUse when
    another process serves from it."""
    path = db_file.with_name(db_file.name + ".serving")
    f = open(path, "a+")  # noqa: SIM115 - held open for the life of the store
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise StoreInUse(
            f"another process (pid {pid}) serves from the SQLite store {db_file}: a SQLite store has "
            "one serving process. To run several proxies on one store, use PostgreSQL "
            "(--db postgresql+psycopg://user@host/dbname; docs/scale-out.md)."
        ) from None
    with contextlib.suppress(OSError):
        os.chmod(path, 0o600)
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f
