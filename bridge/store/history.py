"""The version history: the gate's decisions, what made each version no step trained (a copy of
another's weights, or a blend of a held-back candidate), and the user's standing preferences.

One reader (`read_history`, `HistoryStore.history`) serves the page, `clawbridge versions` and
`status`, the demo and the trainer. The writers append: a decision is a new row, a version's
origin is written with its row (`PolicyVersionRow.copy_of`, `.blend_of`), and a preference is
a row updated in place when a new hint says the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase
from clawbridge.store.records import utcnow


@dataclass(frozen=True)
class GateRecord:
    """One decision of the gate on a candidate, as stored."""

    candidate: int
    serving: int  # the version serving while the candidate was judged
    decision: str  # "accepted" | "rejected"
    reason: str
    figures: dict[str, float] = field(default_factory=dict)
    reference: str | None = None  # what the general probe was judged against ("twin" | "v0")
    asked: str | None = None  # the preferences the twin was asked with
    created_at: datetime | None = None  # None: decided before the store kept the time

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> GateRecord:
        """From a decision's record (`learning.gate.GateDecision.record()`)."""
        return cls(int(record["version"]), int(record["serving"]), str(record["decision"]), str(record["reason"]),
                   dict(record.get("figures") or {}), record.get("reference"), record.get("asked"))

    def as_json(self) -> dict[str, Any]:
        """The record's JSON, keyed as `GateDecision.record()` (the page reads it)."""
        return {"version": self.candidate, "serving": self.serving, "decision": self.decision,
                "reason": self.reason, "figures": self.figures, "reference": self.reference, "asked": self.asked}


@dataclass(frozen=True)
class Preference:
    text: str  # the shortest wording seen
    count: int  # trained samples whose hint said it
    turns: tuple[str, ...]  # where it came from: the newest turn ids
    first_version: int  # the policy version trained from it first


@dataclass(frozen=True)
class History:
    decisions: tuple[GateRecord, ...] = ()  # oldest first
    copies: dict[int, int] = field(default_factory=dict)  # version -> the version whose weights it copies
    blends: dict[int, tuple[int, float]] = field(default_factory=dict)  # version -> (candidate, alpha)
    preferences: tuple[Preference, ...] = ()  # first seen first

    def decision(self, version: int) -> GateRecord | None:
        """The gate's newest decision on `version` (None: never judged)."""
        return next((d for d in reversed(self.decisions) if d.candidate == version), None)

    def by_version(self) -> dict[int, GateRecord]:
        """Each judged version's newest decision."""
        return {d.candidate: d for d in self.decisions}

    def same_weights(self, a: int, b: int) -> bool:
        """Whether versions `a` and `b` serve the same weights: a gate's rejection (or
        `clawbridge rollback`) publishes the serving version's weights as a new version, and a
        copy may be of a copy."""
        def origin(v: int) -> int:
            seen = set()
            while v in self.copies and v not in seen:
                seen.add(v)
                v = self.copies[v]
            return v

        return origin(a) == origin(b)


def read_history(conn: sa.Connection) -> History:
    g, pv, p = t.gate_decisions.c, t.policy_versions.c, t.preferences.c
    decisions = tuple(
        GateRecord(r.candidate, r.serving, r.decision, r.reason, dict(r.figures or {}), r.reference, r.asked,
                   r.created_at)
        for r in conn.execute(sa.select(t.gate_decisions).order_by(g.id)))
    origins = conn.execute(sa.select(pv.version, pv.copy_of, pv.blend_of, pv.blend_alpha)
                           .where(sa.or_(pv.copy_of.is_not(None), pv.blend_of.is_not(None)))).all()
    prefs = tuple(Preference(r.text, r.n, tuple(r.turns), r.first_version)
                  for r in conn.execute(sa.select(p.text, p.count.label("n"), p.turns, p.first_version)
                                        .order_by(p.position)))
    return History(
        decisions=decisions,
        copies={r.version: r.copy_of for r in origins if r.copy_of is not None},
        blends={r.version: (r.blend_of, float(r.blend_alpha or 0.0)) for r in origins if r.blend_of is not None},
        preferences=prefs,
    )


def history_mark(conn: sa.Connection) -> tuple[Any, Any]:
    """Moves whenever a decision or a preference is recorded (the page's change token; a
    version's origin comes with its row, which the token watches already)."""
    return (conn.execute(sa.select(sa.func.max(t.gate_decisions.c.id))).scalar(),
            conn.execute(sa.select(sa.func.max(t.preferences.c.updated_at))).scalar())


class HistoryStore(StoreBase):
    def history(self) -> History:
        with self._read() as conn:
            return read_history(conn)

    def record_gate_decision(self, record: GateRecord) -> None:
        with self._write() as conn:
            conn.execute(t.gate_decisions.insert().values(
                candidate=record.candidate, serving=record.serving, decision=record.decision,
                reason=record.reason, figures=record.figures, reference=record.reference, asked=record.asked,
                created_at=record.created_at or utcnow()))

    def save_preferences(self, prefs: Sequence[Preference]) -> None:
        """The preferences as `learning.preferences.merge` left them: a known one keeps its
        position (its row is updated when it changed), a new one is appended."""
        p = t.preferences.c
        with self._write() as conn:
            stored = {r.position: (r.text, r.n, tuple(r.turns), r.first_version)
                      for r in conn.execute(sa.select(p.position, p.text, p.count.label("n"), p.turns,
                                                      p.first_version))}
            now = utcnow()
            for i, pref in enumerate(prefs):
                row = (pref.text, pref.count, tuple(pref.turns), pref.first_version)
                if stored.get(i) == row:
                    continue
                values = {"text": pref.text, "count": pref.count, "turns": list(pref.turns),
                          "first_version": pref.first_version, "updated_at": now}
                if i in stored:
                    conn.execute(t.preferences.update().where(p.position == i).values(**values))
                else:
                    conn.execute(t.preferences.insert().values(position=i, **values))
