"""turns store only the messages they add: messages_base, messages_keep

A turn of a growing conversation used to rewrite the whole message list (~50 KB per OpenClaw
turn). From this revision a turn may name the turn it extends (`messages_base`) and how many of
that turn's messages it keeps (`messages_keep`); `messages` then holds only what follows. Rows
written before keep `messages_base` NULL: their `messages` is the whole list, as it was, so no
data moves.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("messages_base", sa.Text))
        batch.add_column(sa.Column("messages_keep", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    # Without the two columns a delta turn would lose its history: write every turn's whole
    # list back first (oldest first, so a base is always whole before the turns that extend it).
    turns = sa.table(
        "turns", sa.column("id", sa.Text), sa.column("created_at"), sa.column("messages_base", sa.Text),
        sa.column("messages_keep", sa.Integer), sa.column("messages", sa.JSON),
    )
    conn = op.get_bind()
    full: dict[str, list] = {}
    rows = conn.execute(
        sa.select(turns.c.id, turns.c.messages_base, turns.c.messages_keep, turns.c.messages)
        .order_by(turns.c.created_at, turns.c.id)
    ).all()
    by_id = {r.id: r for r in rows}

    def whole(turn_id: str) -> list:
        if turn_id not in full:
            r = by_id[turn_id]
            full[turn_id] = r.messages if r.messages_base is None else (
                whole(r.messages_base)[: r.messages_keep] + r.messages
            )
        return full[turn_id]

    for r in rows:
        if r.messages_base is not None:
            conn.execute(sa.update(turns).where(turns.c.id == r.id).values(messages=whole(r.id)))
    with op.batch_alter_table("turns") as batch:
        batch.drop_column("messages_keep")
        batch.drop_column("messages_base")
