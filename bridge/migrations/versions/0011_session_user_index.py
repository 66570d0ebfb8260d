"""an index on the user a session belongs to

A user's page, `clawbridge status --user`, `export --user` and `users delete` read that user's
sessions (and through them their turns) by `sessions.user_name`; without an index each read
scans every session of every user.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_sessions_user_name", "sessions", ["user_name"])


def downgrade() -> None:
    op.drop_index("ix_sessions_user_name", "sessions")
