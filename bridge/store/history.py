"""The version history: the gate's decisions, what made each version no step trained (a copy of
another's weights, or a blend of a held-back candidate), and the user's standing preferences.

One reader (`read_history`, `HistoryStore.history`) serves the page, `clawbridge versions` and
`status`, the demo and the trainer. The writers append: a decision is a new row, a version's
origin is written with its row (`PolicyVersionRow.copy_of`, `.blend_of`), and a preference is
a row updated in place when a new hint says the same thing.

Preferences belong to a user (`Preference.user`, the user of the turns they were heard from): a
user's are read, changed and written apart from everyone else's (`user`, default `default`: a
single-user install's only one). Their numbers (`Preference.id`) are one sequence over every
user's, so a number names one preference of one user: the store gives a new one the next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase
from clawbridge.store.records import DEFAULT_USER, utcnow


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
    user: str = DEFAULT_USER  # whose candidate it judged

    @classmethod
    def of(cls, record: Mapping[str, Any], user: str = DEFAULT_USER) -> GateRecord:
        """From a decision's record (`learning.gate.GateDecision.record()`)."""
        return cls(int(record["version"]), int(record["serving"]), str(record["decision"]), str(record["reason"]),
                   dict(record.get("figures") or {}), record.get("reference"), record.get("asked"), user=user)

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
    user: str = DEFAULT_USER  # whose it is: the user whose corrections it was heard from


@dataclass(frozen=True)
class History:
    decisions: tuple[GateRecord, ...] = ()  # oldest first
    copies: dict[int, int] = field(default_factory=dict)  # version -> the version whose weights it copies
    blends: dict[int, tuple[int, float]] = field(default_factory=dict)  # version -> (candidate, alpha)
    preferences: tuple[Preference, ...] = ()  # every user's, first seen first

    def decision(self, version: int) -> GateRecord | None:
        """The gate's newest decision on `version` (None: never judged)."""
        return next((d for d in reversed(self.decisions) if d.candidate == version), None)

    def served(self, serving: int) -> list[int]:
        """The versions that served, oldest first, up to `serving`: v0, each candidate the gate
        accepted, each copy and blend, and `serving` itself. Candidates trained on unjudged
        (`gate_every`) or held back never served."""
        accepted = {d.candidate for d in self.decisions if d.decision == "accepted"}
        return sorted(v for v in {0, serving, *accepted, *self.copies, *self.blends} if v <= serving)

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


def read_history(conn: sa.Connection, user: str | None = None) -> History:
    """The gate's decisions and the versions' origins, of `user`'s lineage only if given; the
    preferences are every user's."""
    g, pv = t.gate_decisions.c, t.policy_versions.c
    decided = sa.select(t.gate_decisions).order_by(g.id)
    made = (sa.select(pv.version, pv.copy_of, pv.blend_of, pv.blend_alpha)
            .where(sa.or_(pv.copy_of.is_not(None), pv.blend_of.is_not(None))))
    if user is not None:
        decided, made = decided.where(g.user_name == user), made.where(pv.user_name == user)
    decisions = tuple(
        GateRecord(r.candidate, r.serving, r.decision, r.reason, dict(r.figures or {}), r.reference, r.asked,
                   r.created_at, r.user_name)
        for r in conn.execute(decided))
    origins = conn.execute(made).all()
    return History(
        decisions=decisions,
        copies={r.version: r.copy_of for r in origins if r.copy_of is not None},
        blends={r.version: (r.blend_of, float(r.blend_alpha or 0.0)) for r in origins if r.blend_of is not None},
        preferences=read_preferences(conn),
    )


PREFERENCE_COLUMNS = ("state", "kind", "confirmed", "count_since", "state_at", "applied_at", "applied_version",
                      "learned_version", "dropped_at")


def read_preferences(conn: sa.Connection, user: str | None = None,
                     states: Sequence[str] | None = None) -> tuple[Preference, ...]:
    """`user`'s preferences (None: every user's), those in `states` only if given, first heard first."""
    p = t.preferences.c
    q = sa.select(t.preferences, p.count.label("n")).order_by(p.position)
    if user is not None:
        q = q.where(p.user_name == user)
    if states is not None:
        q = q.where(p.state.in_(list(states)))
    return tuple(Preference(r.text, r.n, tuple(r.turns), r.first_version, id=r.position + 1, user=r.user_name,
                            **{k: getattr(r, k) for k in PREFERENCE_COLUMNS}) for r in conn.execute(q))


def _row(pref: Preference) -> dict[str, Any]:
    return {"text": pref.text, "count": pref.count, "turns": list(pref.turns), "first_version": pref.first_version,
            **{k: getattr(pref, k) for k in PREFERENCE_COLUMNS}}


def history_mark(conn: sa.Connection) -> tuple[Any, Any]:
    """Moves whenever a decision or a preference is recorded (the page's change token; a
    version's origin comes with its row, which the token watches already)."""
    return (conn.execute(sa.select(sa.func.max(t.gate_decisions.c.id))).scalar(),
            conn.execute(sa.select(sa.func.max(t.preferences.c.updated_at))).scalar())


