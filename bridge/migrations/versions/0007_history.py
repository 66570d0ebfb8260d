"""typed history: gate decisions, version origins and preferences leave the meta table

Until now the version history was JSON in `meta`, each change rewriting a whole value:
`gate.decisions` (a list of decision records, cut at 500), `policy.rollbacks` ({"<version>":
<the version it copies>}), `policy.blends` ({"<version>": {"of", "alpha"}}) and
`learning.preferences` (a list of {text, count, turns, first_version}). They move into tables:
`gate_decisions` (a row per decision, appended), three nullable columns of `policy_versions`
(`copy_of`, `blend_of`, `blend_alpha`) and `preferences` (a row per preference, in the order
first seen). The meta keys are deleted once carried over; the downgrade writes them back.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
GATE_KEY, ROLLBACKS_KEY, BLENDS_KEY, PREFERENCES_KEY = (
    "gate.decisions", "policy.rollbacks", "policy.blends", "learning.preferences")
ORIGIN_COLUMNS = ("copy_of", "blend_of", "blend_alpha")

# Frozen copies of the tables as this revision moves rows between them: a migration never
# imports the live schema.
meta = sa.table("meta", sa.column("key", sa.Text), sa.column("value", sa.JSON), sa.column("updated_at", TS))
versions = sa.table("policy_versions", sa.column("version", sa.Integer), sa.column("copy_of", sa.Integer),
                    sa.column("blend_of", sa.Integer), sa.column("blend_alpha", sa.Float))
decisions = sa.table("gate_decisions", sa.column("id", sa.Integer), sa.column("candidate", sa.Integer),
                     sa.column("serving", sa.Integer), sa.column("decision", sa.String),
                     sa.column("reason", sa.Text), sa.column("figures", sa.JSON),
                     sa.column("reference", sa.String), sa.column("asked", sa.Text),
                     sa.column("created_at", TS))
preferences = sa.table("preferences", sa.column("position", sa.Integer), sa.column("text", sa.Text),
                       sa.column("count", sa.Integer), sa.column("turns", sa.JSON),
                       sa.column("first_version", sa.Integer), sa.column("updated_at", TS))


def _value(conn: sa.Connection, key: str) -> tuple[Any, Any]:
    """(value, updated_at) of a meta key; (None, None) when absent. A value stored as a JSON
    string of JSON (never written so, but cheap to accept) is decoded once more."""
    row = conn.execute(sa.select(meta.c.value, meta.c.updated_at).where(meta.c.key == key)).first()
    if row is None:
        return None, None
    value = json.loads(row.value) if isinstance(row.value, str) else row.value
    return value, row.updated_at


def upgrade() -> None:
    for name, kind in zip(ORIGIN_COLUMNS, (sa.Integer, sa.Integer, sa.Float), strict=True):
        op.add_column("policy_versions", sa.Column(name, kind))
    op.create_table(
        "gate_decisions",
        sa.Column("id", sa.Integer, nullable=False, autoincrement=True),
        sa.Column("candidate", sa.Integer, nullable=False),
        sa.Column("serving", sa.Integer, nullable=False),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("figures", sa.JSON, nullable=False),
        sa.Column("reference", sa.String(16)),
        sa.Column("asked", sa.Text),
        sa.Column("created_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_gate_decisions"),
    )
    op.create_index("ix_gate_decisions_candidate", "gate_decisions", ["candidate"])
    op.create_table(
        "preferences",
        sa.Column("position", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("turns", sa.JSON, nullable=False),
        sa.Column("first_version", sa.Integer, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("position", name="pk_preferences"),
    )
    conn = op.get_bind()
    gate, _ = _value(conn, GATE_KEY)
    for r in gate or ():
        conn.execute(decisions.insert().values(
            candidate=int(r["version"]), serving=int(r.get("serving", 0)), decision=str(r["decision"]),
            reason=str(r.get("reason", "")), figures=dict(r.get("figures") or {}), reference=r.get("reference"),
            asked=r.get("asked"), created_at=None))
    copies, _ = _value(conn, ROLLBACKS_KEY)
    for version, of in (copies or {}).items():
        conn.execute(versions.update().where(versions.c.version == int(version)).values(copy_of=int(of)))
    blends, _ = _value(conn, BLENDS_KEY)
    for version, b in (blends or {}).items():
        conn.execute(versions.update().where(versions.c.version == int(version))
                     .values(blend_of=int(b["of"]), blend_alpha=float(b["alpha"])))
    prefs, at = _value(conn, PREFERENCES_KEY)
    for i, p in enumerate(prefs or ()):
        conn.execute(preferences.insert().values(
            position=i, text=str(p["text"]), count=int(p["count"]), turns=list(p.get("turns", ())),
            first_version=int(p.get("first_version", 0)), updated_at=at))
    conn.execute(meta.delete().where(meta.c.key.in_((GATE_KEY, ROLLBACKS_KEY, BLENDS_KEY, PREFERENCES_KEY))))


def downgrade() -> None:
    conn = op.get_bind()
    now = conn.execute(sa.select(sa.func.max(meta.c.updated_at))).scalar()
    if now is None:
        from datetime import UTC, datetime

        now = datetime.now(UTC)
    gate = [{"version": r.candidate, "serving": r.serving, "decision": r.decision, "reason": r.reason,
             "figures": r.figures, "reference": r.reference, "asked": r.asked}
            for r in conn.execute(sa.select(decisions).order_by(decisions.c.id))][-500:]
    rows = conn.execute(sa.select(versions).order_by(versions.c.version)).all()
    copies = {str(r.version): r.copy_of for r in rows if r.copy_of is not None}
    blends = {str(r.version): {"of": r.blend_of, "alpha": r.blend_alpha} for r in rows if r.blend_of is not None}
    prefs = [{"text": r.text, "count": r.n, "turns": r.turns, "first_version": r.first_version}
             for r in conn.execute(sa.select(preferences.c.text, preferences.c.count.label("n"), preferences.c.turns,
                                             preferences.c.first_version).order_by(preferences.c.position))]
    for key, value in ((GATE_KEY, gate), (ROLLBACKS_KEY, copies), (BLENDS_KEY, blends), (PREFERENCES_KEY, prefs)):
        if value:
            conn.execute(meta.delete().where(meta.c.key == key))
            conn.execute(meta.insert().values(key=key, value=value, updated_at=now))
    op.drop_table("preferences")
    op.drop_index("ix_gate_decisions_candidate", table_name="gate_decisions")
    op.drop_table("gate_decisions")
    for name in reversed(ORIGIN_COLUMNS):
        if conn.dialect.name == "sqlite":
            op.execute(f"ALTER TABLE policy_versions DROP COLUMN {name}")
        else:
            op.drop_column("policy_versions", name)
