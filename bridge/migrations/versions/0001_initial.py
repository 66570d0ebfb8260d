"""initial schema: sessions, turns, judgments, samples, training steps, policy versions, meta

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Frozen copies of the types as they were at this revision: a migration never imports the live
# schema, which moves on.
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.Text, nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("turns", sa.Integer, nullable=False, server_default="0"),
        sa.Column("main_turns", sa.Integer, nullable=False, server_default="0"),
        sa.Column("done", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("done_reason", sa.Text),
        sa.Column("done_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_table(
        "turns",
        sa.Column("id", sa.Text, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("turn_type", sa.String(8), nullable=False),
        sa.Column("tagged", sa.Boolean, nullable=False),
        sa.Column("train", sa.Boolean, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.Text, nullable=False),
        sa.Column("n_prompt", sa.Integer, nullable=False),
        sa.Column("n_completion", sa.Integer, nullable=False),
        sa.Column("queued_ms", sa.Float),
        sa.Column("ttft_ms", sa.Float),
        sa.Column("total_ms", sa.Float),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("next_state_at", TS),
        sa.Column("sampling", sa.JSON, nullable=False),
        sa.Column("request_params", sa.JSON, nullable=False),
        sa.Column("next_state", sa.JSON),
        sa.Column("response", sa.JSON, nullable=False),
        sa.Column("completion_ids", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
        sa.Column("top_logprobs", sa.JSON),
        sa.Column("tools", sa.JSON),
        sa.Column("messages", sa.JSON, nullable=False),
        sa.Column("prompt_ids", sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_turns"),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_turns_session_id_sessions"
        ),
    )
    op.create_index("ix_turns_session_id_idx", "turns", ["session_id", "idx"])
    op.create_index("ix_turns_created_at", "turns", ["created_at"])
    op.create_table(
        "judgments",
        sa.Column("id", sa.Integer, autoincrement=True, nullable=False),
        sa.Column("turn_id", sa.Text, nullable=False),
        sa.Column("judge", sa.Text, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("votes", sa.JSON, nullable=False),
        sa.Column("reward", sa.Float),
        sa.Column("hint", sa.Text),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_judgments"),
        sa.ForeignKeyConstraint(["turn_id"], ["turns.id"], name="fk_judgments_turn_id_turns"),
        sa.UniqueConstraint("turn_id", "kind", "judge", name="uq_judgments_turn_id_kind_judge"),
    )
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer, autoincrement=True, nullable=False),
        sa.Column("turn_id", sa.Text, nullable=False),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("reward", sa.Float),
        sa.Column("hint", sa.Text),
        sa.Column("teacher_logprobs", sa.LargeBinary),
        sa.Column("advantages", sa.LargeBinary),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_samples"),
        sa.ForeignKeyConstraint(["turn_id"], ["turns.id"], name="fk_samples_turn_id_turns"),
        sa.UniqueConstraint("turn_id", "method", name="uq_samples_turn_id_method"),
    )
    op.create_index("ix_samples_state_id", "samples", ["state", "id"])
    op.create_table(
        "training_steps",
        sa.Column("step", sa.Integer, autoincrement=False, nullable=False),
        sa.Column("version_before", sa.Integer, nullable=False),
        sa.Column("version_after", sa.Integer, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("step", name="pk_training_steps"),
    )
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer, autoincrement=False, nullable=False),
        sa.Column("path", sa.Text),
        sa.Column("step", sa.Integer),
        sa.Column("mean_reward", sa.Float),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("version", name="pk_policy_versions"),
    )
    op.create_table(
        "meta",
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("value", sa.JSON),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_meta"),
    )


def downgrade() -> None:
    for table in ("meta", "policy_versions", "training_steps", "samples", "judgments"):
        op.drop_table(table)
    op.drop_index("ix_turns_created_at", "turns")
    op.drop_index("ix_turns_session_id_idx", "turns")
    op.drop_table("turns")
    op.drop_table("sessions")
