"""next states in a table of their own

Attaching a turn's next state updated the turn's row, and SQLite rewrites a whole row on any
update: ~50 KB of prompt ids and tools for an OpenClaw turn, on the write path of the request
that carried the next state. Now it is a small insert into `next_states`; the two columns of
`turns` move there.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def _drop_turn_columns(*names: str) -> None:
    for name in names:
        if op.get_bind().dialect.name == "sqlite":
            # Native since SQLite 3.35; a batch migration would copy the whole turns table.
            op.execute(f"ALTER TABLE turns DROP COLUMN {name}")
        else:
            op.drop_column("turns", name)


def upgrade() -> None:
    op.create_table(
        "next_states",
        sa.Column("turn_id", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("messages", sa.JSON, nullable=False),
        sa.PrimaryKeyConstraint("turn_id", name="pk_next_states"),
        sa.ForeignKeyConstraint(["turn_id"], ["turns.id"], name="fk_next_states_turn_id_turns"),
    )
    op.execute(
        "INSERT INTO next_states (turn_id, created_at, messages) "
        "SELECT id, next_state_at, next_state FROM turns "
        "WHERE next_state_at IS NOT NULL AND next_state IS NOT NULL"
    )
    _drop_turn_columns("next_state", "next_state_at")


def downgrade() -> None:
    with op.batch_alter_table("turns") as batch:
        batch.add_column(sa.Column("next_state_at", TS))
        batch.add_column(sa.Column("next_state", sa.JSON))
    op.execute(
        "UPDATE turns SET next_state_at = (SELECT created_at FROM next_states WHERE turn_id = turns.id), "
        "next_state = (SELECT messages FROM next_states WHERE turn_id = turns.id)"
    )
    op.drop_table("next_states")
