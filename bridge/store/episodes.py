"""Groups and episodes (docs/design.md#methods, "Episodes"): n attempts at one task, each ending in an
outcome reward.

    group   open ──► closed (no more outcomes expected) ──► trained | dropped (with the reason)
    episode open ──► scored (outcome given) | expired (no outcome in time, or the group closed)

An episode's turns are the main, trainable turns of its session; an episode made from one choice
of an `n > 1` request is that one turn. The learning loop settles a group once none of its
episodes is open: the rows say what happened to every attempt, never silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from clawbridge.store import schema as t
from clawbridge.store.base import StoreBase, StoreError
from clawbridge.store.records import utcnow

GroupState = Literal["open", "closed", "trained", "dropped"]
EpisodeState = Literal["open", "scored", "expired"]


class EpisodeError(StoreError):
    """An outcome or a group change the episode's state does not allow (`status`: the HTTP
    status an API answers it with)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class EpisodeRow:
    id: str
    group_id: str
    idx: int
    session_id: str
    turn_id: str | None
    state: EpisodeState
    outcome: float | None
    reason: str | None
    created_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class GroupRow:
    id: str
    task: Any
    size: int
    state: GroupState
    reason: str | None
    created_at: datetime
    updated_at: datetime
    episodes: tuple[EpisodeRow, ...] = ()


@dataclass(frozen=True, kw_only=True)
class NewEpisode:
    id: str
    session_id: str
    turn_id: str | None = None


class EpisodeStore(StoreBase):
    def open_group(self, group_id: str, episodes: Sequence[NewEpisode], task: Any = None) -> GroupRow:
        """Create a group and its episodes in one transaction; a group id already used is an
        error (409)."""
        if not episodes:
            raise EpisodeError("a group needs at least one episode", status=400)
        now = utcnow()
        with self._write() as conn:
            if conn.execute(sa.select(t.groups.c.id).where(t.groups.c.id == group_id)).first():
                raise EpisodeError(f"group {group_id} exists")
            clash = conn.execute(
                sa.select(t.episodes.c.id).where(t.episodes.c.id.in_([e.id for e in episodes]))
            ).first()
            if clash is not None:
                raise EpisodeError(f"episode {clash.id} exists")
            conn.execute(t.groups.insert().values(
                id=group_id, task=task, size=len(episodes), state="open", created_at=now, updated_at=now,
            ))
            conn.execute(t.episodes.insert(), [
                {"id": e.id, "group_id": group_id, "idx": i, "session_id": e.session_id,
                 "turn_id": e.turn_id, "state": "open", "created_at": now}
                for i, e in enumerate(episodes)
            ])
        group = self.get_group(group_id)
        assert group is not None
        return group

    def get_group(self, group_id: str) -> GroupRow | None:
        with self._read() as conn:
            row = conn.execute(sa.select(t.groups).where(t.groups.c.id == group_id)).first()
            if row is None:
                return None
            eps = conn.execute(
                sa.select(t.episodes).where(t.episodes.c.group_id == group_id).order_by(t.episodes.c.idx)
            ).all()
        return GroupRow(**row._asdict(), episodes=tuple(EpisodeRow(**e._asdict()) for e in eps))

    def get_episode(self, episode_id: str) -> EpisodeRow | None:
        """By episode id, or by the turn id of a choice of an `n > 1` request."""
        e = t.episodes.c
        with self._read() as conn:
            row = conn.execute(sa.select(t.episodes).where(e.id == episode_id)).first()
            if row is None:
                row = conn.execute(sa.select(t.episodes).where(e.turn_id == episode_id)).first()
        return None if row is None else EpisodeRow(**row._asdict())

    def episode_of_turn(self, turn_id: str, session_id: str) -> EpisodeRow | None:
        """The episode a turn belongs to (its own one-turn episode, or its session's), if any."""
        e = t.episodes.c
        with self._read() as conn:
            row = conn.execute(
                sa.select(t.episodes).where(sa.or_(
                    e.turn_id == turn_id, sa.and_(e.session_id == session_id, e.turn_id.is_(None))
                )).limit(1)
            ).first()
        return None if row is None else EpisodeRow(**row._asdict())

    def set_outcome(self, episode_id: str, outcome: float) -> EpisodeRow:
        """Score an open episode. A second outcome, or one after the episode expired, is a 409;
        an unknown episode a 404."""
        found = self.get_episode(episode_id)
        if found is None:
            raise EpisodeError(f"no episode {episode_id}", status=404)
        e = t.episodes.c
        with self._write() as conn:
            res = conn.execute(
                sa.update(t.episodes).where(e.id == found.id, e.state == "open")
                .values(state="scored", outcome=float(outcome), ended_at=utcnow())
            )
            if res.rowcount != 1:
                cur = conn.execute(sa.select(e.state, e.reason).where(e.id == found.id)).one()
                why = f" ({cur.reason})" if cur.reason else ""
                raise EpisodeError(f"episode {found.id} is {cur.state}{why}: it takes one outcome while open")
        out = self.get_episode(found.id)
        assert out is not None
        return out

    def close_group(self, group_id: str, reason: str = "the group closed before its outcome") -> GroupRow:
        """No more outcomes for this group: its open episodes expire with `reason`."""
        now = utcnow()
        with self._write() as conn:
            res = conn.execute(
                sa.update(t.groups).where(t.groups.c.id == group_id, t.groups.c.state == "open")
                .values(state="closed", updated_at=now)
            )
            if res.rowcount == 0 and not conn.execute(
                sa.select(t.groups.c.id).where(t.groups.c.id == group_id)
            ).first():
                raise EpisodeError(f"no group {group_id}", status=404)
            conn.execute(
                sa.update(t.episodes)
                .where(t.episodes.c.group_id == group_id, t.episodes.c.state == "open")
                .values(state="expired", reason=reason, ended_at=now)
            )
        group = self.get_group(group_id)
        assert group is not None
        return group

    def expire_episodes(self, created_before: datetime, reason: str) -> int:
        """Open episodes older than `created_before` expire with `reason` (the timeout)."""
        e = t.episodes.c
        with self._write() as conn:
            return int(conn.execute(
                sa.update(t.episodes).where(e.state == "open", e.created_at < created_before)
                .values(state="expired", reason=reason, ended_at=utcnow())
            ).rowcount)

    def groups_to_settle(self, limit: int = 16) -> list[GroupRow]:
        """Groups not yet settled whose episodes are all scored or expired (oldest first)."""
        g, e = t.groups.c, t.episodes.c
        open_ep = sa.exists().where(e.group_id == g.id, e.state == "open")
        with self._read() as conn:
            ids = [r.id for r in conn.execute(
                sa.select(g.id).where(g.state.in_(("open", "closed")), ~open_ep)
                .order_by(g.created_at, g.id).limit(limit)
            )]
        return [grp for i in ids if (grp := self.get_group(i)) is not None]

    def settle_group(self, group_id: str, state: Literal["trained", "dropped"], reason: str | None = None) -> None:
        with self._write() as conn:
            conn.execute(
                sa.update(t.groups).where(t.groups.c.id == group_id)
                .values(state=state, reason=reason, updated_at=utcnow())
            )