class HistoryStore(StoreBase):
    def history(self, user: str | None = None) -> History:
        """Every lineage's history together, or `user`'s (`read_history`)."""
        with self._read() as conn:
            return read_history(conn, user)

    def record_gate_decision(self, record: GateRecord) -> None:
        with self._write() as conn:
            conn.execute(t.gate_decisions.insert().values(
                candidate=record.candidate, serving=record.serving, decision=record.decision,
                reason=record.reason, figures=record.figures, reference=record.reference, asked=record.asked,
                created_at=record.created_at or utcnow(), user_name=record.user))

    def preferences(self, user: str = DEFAULT_USER) -> tuple[Preference, ...]:
        """`user`'s preferences, first heard first (what their served instruction is made of)."""
        with self._read() as conn:
            return read_preferences(conn, user)

    def all_preferences(self, states: Sequence[str] | None = None) -> tuple[Preference, ...]:
        """Every user's preferences (those in `states` only, if given), first heard first: what the
        proxy serves each user, and what the one shared adapter's gate is asked with."""
        with self._read() as conn:
            return read_preferences(conn, None, states)

    def preference_owner(self, pref_id: int) -> str:
        """The user preference `pref_id` belongs to. KeyError: no such preference."""
        with self._read() as conn:
            owner = conn.execute(sa.select(t.preferences.c.user_name)
                                 .where(t.preferences.c.position == pref_id - 1)).scalar()
        if owner is None:
            raise KeyError(pref_id)
        return str(owner)

    def save_preferences(self, prefs: Sequence[Preference], user: str = DEFAULT_USER) -> list[Preference]:
        """`user`'s preferences as `learning.preferences` left them: a known one keeps its number
        (its row is updated when it changed), a new one gets the next number. Returns them so."""
        with self._write() as conn:
            return self._save_preferences(conn, prefs, user)

    def update_preferences(self, change: Callable[[list[Preference]], list[Preference]],
                           user: str = DEFAULT_USER) -> list[Preference]:
        """Read `user`'s preferences, `change` them (a pure function of the list) and write the
        result, in one transaction that no other writer interleaves with (SQLite: BEGIN IMMEDIATE;
        PostgreSQL: the table locked), so concurrent hearings, confirmations and forgets never
        lose one another nor give two preferences one number. Returns the list written."""
        with self._write() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("LOCK TABLE preferences IN SHARE ROW EXCLUSIVE MODE"))
            return self._save_preferences(conn, change(list(read_preferences(conn, user))), user)

    def set_preference_state(self, pref_id: int, state: PreferenceState, version: int | None = None,
                             user: str = DEFAULT_USER) -> Preference:
        """Set preference `pref_id`'s state as the gate decides it: "learned" (the weights of
        `version` alone keep it: its instruction is no longer served) or back to "applied" (a
        later version lost it: it is served again). KeyError: `user` has no such preference."""
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

        out = self.update_preferences(change, user)
        return out[_index(out, pref_id)]

    def forget_preference(self, pref_id: int, user: str = DEFAULT_USER) -> Preference:
        """`user` drops their preference `pref_id`: its instruction stops (state "dropped"; its
        samples: `drop_preference_samples`). KeyError: `user` has no such preference."""

        def change(prefs: list[Preference]) -> list[Preference]:
            at, now = _index(prefs, pref_id), utcnow()
            prefs[at] = replace(prefs[at], state="dropped", state_at=now, dropped_at=now, confirmed=False)
            return prefs

        out = self.update_preferences(change, user)
        return out[_index(out, pref_id)]

    def drop_preference_samples(self, pref_id: int, user: str = DEFAULT_USER) -> int:
        """The samples of the turns whose hint counted for preference `pref_id` and that are not
        trained yet are dropped, with the reason; returns how many. Run it where no training step
        is under way (the learner's lock): a step commits its batch as trained all or nothing."""
        known = self.preferences(user)
        p = known[_index(known, pref_id)]
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

    def _save_preferences(self, conn: sa.Connection, prefs: Sequence[Preference], user: str) -> list[Preference]:
        """A preference whose number is one of `user`'s stored ones updates its row; any other is
        new and gets the next number of all (`learning.preferences.merge` numbers a new one only
        within the one user's list it is given)."""
        p = t.preferences.c
        stored = {q.id: _row(q) for q in read_preferences(conn, user)}
        nxt = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(p.position), -1))).scalar_one()) + 1
        now, out = utcnow(), []
        for pref in prefs:
            row = _row(pref)
            if pref.id not in stored:
                conn.execute(t.preferences.insert().values(position=nxt, user_name=user, **row, updated_at=now))
                pref, nxt = replace(pref, id=nxt + 1), nxt + 1
            elif stored[pref.id] != row:
                conn.execute(t.preferences.update().where(p.position == pref.id - 1).values(**row, updated_at=now))
            out.append(replace(pref, user=user))
        return out


def _index(prefs: Sequence[Preference], pref_id: int) -> int:
    at = next((i for i, p in enumerate(prefs) if p.id == pref_id), None)
    if at is None:
        raise KeyError(pref_id)
    return at
