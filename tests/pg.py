"""A throwaway PostgreSQL cluster for tests.

PostgreSQL 15 is installed on the test machines but not running. `PgCluster.start()` runs `initdb` in a
fresh temp dir and starts a server on a free loopback port with its socket in that dir; `stop()`
kills it (`-m immediate`: the data is thrown away anyway) and removes the dir. initdb refuses to
run as root, so as root the cluster runs as the `postgres` user.

Tests use the `pg_cluster` fixture (session-scoped, in conftest.py) and `pg_cluster.create_schema()`
(or `.create_database()`) for a fresh, empty URL.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

PG_BIN_DIRS = [Path("/usr/lib/postgresql/15/bin"), Path("/usr/lib/postgresql/16/bin")]


def find_pg_bin() -> Path | None:
    env = os.environ.get("CLAWBRIDGE_PG_BIN")
    for d in [Path(env)] if env else PG_BIN_DIRS:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path and shutil.which("initdb") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    def __init__(self, bin_dir: Path, *, fsync: bool = False) -> None:
        self.bin = bin_dir
        # fsync off by default: tests kill clients, never this server, and its data is thrown
        # away. Benchmarks turn it on.
        self.fsync = fsync
        self.dir = Path(tempfile.mkdtemp(prefix="clawbridge-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str, timeout: float = 60) -> None:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)

    def start(self) -> PgCluster:
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        opts = f"-k {self.dir} -p {self.port} -c listen_addresses=127.0.0.1"
        if not self.fsync:
            opts += " -c fsync=off -c full_page_writes=off"
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w", "start"
        )
        return self

    def halt(self) -> None:
        """Stop the server, keeping its data (an outage; `resume` ends it)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def resume(self) -> None:
        opts = f"-k {self.dir} -p {self.port} -c listen_addresses=127.0.0.1"
        if not self.fsync:
            opts += " -c fsync=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w", "start")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A fresh, empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def create_schema(self, name: str | None = None) -> str:
        """A fresh, empty schema in the `postgres` database, as a URL whose connections use it
        (search_path). Milliseconds, where a database costs a copy of its template."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return f"{self.url()}?options=-csearch_path%3D{name}"
