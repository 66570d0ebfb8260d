"""The capture path's statements, compiled once by SQLAlchemy and run on the DBAPI cursor.

Every answered request waits for its turn's commit, so the statements that record a turn are
the store's hot path. SQLAlchemy Core costs 0.1–0.3 ms of Python per execute on a small machine
(compile-cache lookup, parameter processing, result setup), several times what SQLite spends on
the statement itself. A `Prepared` statement keeps what SQLAlchemy would send: the SQL its
compiler renders for the dialect, and each parameter's bind conversion from the column's type
(`TypeEngine.bind_processor`: JSON through the engine's serializer, aware datetimes to naive
UTC on SQLite, booleans, blobs). So a row written here reads back through SQLAlchemy exactly as
one written through it, which the store tests check on SQLite and PostgreSQL.

Everything else (reads, migrations, the learning loop's writes) stays on SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import SQLCompiler

Processor = Callable[[Any], Any] | None


class Prepared:
    """One statement for one dialect: `execute` / `executemany` take dicts keyed by bind name
    (a missing key binds NULL)."""

    def __init__(self, stmt: sa.ClauseElement, dialect: Dialect) -> None:
        compiled = stmt.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        self.sql = compiled.string
        procs: dict[str, Processor] = {
            name: bind.type.dialect_impl(dialect).bind_processor(dialect)
            for name, bind in compiled.binds.items()
        }
        # Positional paramstyles (SQLite's qmark) take a tuple in the compiler's order; named ones
        # (psycopg's pyformat) a dict.
        order = compiled.positiontup
        self._positional = order is not None
        self._names = list(order if order is not None else procs)
        self._procs = [procs[k] for k in self._names]

    def params(self, row: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        values = [
            row.get(k) if p is None else p(row.get(k)) for k, p in zip(self._names, self._procs, strict=True)
        ]
        return tuple(values) if self._positional else dict(zip(self._names, values, strict=True))

    def execute(self, cursor: Any, row: Mapping[str, Any]) -> Any:
        cursor.execute(self.sql, self.params(row))
        return cursor

    def executemany(self, cursor: Any, rows: Iterable[Mapping[str, Any]]) -> None:
        cursor.executemany(self.sql, [self.params(r) for r in rows])


def existing_ids_sql(dialect: Dialect, table: sa.Table, n: int) -> tuple[str, Callable[[Sequence[str]], Any]]:
    """`SELECT id FROM table WHERE id IN (...)` for `n` ids, and how to bind the ids: one
    placeholder per id on SQLite, one array parameter on PostgreSQL."""
    name = dialect.identifier_preparer.format_table(table)
    if dialect.name == "postgresql":
        return f"SELECT id FROM {name} WHERE id = ANY(%(ids)s)", lambda ids: {"ids": list(ids)}
    marks = ",".join("?" * n)
    return f"SELECT id FROM {name} WHERE id IN ({marks})", tuple
