"""scale out: several proxies on one store, one trainer

Two keys on every turn, so any proxy on the store can continue a conversation another one
served: `prompt_key` identifies the conversation the turn answered (the structural fingerprint
of its history, `serving.sessions.fingerprints`), `reply_key` that conversation plus the turn's
reply, which is what the next request of the conversation starts with. A proxy looks a request's
prefixes up by `reply_key` (indexed) to find the session an untagged request continues and the
turn its new messages are the next state of. Turns recorded before this migration have neither
key: they continue only in the process that served them.

`leases`: one row per role that only one process may hold at a time (the trainer), with the
holder and when its claim runs out; a holder renews it, a waiting process takes it over once it
has run out.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("turns", sa.Column("prompt_key", sa.LargeBinary))
    op.add_column("turns", sa.Column("reply_key", sa.LargeBinary))
    op.create_index("ix_turns_reply_key", "turns", ["reply_key"])
    op.create_table(
        "leases",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("acquired_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_leases"),
    )


def downgrade() -> None:
    op.drop_table("leases")
    op.drop_index("ix_turns_reply_key", table_name="turns")
    for name in ("reply_key", "prompt_key"):
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE turns DROP COLUMN {name}")
        else:
            op.drop_column("turns", name)
