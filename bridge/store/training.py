"""The learning state: judgments with every vote, samples and their states (`TRANSITIONS`),
training steps and policy versions. Written by the learning loop; the sample states make "no
sample is trained twice" a property of the database."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import sqlalchemy as sa
from clawbridge.store import codec
from clawbridge.store import schema as t
from clawbridge.store.base import SampleStateError, StoreBase, StoreError, VersionReused, check_len
from clawbridge.store.records import (
    Judgment,
    PolicyVersionRow,
    Rewrite,
    Sample,
    TrainingStep,
    pack_floats,
    pack_ids,
    utcnow,
)
from clawbridge.store.writer import unavailable
from clawbridge.types import SampleState

log = logging.getLogger(__name__)


# Which states a sample may move to, and from where. `trained` and `dropped` are final: that is
# what makes "no sample is trained twice" a property of the database, not of the trainer.
TRANSITIONS: dict[str, frozenset[str]] = {
    "pending": frozenset(),
    "judged": frozenset({"pending"}),
    "trained": frozenset({"judged"}),
    "dropped": frozenset({"pending", "judged"}),
}



class TrainingStore(StoreBase):
    # --- judgments ----------------------------------------------------------------------------
    def add_judgment(self, judgment: Judgment) -> int:
        """Store a judgment with every vote. Idempotent per (turn, kind, judge): a second call
        returns the first judgment's id and changes nothing."""
        with self._write() as conn:
            ins = (
                self._insert(t.judgments)
                .values(
                    turn_id=judgment.turn_id,
                    judge=judgment.judge,
                    kind=judgment.kind,
                    votes=[asdict(v) for v in judgment.votes],
                    reward=judgment.reward,
                    hint=judgment.hint,
                    created_at=judgment.created_at,
                )
                .on_conflict_do_nothing()
                .returning(t.judgments.c.id)
            )
            new_id = conn.execute(ins).scalar()
            if new_id is not None:
                return int(new_id)
            return int(
                conn.execute(
                    sa.select(t.judgments.c.id).where(
                        t.judgments.c.turn_id == judgment.turn_id,
                        t.judgments.c.kind == judgment.kind,
                        t.judgments.c.judge == judgment.judge,
                    )
                ).scalar_one()
            )

    def judgments(self, turn_id: str) -> list[Judgment]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(t.judgments)
                .where(t.judgments.c.turn_id == turn_id)
                .order_by(t.judgments.c.id)
            ).all()
        return [codec.judgment_from_row(r) for r in rows]

    # --- samples ------------------------------------------------------------------------------
    def create_sample(
        self,
        turn_id: str,
        method: str,
        *,
        state: SampleState = "judged",
        reward: float | None = None,
        hint: str | None = None,
        teacher_logprobs: Sequence[float] | None = None,
        advantages: Sequence[float] | None = None,
        reason: str | None = None,
    ) -> tuple[int, bool]:
        """Create the turn's sample for `method`, or find the one that exists: returns
        (id, created). The policy version is the turn's."""
        if state not in ("pending", "judged", "dropped"):
            raise SampleStateError(f"a sample starts pending, judged or dropped, not {state}")
        with self._write() as conn:
            turn = conn.execute(
                sa.select(t.turns.c.version, t.turns.c.n_completion).where(t.turns.c.id == turn_id)
            ).first()
            if turn is None:
                raise StoreError(f"no turn {turn_id}")
            check_len(turn.n_completion, advantages, "advantages")
            check_len(turn.n_completion, teacher_logprobs, "teacher logprobs")
            now = utcnow()
            new_id = conn.execute(
                self._insert(t.samples)
                .values(
                    turn_id=turn_id, method=method, state=state, reason=reason, reward=reward,
                    hint=hint,
                    teacher_logprobs=codec.pack_opt(teacher_logprobs),
                    advantages=codec.pack_opt(advantages),
                    version=turn.version, created_at=now, updated_at=now,
                )
                .on_conflict_do_nothing()
                .returning(t.samples.c.id)
            ).scalar()
            if new_id is not None:
                return int(new_id), True
            old = conn.execute(
                sa.select(t.samples.c.id).where(
                    t.samples.c.turn_id == turn_id, t.samples.c.method == method
                )
            ).scalar_one()
            return int(old), False

    def set_sample_advantages(
        self,
        sample_id: int,
        advantages: Sequence[float],
        *,
        teacher_logprobs: Sequence[float] | None = None,
        reward: float | None = None,
        hint: str | None = None,
        rewrite: Rewrite | None = None,
    ) -> None:
        """Complete a pending sample (e.g. once the teacher scored it): pending -> judged. A
        hint-guided `rewrite` is stored with it, in the same write."""
        with self._write() as conn:
            n = conn.execute(
                sa.select(t.turns.c.n_completion)
                .join(t.samples, t.samples.c.turn_id == t.turns.c.id)
                .where(t.samples.c.id == sample_id)
            ).scalar()
            if n is None:
                raise StoreError(f"no sample {sample_id}")
            check_len(n, advantages, "advantages")
            check_len(n, teacher_logprobs, "teacher logprobs")
            values: dict[str, Any] = {
                "state": "judged", "advantages": pack_floats(advantages), "updated_at": utcnow()
            }
            if teacher_logprobs is not None:
                values["teacher_logprobs"] = pack_floats(teacher_logprobs)
            if reward is not None:
                values["reward"] = reward
            if hint is not None:
                values["hint"] = hint
            if rewrite is not None:
                values["rewrite_ids"] = pack_ids(rewrite.ids)
                values["rewrite_logprobs"] = pack_floats(rewrite.logprobs)
                values["rewrite_advantages"] = pack_floats(rewrite.advantages)
            res = conn.execute(
                sa.update(t.samples)
                .where(t.samples.c.id == sample_id, t.samples.c.state == "pending")
                .values(**values)
            )
            if res.rowcount != 1:
                raise SampleStateError(f"sample {sample_id} is not pending")

    def pending_samples(
        self,
        limit: int | None = None,
        *,
        method: str | None = None,
        state: SampleState = "judged",
        user: str | None = None,
    ) -> list[Sample]:
        """Samples waiting for the trainer (state `judged`: advantages ready), oldest first;
        `user`'s only if given. `state="pending"` lists those still waiting for their advantages."""
        s = t.samples
        q = (
            sa.select(
                s,
                t.turns.c.prompt_ids,
                t.turns.c.completion_ids,
                t.turns.c.logprobs,
                t.turns.c.sampling,
            )
            .join(t.turns, t.turns.c.id == s.c.turn_id)
            .where(s.c.state == state)
            .order_by(s.c.id)
        )
        if method is not None:
            q = q.where(s.c.method == method)
        if user is not None:
            q = q.where(s.c.turn_id.in_(turns_of(user)))
        if limit is not None:
            q = q.limit(limit)
        with self._read() as conn:
            return [codec.sample_from_row(r) for r in conn.execute(q)]

    def users_with_samples(self, method: str | None = None) -> list[str]:
        """The users who have judged samples waiting for the trainer (of `method` if given)."""
        s = t.samples
        q = (sa.select(t.sessions.c.user_name).distinct()
             .select_from(s.join(t.turns, t.turns.c.id == s.c.turn_id).join(t.sessions, t.sessions.c.id == t.turns.c.session_id))
             .where(s.c.state == "judged"))
        if method is not None:
            q = q.where(s.c.method == method)
        with self._read() as conn:
            return sorted(r[0] for r in conn.execute(q))

    def lineage_users(self) -> list[str]:
        """The users who have versions of their own (a lineage to come back to at a start)."""
        with self._read() as conn:
            return sorted(r[0] for r in conn.execute(sa.select(t.policy_versions.c.user_name).distinct()))

    def get_samples(self, ids: Sequence[int]) -> list[Sample]:
        s = t.samples
        q = (
            sa.select(
                s, t.turns.c.prompt_ids, t.turns.c.completion_ids, t.turns.c.logprobs,
                t.turns.c.sampling,
            )
            .join(t.turns, t.turns.c.id == s.c.turn_id)
            .where(s.c.id.in_(list(ids)))
            .order_by(s.c.id)
        )
        with self._read() as conn:
            return [codec.sample_from_row(r) for r in conn.execute(q)]

    def mark_samples(
        self,
        ids: Sequence[int],
        state: SampleState,
        reason: str | None = None,
        step: int | None = None,
    ) -> int:
        """Move every sample in `ids` to `state`, all or none: if any is not in a state that
        `state` may follow (see TRANSITIONS), nothing changes and SampleStateError is raised."""
        with self._write() as conn:
            return self._mark(conn, ids, state, reason, step)

    def _mark(
        self,
        conn: sa.Connection,
        ids: Sequence[int],
        state: str,
        reason: str | None,
        step: int | None,
    ) -> int:
        wanted = set(ids)
        if not wanted:
            return 0
        sources = TRANSITIONS.get(state)
        if not sources:
            raise SampleStateError(f"no sample can move to {state!r}")
        res = conn.execute(
            sa.update(t.samples)
            .where(t.samples.c.id.in_(sorted(wanted)), t.samples.c.state.in_(sorted(sources)))
            .values(state=state, reason=reason, step=step, updated_at=utcnow())
        )
        if res.rowcount != len(wanted):
            current = {
                r.id: r.state
                for r in conn.execute(
                    sa.select(t.samples.c.id, t.samples.c.state).where(
                        t.samples.c.id.in_(sorted(wanted))
                    )
                )
            }
            bad = {i: current.get(i, "missing") for i in wanted if current.get(i) not in sources}
            raise SampleStateError(f"cannot move samples to {state}: {bad}")
        return len(wanted)

    def drop_stale_samples(self, oldest_fresh: int, user: str | None = None) -> int:
        """Drop untrained samples drawn by a version older than `oldest_fresh` (the trainer's
        `oldest_fresh`: the version that served `max_staleness` servings ago), `user`'s only if
        given (each user's versions make only their own samples stale)."""
        where = [t.samples.c.state.in_(("pending", "judged")), t.samples.c.version < oldest_fresh]
        if user is not None:
            where.append(t.samples.c.turn_id.in_(turns_of(user)))
        with self._write() as conn:
            res = conn.execute(
                sa.update(t.samples).where(*where).values(state="dropped", reason="stale", updated_at=utcnow())
            )
            return int(res.rowcount)

    # --- training -----------------------------------------------------------------------------
    def record_training_step(
        self,
        step: TrainingStep,
        sample_ids: Sequence[int],
        policy: PolicyVersionRow | None = None,
    ) -> None:
        """In ONE transaction: the step row, its samples judged -> trained, and (optionally) the
        policy version it published. A crash before the commit leaves every sample judged (it
        will be trained again, as the weights of that step were never recorded either); a
        sample already trained makes the whole step fail. Either way none is trained twice."""
        with self._write() as conn:
            n = self._mark(conn, sample_ids, "trained", None, step.step)
            conn.execute(
                t.training_steps.insert().values(
                    step=step.step,
                    version_before=step.version_before,
                    version_after=step.version_after,
                    metrics=step.metrics,
                    samples=n,
                    created_at=step.created_at,
                    user_name=step.user,
                )
            )
            if policy is not None:
                self._put_version(conn, policy)

    async def commit_step(
        self, step: TrainingStep, sample_ids: Sequence[int], policy: PolicyVersionRow | None = None
    ) -> None:
        """`record_training_step`, waiting out a store that cannot take it (down, full, locked):
        the step's weights are published by then, and giving up would leave the step half
        applied (its samples judged, trained again on top of those weights). A commit whose
        acknowledgement was lost is found by its step row, so the step is recorded once."""
        wait, waiting = 0.5, False
        while True:
            try:
                if not waiting or not await self.run(self.step_recorded, step):
                    await self.run(self.record_training_step, step, sample_ids, policy)
                break
            except Exception as e:
                if not unavailable(e):
                    raise
                if not waiting:
                    log.error("the store cannot record training step %d (%s): retrying until it can",
                              step.step, e)
                    waiting = True
            await asyncio.sleep(wait)
            wait = min(wait * 2, 10.0)
        if waiting:
            log.warning("training step %d recorded: the store is back", step.step)

    def step_recorded(self, step: TrainingStep) -> bool:
        """The step's row is stored (the same step number, publishing the same version)."""
        with self._read() as conn:
            return conn.execute(
                sa.select(t.training_steps.c.step).where(
                    t.training_steps.c.step == step.step,
                    t.training_steps.c.version_after == step.version_after,
                )
            ).first() is not None

    def training_steps(self, user: str | None = None) -> list[TrainingStep]:
        """The steps trained, oldest first; `user`'s only if given."""
        q = sa.select(t.training_steps).order_by(t.training_steps.c.step)
        if user is not None:
            q = q.where(t.training_steps.c.user_name == user)
        with self._read() as conn:
            return [step_from_row(r) for r in conn.execute(q)]

    def next_step(self) -> int:
        """The number the next training step takes: one numbering for every user's steps."""
        with self._read() as conn:
            return int(conn.execute(sa.select(sa.func.max(t.training_steps.c.step))).scalar() or 0) + 1

    def record_policy_version(self, row: PolicyVersionRow) -> None:
        with self._write() as conn:
            self._put_version(conn, row)

    def _put_version(self, conn: sa.Connection, row: PolicyVersionRow) -> None:
        """Versions are append-only: the number is the primary key and a row is never updated,
        so a version number used twice fails the transaction (VersionReused) instead of
        rewriting history."""
        values = asdict(row)
        values["user_name"] = values.pop("user")
        try:
            conn.execute(t.policy_versions.insert().values(**values))
        except sa.exc.IntegrityError:  # the whole transaction (a step and its samples) rolls back
            raise VersionReused(row.version) from None

    def latest_version(self, user: str | None = None) -> PolicyVersionRow | None:
        """The newest version; of `user`'s lineage only if given (v0 begins every lineage)."""
        q = sa.select(t.policy_versions).order_by(t.policy_versions.c.version.desc()).limit(1)
        if user is not None:
            q = q.where(sa.or_(t.policy_versions.c.user_name == user, t.policy_versions.c.version == 0))
        with self._read() as conn:
            row = conn.execute(q).first()
        return None if row is None else version_from_row(row)

    def policy_version(self, version: int) -> PolicyVersionRow | None:
        with self._read() as conn:
            row = conn.execute(
                sa.select(t.policy_versions).where(t.policy_versions.c.version == version)
            ).first()
        return None if row is None else version_from_row(row)

    def versions(self, user: str | None = None) -> list[PolicyVersionRow]:
        """Every version, oldest first; `user`'s lineage only if given (v0 begins each)."""
        q = sa.select(t.policy_versions).order_by(t.policy_versions.c.version)
        if user is not None:
            q = q.where(sa.or_(t.policy_versions.c.user_name == user, t.policy_versions.c.version == 0))
        with self._read() as conn:
            return [version_from_row(r) for r in conn.execute(q)]


def turns_of(user: str) -> sa.Select[tuple[str]]:
    """The ids of `user`'s turns (through their sessions), for an IN clause."""
    return sa.select(t.turns.c.id).join(t.sessions, t.sessions.c.id == t.turns.c.session_id).where(
        t.sessions.c.user_name == user)


def version_from_row(row: sa.Row[Any]) -> PolicyVersionRow:
    values = row._asdict()
    values["user"] = values.pop("user_name")
    return PolicyVersionRow(**values)


def step_from_row(row: sa.Row[Any]) -> TrainingStep:
    values = row._asdict()
    values["user"] = values.pop("user_name")
    return TrainingStep(**values)
