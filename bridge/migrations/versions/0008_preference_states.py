"""preference states, and the instruction a turn was served with

A preference is heard from judged corrections and applied at once as an instruction to what is
served (docs/methods.md#preferences-heard-applied-learned), so each row of `preferences` gets a
state (`heard`, `applied`, `learned`, `superseded`, `dropped`), the form `kind` it is about,
whether the user `confirmed` it, `count_since` (hearings since it was last superseded), and when
and under which version it changed state. The rows carried over start `heard` with every hearing
counted; the next hearing applies those that qualify. `turns` gets `instruction`: the standing
preferences a turn was served with (NULL: none). The downgrade drops the columns.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def columns() -> tuple[sa.Column, ...]:  # type: ignore[type-arg]
    """The new columns of `preferences` (made afresh for each use: a column belongs to one table)."""
    return (
        sa.Column("state", sa.String(16), nullable=False, server_default="heard"),
        sa.Column("kind", sa.String(16)),
        sa.Column("confirmed", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("count_since", sa.Integer, nullable=False, server_default="0"),
        sa.Column("state_at", TS),
        sa.Column("applied_at", TS),
        sa.Column("applied_version", sa.Integer),
        sa.Column("learned_version", sa.Integer),
        sa.Column("dropped_at", TS),
    )


preferences = sa.table("preferences", sa.column("count", sa.Integer), sa.column("count_since", sa.Integer))


def upgrade() -> None:
    for column in columns():
        op.add_column("preferences", column)
    op.add_column("turns", sa.Column("instruction", sa.Text))
    op.get_bind().execute(preferences.update().values(count_since=preferences.c.count))


def _drop(table: str, name: str) -> None:
    if op.get_bind().dialect.name == "sqlite":  # no batch copy of a table of token blobs
        op.execute(f"ALTER TABLE {table} DROP COLUMN {name}")
    else:
        op.drop_column(table, name)


def downgrade() -> None:
    _drop("turns", "instruction")
    for column in reversed(columns()):
        _drop("preferences", column.name)
