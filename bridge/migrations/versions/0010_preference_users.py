"""the user a preference belongs to

Each user's corrections make that user's preferences (docs/serving.md#users): a row of
`preferences` gets `user_name`, the user of the turns it was heard from. The preferences carried
over were heard when one user's preferences were everyone's; they become `default`'s, the user of
a request that names nobody, so a single-user install serves what it served. `position` stays the
one numbering of every user's preferences (a preference's number names one preference of one
user). The downgrade drops the column: every user's preferences become one list again.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a constant default fills the existing rows without rewriting them (SQLite, PostgreSQL 11+)
    op.add_column("preferences", sa.Column("user_name", sa.Text, nullable=False, server_default="default"))
    op.create_index("ix_preferences_user_name", "preferences", ["user_name"])


def downgrade() -> None:
    op.drop_index("ix_preferences_user_name", "preferences")
    if op.get_bind().dialect.name == "sqlite":  # no batch copy of the table
        op.execute("ALTER TABLE preferences DROP COLUMN user_name")
    else:
        op.drop_column("preferences", "user_name")
