"""the user a session is for

Several users share one server (docs/serving.md#users): each session belongs to the user who
opened it, kept in `sessions.user_name` (not `user`, a reserved word of PostgreSQL). The sessions
carried over were all one user's, `default`, which is what a request naming no user is for. A
turn's user is its session's. The downgrade drops the column.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a constant default fills the existing rows without rewriting them (SQLite, PostgreSQL 11+)
    op.add_column("sessions", sa.Column("user_name", sa.Text, nullable=False, server_default="default"))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":  # no batch copy of the table
        op.execute("ALTER TABLE sessions DROP COLUMN user_name")
    else:
        op.drop_column("sessions", "user_name")
