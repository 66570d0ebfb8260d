"""The version history: the gate's decisions, what made each version no step trained (a copy of
another's weights, or a blend of a held-back candidate), and the user's standing preferences.

One reader (`read_history`, `HistoryStore.history`) serves the page, `clawbridge versions` and
`status`, the demo and the trainer. The writers append: a decision is a new row, a version's
origin is written with its row (`PolicyVersionRow.copy_of`, `.blend_of`), and a preference is
a row updated in place when a new hint says the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

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


PreferenceState = Literal["heard", "applied", "learned", "superseded", "dropped"]


@dataclass(frozen=True)
class Preference:
    """A preference the user has asked for (`learning.preferences` decides its state)."""

    text: str  # the shortest wording heard
    count: int  # judged turns whose hint said it
    turns: tuple[str, ...]  # the turns whose hint counted for it (each counts once), oldest first
    first_version: int  # the policy version serving when it was first heard
    id: int = 0  # its number, 1, 2, ... in the order first heard (`clawbridge preferences forget N`); 0: not stored yet
    state: PreferenceState = "heard"
    kind: str | None = None  # the form of an answer it is about (length, format, ...); None: something else
    confirmed: bool = False  # the user confirmed it (it applies without being heard twice)
    count_since: int = 0  # hearings since it was last superseded (it applies again at two)
    state_at: datetime | None = None  # since when it is in its state
    applied_at: datetime | None = None  # when it was last applied
    applied_version: int | None = None  # the policy version serving when it was last applied
    learned_version: int | None = None  # the version whose weights alone keep it (state "learned")
    dropped_at: datetime | None = None  # when the user dropped it


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
    g, pv = t.gate_decisions.c, t.policy_versions.c
    decisions = tuple(
        GateRecord(r.candidate, r.serving, r.decision, r.reason, dict(r.figures or {}), r.reference, r.asked,
                   r.created_at)
        for r in conn.execute(sa.select(t.gate_decisions).order_by(g.id)))
    origins = conn.execute(sa.select(pv.version, pv.copy_of, pv.blend_of, pv.blend_alpha)
                           .where(sa.or_(pv.copy_of.is_not(None), pv.blend_of.is_not(None)))).all()
    return History(
        decisions=decisions,
        copies={r.version: r.copy_of for r in origins if r.copy_of is not None},
        blends={r.version: (r.blend_of, float(r.blend_alpha or 0.0)) for r in origins if r.blend_of is not None},
        preferences=read_preferences(conn),
    )


PREFERENCE_COLUMNS = ("state", "kind", "confirmed", "count_since", "state_at", "applied_at", "applied_version",
                      "learned_version", "dropped_at")


def read_preferences(conn: sa.Connection) -> tuple[Preference, ...]:
    p = t.preferences.c
    rows = conn.execute(sa.select(t.preferences, p.count.label("n")).order_by(p.position))
    return tuple(Preference(r.text, r.n, tuple(r.turns), r.first_version, id=r.position + 1,
                            **{k: getattr(r, k) for k in PREFERENCE_COLUMNS}) for r in rows)


def _row(pref: Preference) -> dict[str, Any]:
    return {"text": pref.text, "count": pref.count, "turns": list(pref.turns), "first_version": pref.first_version,
            **{k: getattr(pref, k) for k in PREFERENCE_COLUMNS}}


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

    def preferences(self) -> tuple[Preference, ...]:
        """The preferences alone, first heard first (what the served instruction is made of)."""
        with self._read() as conn:
            return read_preferences(conn)

    def save_preferences(self, prefs: Sequence[Preference]) -> None:
        """The preferences as `learning.preferences` left them: a known one keeps its position
        (its row is updated when it changed), a new one is appended."""
        with self._write() as conn:
            self._save_preferences(conn, prefs)

    def update_preferences(self, change: Callable[[list[Preference]], list[Preference]]) -> list[Preference]:
        """Read the preferences, `change` them (a pure function of the list) and write the result,
        in one transaction that no other writer interleaves with (SQLite: BEGIN IMMEDIATE;
        PostgreSQL: the table locked), so concurrent hearings, confirmations and forgets never
        lose one another. Returns the list written."""
        with self._write() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("LOCK TABLE preferences IN SHARE ROW EXCLUSIVE MODE"))
            out = change(list(read_preferences(conn)))
            self._save_preferences(conn, out)
            return out

    def set_preference_state(self, pref_id: int, state: PreferenceState, version: int | None = None) -> Preference:
        """Set preference `pref_id`'s state as the gate decides it: "learned" (the weights of
        `version` alone keep it: its instruction is no longer served) or back to "applied" (a
        later version lost it: it is served again). KeyError: no such preference."""
        if state not in ("learned", "applied"):
            raise ValueError(f"the gate sets a preference learned or applied, not {state!r}")

        def change(prefs: list[Preference]) -> list[Preference]:
            at = _index(prefs, pref_id)
            now = utcnow()
            p = prefs[at]
            if state == "learned":
                prefs[at] = replace(p, state="learned", state_at=now, learned_version=version)
            else:
                prefs[at] = replace(p, state="applied", state_at=now, learned_version=None, applied_at=now,
                                    applied_version=version if version is not None else p.applied_version)
            return prefs

        out = self.update_preferences(change)
        return out[_index(out, pref_id)]

    def forget_preference(self, pref_id: int) -> Preference:
        """The user drops preference `pref_id`: its instruction stops (state "dropped"; its
        samples: `drop_preference_samples`). KeyError: no such preference."""

        def change(prefs: list[Preference]) -> list[Preference]:
            at, now = _index(prefs, pref_id), utcnow()
            prefs[at] = replace(prefs[at], state="dropped", state_at=now, dropped_at=now, confirmed=False)
            return prefs

        out = self.update_preferences(change)
        return out[_index(out, pref_id)]

    def drop_preference_samples(self, pref_id: int) -> int:
        """The samples of the turns whose hint counted for preference `pref_id` and that are not
        trained yet are dropped, with the reason; returns how many. Run it where no training step
        is under way (the learner's lock): a step commits its batch as trained all or nothing."""
        p = self.preferences()[_index(self.preferences(), pref_id)]
        if not p.turns:
            return 0
        s = t.samples.c
        with self._write() as conn:
            dropped = conn.execute(
                sa.update(t.samples)
                .where(s.turn_id.in_(list(p.turns)), s.state.in_(("pending", "judged")))
                .values(state="dropped", reason=f"the user dropped preference {pref_id}", updated_at=utcnow())
            ).rowcount
        return int(dropped or 0)

    def _save_preferences(self, conn: sa.Connection, prefs: Sequence[Preference]) -> None:
        p = t.preferences.c
        stored = {q.id: _row(q) for q in read_preferences(conn)}
        now = utcnow()
        for i, pref in enumerate(prefs):
            row = _row(pref)
            if stored.get(i + 1) == row:
                continue
            if i + 1 in stored:
                conn.execute(t.preferences.update().where(p.position == i).values(**row, updated_at=now))
            else:
                conn.execute(t.preferences.insert().values(position=i, **row, updated_at=now))


def _index(prefs: Sequence[Preference], pref_id: int) -> int:
    at = next((i for i, p in enumerate(prefs) if p.id == pref_id), None)
    if at is None:
        raise KeyError(pref_id)
    return at
