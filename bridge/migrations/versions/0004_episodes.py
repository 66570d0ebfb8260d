"""groups and episodes: outcome rewards for general agents

A group is n attempts at one task; an episode is one attempt (a session's main turns, or one
choice of an `n > 1` request) and its outcome. New tables only: no existing row changes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "groups",
        sa.Column("id", sa.Text, nullable=False),
        sa.Column("task", sa.JSON),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_groups"),
    )
    op.create_index("ix_groups_state", "groups", ["state"])
    op.create_table(
        "episodes",
        sa.Column("id", sa.Text, nullable=False),
        sa.Column("group_id", sa.Text, nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("turn_id", sa.Text),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("outcome", sa.Float),
        sa.Column("reason", sa.Text),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("ended_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_episodes"),
        sa.ForeignKeyConstraint(["group_id"], ["groups.id"], name="fk_episodes_group_id_groups"),
    )
    op.create_index("ix_episodes_group_id", "episodes", ["group_id"])
    op.create_index("ix_episodes_session_id", "episodes", ["session_id"])
    op.create_index("ix_episodes_turn_id", "episodes", ["turn_id"])


def downgrade() -> None:
    op.drop_table("episodes")
    op.drop_table("groups")
