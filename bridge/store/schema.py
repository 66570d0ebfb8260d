"""Tables (SQLAlchemy Core). The Alembic migrations in `clawbridge.migrations` create exactly
this schema; a test compares the two so they cannot drift.

Token ids and logprobs are packed binary (see `records.pack_ids`); everything structured but
not queried on the hot path (messages, tools, params, votes, metrics) is JSON.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out. SQLite keeps no zone, so values are
    normalised to UTC before they are written and tagged as UTC when read."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store keeps aware UTC datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("source", sa.String(16), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("turns", sa.Integer, nullable=False, server_default="0"),
    sa.Column("main_turns", sa.Integer, nullable=False, server_default="0"),
    sa.Column("done", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("done_reason", sa.Text),
    sa.Column("done_at", UTCDateTime()),
    # The user the session is for (0009): a session belongs to the user who opened it. Named
    # user_name, since `user` is a reserved word of PostgreSQL (a bare `SELECT user` is the role).
    sa.Column("user_name", sa.Text, nullable=False, server_default="default"),
    sa.Index(None, "user_name"),  # a user's page, status and export read their sessions (0011)
)

turns = sa.Table(
    "turns",
    metadata,
    # Small columns first, blobs last: SQLite reads a row front to back (through overflow
    # pages), so the scans that filter on flags and times never touch the token arrays.
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
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
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("sampling", sa.JSON, nullable=False),
    sa.Column("request_params", sa.JSON, nullable=False),
    sa.Column("response", sa.JSON, nullable=False),
    sa.Column("completion_ids", sa.LargeBinary, nullable=False),
    sa.Column("logprobs", sa.LargeBinary, nullable=False),
    sa.Column("top_logprobs", sa.JSON(none_as_null=True)),
    sa.Column("tools", sa.JSON(none_as_null=True)),
    # A turn stores only the messages it adds to a turn it extends: its full message list is
    # the first `messages_keep` messages of turn `messages_base`'s full list, then `messages`.
    # No base: `messages` is the whole list. Rows are never deleted, and the writer checks the
    # base exists in the same transaction (no FK: SQLite could only add one by copying the table).
    sa.Column("messages_base", sa.Text),
    sa.Column("messages_keep", sa.Integer, nullable=False, server_default="0"),
    sa.Column("messages", sa.JSON, nullable=False),
    sa.Column("prompt_ids", sa.LargeBinary, nullable=False),
    # The conversation the turn answered and that conversation plus its reply, as structural
    # fingerprints (0006): any proxy on the store finds the turn a request continues by the
    # request's prefixes (docs/scale-out.md). NULL on turns recorded before.
    sa.Column("prompt_key", sa.LargeBinary),
    sa.Column("reply_key", sa.LargeBinary),
    # The user's standing preferences the turn was served with (0008), put into its prompt as a
    # system instruction (`chat.instructions.instructed`); `messages` stay as the client sent
    # them and `prompt_ids` are what was rendered. NULL: served without one.
    sa.Column("instruction", sa.Text),
    sa.Index(None, "session_id", "idx"),
    sa.Index(None, "created_at"),
    sa.Index(None, "reply_key"),
)

# A turn's next state (what the next main request appended after its reply), in a table of its
# own: attaching it is a small insert, where an update of the turn would rewrite its whole row
# (SQLite rewrites a row on any update; an OpenClaw turn's row is ~50 KB of ids and tools).
next_states = sa.Table(
    "next_states",
    metadata,
    sa.Column("turn_id", sa.Text, sa.ForeignKey("turns.id"), primary_key=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("messages", sa.JSON, nullable=False),
)

judgments = sa.Table(
    "judgments",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("turn_id", sa.Text, sa.ForeignKey("turns.id"), nullable=False),
    sa.Column("judge", sa.Text, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("votes", sa.JSON, nullable=False),
    sa.Column("reward", sa.Float),
    sa.Column("hint", sa.Text),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    # A re-run after a crash must not double a turn's judgment.
    sa.UniqueConstraint("turn_id", "kind", "judge"),
)

samples = sa.Table(
    "samples",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("turn_id", sa.Text, sa.ForeignKey("turns.id"), nullable=False),
    sa.Column("method", sa.String(16), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("reward", sa.Float),
    sa.Column("hint", sa.Text),
    sa.Column("teacher_logprobs", sa.LargeBinary),
    sa.Column("advantages", sa.LargeBinary),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("step", sa.Integer),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    # A hint-guided rewrite trained beside the turn (0005): ids, the policy's logprobs of them
    # under the turn's prompt, one advantage per token. All three or none.
    sa.Column("rewrite_ids", sa.LargeBinary),
    sa.Column("rewrite_logprobs", sa.LargeBinary),
    sa.Column("rewrite_advantages", sa.LargeBinary),
    # A turn can never yield two samples of the same kind.
    sa.UniqueConstraint("turn_id", "method"),
    sa.Index(None, "state", "id"),
)

training_steps = sa.Table(
    "training_steps",
    metadata,
    sa.Column("step", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version_before", sa.Integer, nullable=False),
    sa.Column("version_after", sa.Integer, nullable=False),
    sa.Column("metrics", sa.JSON, nullable=False),
    sa.Column("samples", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    # whose lineage the step trained (0012): version and step numbers are every user's together
    sa.Column("user_name", sa.Text, nullable=False, server_default="default"),
    sa.Index(None, "user_name"),
)

policy_versions = sa.Table(
    "policy_versions",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("path", sa.Text),
    sa.Column("step", sa.Integer),
    sa.Column("mean_reward", sa.Float),
    sa.Column("samples", sa.Integer, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    # What made a version no step trained (0007): a copy of another version's weights (a rollback,
    # or the gate giving a candidate up), or a held-back candidate's delta scaled by an alpha (a
    # blend the gate accepted). NULL on a trained version.
    sa.Column("copy_of", sa.Integer),
    sa.Column("blend_of", sa.Integer),
    sa.Column("blend_alpha", sa.Float),
    # the user whose adapter the version is (0012); v0, the base model, begins every lineage
    sa.Column("user_name", sa.Text, nullable=False, server_default="default"),
    sa.Index(None, "user_name"),
)

# The gate's decisions, one row each, oldest first (0007). A candidate may be judged more than once
# (a restart during the gate); its newest row is what was decided. `created_at` is NULL on the
# decisions carried over from before 0007, which kept no time.
gate_decisions = sa.Table(
    "gate_decisions",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("candidate", sa.Integer, nullable=False),
    sa.Column("serving", sa.Integer, nullable=False),
    sa.Column("decision", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("figures", sa.JSON, nullable=False),
    sa.Column("reference", sa.String(16)),
    sa.Column("asked", sa.Text),
    sa.Column("created_at", UTCDateTime()),
    sa.Index(None, "candidate"),
    sa.Column("user_name", sa.Text, nullable=False, server_default="default"),  # whose candidate (0012)
    sa.Index(None, "user_name"),
)

# The user's preferences (0007): what the judged hints asked for, in the order first heard
# (`position`); a hint that says what a known one says counts for it (its row is updated). Each
# has a state (0008: heard, applied, learned, superseded, dropped; learning.preferences) and
# belongs to the user whose corrections it was heard from (0010). `position` numbers every user's
# preferences together, so a preference's number (`position + 1`) names one preference of one user.
preferences = sa.Table(
    "preferences",
    metadata,
    sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("text", sa.Text, nullable=False),
    sa.Column("count", sa.Integer, nullable=False),
    sa.Column("turns", sa.JSON, nullable=False),
    sa.Column("first_version", sa.Integer, nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("state", sa.String(16), nullable=False, server_default="heard"),
    sa.Column("kind", sa.String(16)),
    sa.Column("confirmed", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("count_since", sa.Integer, nullable=False, server_default="0"),
    sa.Column("state_at", UTCDateTime()),
    sa.Column("applied_at", UTCDateTime()),
    sa.Column("applied_version", sa.Integer),
    sa.Column("learned_version", sa.Integer),
    sa.Column("dropped_at", UTCDateTime()),
    sa.Column("user_name", sa.Text, nullable=False, server_default="default"),
    sa.Index(None, "user_name"),
)

meta = sa.Table(
    "meta",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.JSON(none_as_null=True)),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
)

# Episodes of general agents (docs/design.md#methods, docs/agents.md): a group is n attempts at one task;
# an episode is one attempt, the main turns of its session (or, for a choice of an `n > 1`
# request, that one turn), ending in an outcome reward. No foreign key to sessions: the session
# row appears with the episode's first request.
groups = sa.Table(
    "groups",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("task", sa.JSON(none_as_null=True)),
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # open | closed | trained | dropped
    sa.Column("reason", sa.Text),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Index(None, "state"),
)

episodes = sa.Table(
    "episodes",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("group_id", sa.Text, sa.ForeignKey("groups.id"), nullable=False),
    sa.Column("idx", sa.Integer, nullable=False),
    sa.Column("session_id", sa.Text, nullable=False),
    sa.Column("turn_id", sa.Text),
    sa.Column("state", sa.String(16), nullable=False),  # open | scored | expired
    sa.Column("outcome", sa.Float),
    sa.Column("reason", sa.Text),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("ended_at", UTCDateTime()),
    sa.Index(None, "group_id"),
    sa.Index(None, "session_id"),
    sa.Index(None, "turn_id"),
)

# Roles only one process may hold at a time (the trainer, `store.lease`): the holder renews its
# claim before `expires_at`; another process takes the role over once the claim has run out.
leases = sa.Table(
    "leases",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("acquired_at", UTCDateTime(), nullable=False),
    sa.Column("expires_at", UTCDateTime(), nullable=False),
)
