"""Each user's data in the store: counted (`clawbridge users`) and deleted (`clawbridge users
delete`, `DELETE /v1/admin/users/{name}`).

A user's data is their sessions (`sessions.user_name`) and everything that hangs off them: the
turns, the turns' next states, judgments and samples, the episodes of those sessions (and a group
left with no episode), and the user's preferences (`preferences.user_name`). A turn extends only
turns of its own session (`messages_base`), so deleting whole sessions never cuts another user's
chain of messages.

Samples already trained are deleted with their turns (a sample names its turn, which is gone):
the training steps keep their aggregate figures (loss, mean reward, how many samples), and the
versions those steps published keep whatever the weights learned from them. Deleting data does
not untrain the shared adapter; `Deleted.rollback_to` names the version that served before the
first step that trained one of the user's samples, which `clawbridge rollback` serves again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase
from clawbridge.store.training import TRANSITIONS


def user_sessions(user: str) -> sa.Select[Any]:
    """The ids of `user`'s sessions."""
    return sa.select(t.sessions.c.id).where(t.sessions.c.user_name == user)


def user_turns(user: str) -> sa.ColumnElement[bool]:
    """A turn is `user`'s: its session is (a turn's user is its session's)."""
    return t.turns.c.session_id.in_(user_sessions(user))


def user_turn_ids(user: str) -> sa.Select[Any]:
    """The ids of `user`'s turns, for the tables that hang off a turn (samples, judgments)."""
    return sa.select(t.turns.c.id).where(user_turns(user))


@dataclass(frozen=True)
class UserCounts:
    """How much of one user's data the store holds."""

    user: str
    sessions: int = 0
    turns: int = 0
    preferences: int = 0
    samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSITIONS, 0))  # by state


@dataclass(frozen=True)
class Deleted:
    """What deleting a user's data removed: rows per table, in the order deleted; of the samples,
    how many a training step had trained; and the version to roll back to for weights that never
    learned from them (None: none of theirs was trained)."""

    user: str
    rows: dict[str, int]
    trained: int = 0
    first_step: int | None = None
    rollback_to: int | None = None

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    def as_json(self) -> dict[str, Any]:
        return {"object": "user.deleted", "user": self.user, "deleted": self.rows, "trained_samples": self.trained,
                "first_step": self.first_step, "rollback_to": self.rollback_to,
                "rollback_command": None if self.rollback_to is None else f"clawbridge rollback {self.rollback_to}"}


class UserStore(StoreBase):
    def user_counts(self) -> list[UserCounts]:
        """Every user with a session or a preference in the store, by name."""
        se, tu, sm, pr = t.sessions.c, t.turns.c, t.samples.c, t.preferences.c
        with self._read() as conn:

            def by_user(q: sa.Select[Any]) -> dict[str, int]:
                return {u: int(n) for u, n in conn.execute(q)}

            sessions = by_user(sa.select(se.user_name, sa.func.count()).group_by(se.user_name))
            turns = by_user(sa.select(se.user_name, sa.func.count()).select_from(t.turns)
                            .join(t.sessions, se.id == tu.session_id).group_by(se.user_name))
            prefs = by_user(sa.select(pr.user_name, sa.func.count()).group_by(pr.user_name))
            samples = conn.execute(sa.select(se.user_name, sm.state, sa.func.count()).select_from(t.samples)
                                   .join(t.turns, tu.id == sm.turn_id).join(t.sessions, se.id == tu.session_id)
                                   .group_by(se.user_name, sm.state)).all()
        out = {u: UserCounts(u, sessions.get(u, 0), turns.get(u, 0), prefs.get(u, 0))
               for u in sorted(sessions.keys() | prefs.keys())}
        for user, state, n in samples:
            out[user].samples[state] = int(n)
        return list(out.values())

    def delete_user(self, user: str) -> Deleted:
        """Delete every row of `user`'s data (see the module's doc), in one transaction, children
        before parents. SQLite: the write lock is taken at BEGIN, so no other writer interleaves;
        PostgreSQL: the user's session and turn rows are locked first, so a write that names one of
        them waits, and one that commits before finds its row gone. Run it where no training step
        is under way (the learner's lock): a step commits its batch as trained all or nothing, and
        a batch that lost a sample under it would fail."""
        se, tu, sm, ep = t.sessions.c, t.turns.c, t.samples.c, t.episodes.c
        sessions = sa.select(se.id).where(se.user_name == user)
        turns = sa.select(tu.id).where(tu.session_id.in_(sessions))
        with self._write() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sessions.with_for_update()).all()
                conn.execute(turns.with_for_update()).all()
            trained = conn.execute(sa.select(sa.func.count(), sa.func.min(sm.step))
                                   .where(sm.turn_id.in_(turns), sm.state == "trained")).one()
            rollback_to = None
            if trained[1] is not None:
                rollback_to = conn.execute(sa.select(t.training_steps.c.version_before)
                                           .where(t.training_steps.c.step == trained[1])).scalar()
            groups = sa.select(ep.group_id).where(ep.session_id.in_(sessions)).distinct()
            touched = [g for (g,) in conn.execute(groups)]
            rows: dict[str, int] = {}
            for table, where in (
                (t.next_states, t.next_states.c.turn_id.in_(turns)),
                (t.judgments, t.judgments.c.turn_id.in_(turns)),
                (t.samples, sm.turn_id.in_(turns)),
                (t.episodes, ep.session_id.in_(sessions)),
                # a group of other users' episodes too keeps them; one left empty goes
                (t.groups, sa.and_(t.groups.c.id.in_(touched),
                                   ~sa.exists().where(ep.group_id == t.groups.c.id))),
                (t.turns, tu.session_id.in_(sessions)),
                (t.sessions, se.user_name == user),
                (t.preferences, t.preferences.c.user_name == user),
            ):
                rows[table.name] = int(conn.execute(sa.delete(table).where(where)).rowcount or 0)
        return Deleted(user, rows, int(trained[0]), trained[1], rollback_to)
