"""each user's own lineage of versions, steps and gate decisions

Every user trains an adapter of their own (docs/learning.md#each-user-their-own-adapter): a
policy version, a training step and a gate decision belong to the user whose samples made them
(`user_name`). Version and step numbers stay one numbering for every user (a version number names
one adapter), while staleness, the gate and what serves are each user's own. The rows carried over
were trained when one adapter served everyone; they become `default`'s, the user of a request
that names nobody, so a single-user install serves and trains on what it did. v0, the base
model, begins every lineage.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

TABLES = ("policy_versions", "training_steps", "gate_decisions")


def upgrade() -> None:
    # a constant default fills the existing rows without rewriting them (SQLite, PostgreSQL 11+)
    for table in TABLES:
        op.add_column(table, sa.Column("user_name", sa.Text, nullable=False, server_default="default"))
        op.create_index(f"ix_{table}_user_name", table, ["user_name"])


def downgrade() -> None:
    for table in TABLES:
        op.drop_index(f"ix_{table}_user_name", table)
        if op.get_bind().dialect.name == "sqlite":  # no batch copy of the table
            op.execute(f"ALTER TABLE {table} DROP COLUMN user_name")
        else:
            op.drop_column(table, "user_name")
