"""The store's foundation: the engine (SQLite in WAL mode or PostgreSQL), migrations,
transactions, the group-commit writer and the reader threads, and the meta table. The capture
path (`capture.CaptureStore`) and the learning state (`training.TrainingStore`) build on it;
`core.Store` is both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from importlib import resources
from pathlib import Path
from typing import IO, Any, ParamSpec, Self, TypeVar

import sqlalchemy as sa
from clawbridge.store import codec
from clawbridge.store import schema as t
from clawbridge.store.records import (
    utcnow,
)
from clawbridge.store.writer import AsyncWriter
from sqlalchemy.dialects import postgresql, sqlite

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_THREADS = 4


class StoreError(RuntimeError):
    """A request the store refuses (inside, typed; the API edge maps it)."""


class SampleStateError(StoreError):
    """A sample is not in a state the requested transition starts from."""


class VersionReused(StoreError):
    """A policy version number was recorded twice: versions are append-only."""

    def __init__(self, version: int) -> None:
        super().__init__(f"policy@v{version} is already recorded: version numbers are never reused")
        self.version = version



def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) readable by this user only (0700): it holds every captured
    conversation. A directory that already exists is left as it is (it may be the user's own,
    e.g. `--data-dir .`); the database file in it is made private either way."""
    path = path.expanduser()
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)  # mkdir's mode is filtered by the umask
    return path


def private_file(path: Path) -> None:
    """Create `path` empty with mode 0600 if it does not exist, and make it 0600 if it does.
    SQLite creates its -wal and -shm files with the database file's mode."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    path.chmod(0o600)


class StoreBase:
    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._writer: AsyncWriter | None = None
        # Reads get their own threads: a slow query must not starve the event loop's default
        # executor, which the rest of the process shares.
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="clawbridge-store")
        self._writer_conn: sa.Connection | None = None  # the writer thread's own connection
        self._held: list[IO[str]] = []  # files locked while the store is open (`lease.hold_file`)

    # --- opening ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls, url: str, *, migrate: bool = True, sqlite_synchronous: str = "NORMAL"
    ) -> Self:
        """Open (creating the directory of a SQLite file) and bring the schema to the newest
        migration. `sqlite_synchronous="FULL"` makes every commit survive a power loss too, at
        one fsync per commit (per group commit with the writer)."""
        if sqlite_synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise StoreError(f"sqlite_synchronous must be NORMAL, FULL or EXTRA, not {sqlite_synchronous}")
        sa_url = sa.make_url(url)
        if sa_url.get_backend_name() == "sqlite":
            if not sa_url.database or sa_url.database == ":memory:":
                raise StoreError("the store needs a SQLite file (sqlite:///path/clawbridge.db)")
            db_file = Path(sa_url.database).expanduser()
            private_dir(db_file.parent)
            private_file(db_file)
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
        while self._held:
            self._held.pop().close()

    async def aclose(self) -> None:
        """`close()` off the event loop (it waits for the writer to drain)."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Self:
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



def alembic_config() -> Any:
    from alembic.config import Config

    ini = resources.files("clawbridge").joinpath("alembic.ini")
    with resources.as_file(ini) as path:
        cfg = Config(str(path))
    cfg.set_main_option("script_location", "clawbridge:migrations")
    return cfg


def check_len(n: int, xs: Sequence[float] | None, what: str) -> None:
    if xs is not None and len(xs) != n:
        raise StoreError(f"{len(xs)} {what} for a completion of {n} tokens")
