"""hint-guided rewrites: a sample may carry a demonstration beside the turn's own answer

The teacher (the model with the user's hint in its prompt) writes the answer the hint asks for;
the sample keeps it (its token ids, the policy's logprobs of them under the turn's own prompt,
and one advantage per token) so the trainer trains it in the same step as the turn, exactly
once. Three nullable columns: no existing row changes.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COLUMNS = ("rewrite_ids", "rewrite_logprobs", "rewrite_advantages")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("samples", sa.Column(name, sa.LargeBinary))


def downgrade() -> None:
    for name in reversed(COLUMNS):
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE samples DROP COLUMN {name}")
        else:
            op.drop_column("samples", name)
