"""The learning loop beside the server: the collector and the trainer as two background tasks
that never block serving (docs/how-it-works.md).

The composition root (`clawbridge.server`) builds the parts (judges, teacher, collector,
episodes, trainer, gate) once and binds them here; it also wires the learner to the proxy: the
`POST /v1/feedback` and `POST /v1/admin/rollback` routes (`clawbridge.routes`), a wake-up on
every next state, and the status-line and metrics fields. A rollback and a training step share
one lock: neither runs while the other does.

Two events, no polling where one exists: `wake` (a next state, feedback or an episode outcome
arrived: the one channel from capture to the learner) starts the collector's quick pass (judge,
hear) and, unless one runs, its settle pass; `ready` (the collector settled samples) makes the
trainer look for a batch. The passes also run on a timer (`poll_s`), which is their clock for
what no event announces: episodes expiring and samples kept pending by a judge that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clawbridge.backends.costs import BudgetExceeded
from clawbridge.config import Settings
from clawbridge.judges import Judges
from clawbridge.learning.collector import Collector
from clawbridge.learning.episodes import EpisodeLearner
from clawbridge.learning.gate import GateDecision, GateProbe
from clawbridge.learning.promotion import Promotion, RollbackResult
from clawbridge.learning.trainer import StepResult, Trainer
from clawbridge.protocol import BackendError, UnknownVersion
from clawbridge.store.records import DEFAULT_USER

if TYPE_CHECKING:
    from clawbridge.backends.base import Backend
    from clawbridge.learning.lineages import UserLineages
    from clawbridge.store import Preference, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearningParts:
    """What the composition root builds for the learner (`clawbridge.server.build_learning`)."""

    judges: Judges
    collector: Collector
    episodes: EpisodeLearner  # SDK groups: outcome rewards (learning.episodes)
    trainer: Trainer  # the default user's (a single-user install's only one)
    lineages: UserLineages | None = None  # every user's own (None: one adapter for everyone)


class Learner:
    def __init__(self, settings: Settings, *, poll_s: float = 1.0, probes: Sequence[GateProbe] = ()) -> None:
        self.settings = settings
        self.extra_probes = list(probes)  # the caller's own gate probes (the demo: a validation split)
        self.poll_s = poll_s  # the collector's clock (expiry, retries) and the pause after a failed step
        self.wake = asyncio.Event()  # a next state arrived, feedback came, or an episode ended
        self.ready = asyncio.Event()  # the collector settled samples: a batch may be full
        self.parts: LearningParts | None = None
        self.judge_name = settings.judging.kind
        self.errors = 0
        self.training_stopped: str | None = None  # why training stopped (the budget)
        self.paused: str | None = None  # why training steps wait (the page: POST /ui/api/training)
        self.lock = asyncio.Lock()  # a training step or a rollback, never both
        self.last_rollback: RollbackResult | None = None
        # several proxies on one store: why this process may not publish now (another holds the
        # trainer lease: `learning.lease.Coordinator.elsewhere`); None: it may
        self.elsewhere: Callable[[], str | None] = lambda: None
        # told the preferences whenever the collector's hearing changed them (the composition
        # root serves the applied ones at once)
        self.on_preferences: Callable[[str, Sequence[Preference]], None] | None = None
        self.settling = self.preparing = False  # a settle pass, the gate's references being asked
        self.last_user: str | None = None  # whose lineage the newest step trained

    def bind(self, parts: LearningParts) -> None:
        self.parts = parts

    @property
    def collector(self) -> Collector | None:
        return self.parts.collector if self.parts is not None else None

    @property
    def episodes(self) -> EpisodeLearner | None:
        return self.parts.episodes if self.parts is not None else None

    @property
    def trainer(self) -> Trainer | None:
        return self.parts.trainer if self.parts is not None else None

    async def rollback(self, backend: Backend, store: Store, version: int, user: str | None = None) -> RollbackResult:
        """Serve `version`'s weights again as a new version (the route's work), in the lineage of
        the user whose version it is (`user`: whose lineage v0 begins again; the default user's
        when none is named). Works before the background task has bound the trainer, too: the
        lock is the learner's."""
        if (why := self.elsewhere()) is not None:
            raise BackendError(why)
        lineages = self.parts.lineages if self.parts is not None else None
        if lineages is not None:
            row = await store.run(store.policy_version, version) if version else None
            owner = row.user if row is not None else (user or DEFAULT_USER)
            if user is not None and owner != lineages.name_of(user):
                raise UnknownVersion(version, lineages.get(user).backend.newest,
                                     f"policy@v{version} is not one of {user}'s versions")
            promotion = lineages.trainer(lineages.get(owner)).promotion
        else:
            promotion = (self.trainer.promotion if self.trainer is not None
                         else Promotion(self.settings.training, backend, store, lock=self.lock))
        self.last_rollback = await promotion.rollback(version)
        return self.last_rollback

    async def run(self) -> None:
        """The background task: collect and train until cancelled; the judges' clients are closed
        however it ends. Cancelled mid-judging, mid-scoring or mid-step, it loses nothing: the
        store holds every turn, and a sample becomes `trained` only in the step's commit."""
        if self.parts is None:
            raise RuntimeError("Learner.run before bind: the composition root builds the parts")
        try:
            # the newest version serves since before the first request (`server.serve`); what
            # a restart interrupted of the gate's work is settled first
            await self.parts.trainer.promotion.recover()
            for trainer in self.trainers()[1:]:  # each other user's gate work, settled the same way
                await trainer.promotion.recover()
            await asyncio.gather(self._collect_loop(self.parts), self._train_loop(self.parts.trainer))
        finally:
            await self.parts.judges.aclose()

    async def _collect_loop(self, parts: LearningParts) -> None:
        """On every wake-up the collector's quick pass (judge, hear: the preference now); beside
        it, one settle pass at a time (the teacher, the rewrites: the engine's background work,
        which the user's requests hold back), so a user's correction is heard while the engine
        is busy with the user."""
        settling: asyncio.Task[int] | None = None
        try:
            while True:
                self.wake.clear()  # before the passes: a wake-up during them runs more
                await self._pass(parts.collector.judge_once(), "judging")
                if settling is None:
                    settling = asyncio.create_task(self._pass(self._settle(parts), "collector"))
                woken = asyncio.create_task(self.wake.wait())
                try:
                    await asyncio.wait({woken, settling}, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                if not settling.done():
                    continue  # woken (or the clock): judge what came while the settle pass runs
                settled, settling = settling.result(), None
                if settled:
                    self.ready.set()
                elif not self.wake.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), self.poll_s)
        finally:
            if settling is not None:
                settling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await settling

    async def _settle(self, parts: LearningParts) -> int:
        self.settling = True
        try:
            return await parts.collector.run_once() + await parts.episodes.run_once()
        finally:
            self.settling = False

    async def _prepare(self, trainer: Trainer) -> None:
        self.preparing = True
        try:
            await trainer.promotion.prepare()
        finally:
            self.preparing = False

    def trainers(self) -> list[Trainer]:
        """Every lineage's trainer, the default user's first (`learning.lineages`)."""
        if self.parts is None:
            return []
        lineages = self.parts.lineages
        if lineages is None:
            return [self.parts.trainer]
        return [self.parts.trainer, *(lineages.trainer(x) for user, x in sorted(lineages.by_user.items())
                                      if x is not lineages.default)]

    async def step_once(self) -> StepResult | None:
        """One step of the lineage whose turn it is (`UserLineages.waiting`: the one trained
        longest ago first, so no user's backlog starves another's); None when no lineage has a
        full batch."""
        assert self.parts is not None
        lineages = self.parts.lineages
        if lineages is None:
            return await self.parts.trainer.step_once()
        for lineage in await lineages.waiting(self.settings.training.method):
            result = await lineages.trainer(lineage).step_once()
            if result is not None:
                lineages.turn(lineage)
                self.last_user = lineage.user
                return result
        return None

    def busy(self) -> list[str]:
        """What the learner does on the engine now: "training", "judging" (a step and its gate),
        "gate references" (v0 and the twin asked while a batch fills), "settling" (the teacher
        and the rewrites); empty when it waits."""
        doing = next((t.doing for t in self.trainers() if t.doing), None)
        return [name for name, on in (("training", doing == "training"), ("judging", doing == "judging"),
                                      ("gate references", self.preparing), ("settling", self.settling)) if on]

    async def _pass(self, work: Awaitable[int | None], what: str) -> int:
        """`work`'s count (0 for work that counts nothing); a failure is counted and logged, and
        the next pass retries."""
        try:
            return await work or 0
        except asyncio.CancelledError:
            raise
        except Exception:
            self.errors += 1
            log.exception("%s pass failed; retrying", what)
            return 0

    async def _train_loop(self, trainer: Trainer) -> None:
        """A step whenever a batch is full; while none is, the gate's references are asked
        (`Promotion.prepare`, one at a time: the step's gate reuses what it asked)."""
        preparing: asyncio.Task[int] | None = None
        try:
            while True:
                self.ready.clear()  # before the look: samples settled during the step wake the next
                if self.paused:  # judging goes on; a resume sets `ready`
                    await self.ready.wait()
                    continue
                try:
                    if await self.step_once() is not None:
                        continue
                except asyncio.CancelledError:
                    raise
                except BudgetExceeded as e:  # serving goes on; judged samples wait for a new budget
                    self.training_stopped = str(e)
                    log.warning("%s", e)
                    return
                except Exception:
                    self.errors += 1
                    log.exception("training step failed; the samples stay judged and are retried")
                    await asyncio.sleep(self.poll_s)
                    continue
                if preparing is None or preparing.done():
                    preparing = asyncio.create_task(self._pass(self._prepare(trainer), "the gate's references"))
                await self.ready.wait()
        finally:
            if preparing is not None:
                preparing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await preparing

    @property
    def last_step(self) -> StepResult | None:
        """The newest step of any lineage."""
        return max((t.last for t in self.trainers() if t.last is not None), key=lambda r: r.step, default=None)

    def status(self) -> dict[str, Any]:
        """Fields for `/v1/status` and the status line (judge, judged, samples, step, reward)."""
        out: dict[str, Any] = {"judge": self.judge_name, "method": self.settings.training.method}
        if busy := self.busy():
            out["busy"] = ", ".join(busy)
        if self.training_stopped:
            out["training_stopped"] = self.training_stopped
        if self.paused:
            out["paused"] = self.paused
        if self.collector is not None:
            st = self.collector.stats
            out.update(judged=st.judged, samples=st.samples, dropped=st.dropped)
            if st.mean_reward is not None:
                out["mean reward"] = f"{st.mean_reward:+.2f}"
        if self.episodes is not None and (ep := self.episodes.stats).groups_trained + ep.groups_dropped:
            out["groups"] = f"{ep.groups_trained} trained, {ep.groups_dropped} dropped"
        if (last := self.last_step) is not None:
            out["step"] = last.step
        if self.trainer is not None and self.trainer.promotion.decisions:
            d = self.trainer.promotion.decisions[-1]
            out["gate"] = f"v{d.candidate} {d.decision}"
            if (priced := self._priced()) is not None:
                f = priced.figures
                out["price"] = (f"{f['price_points']:.0f} pts of general answers "
                                f"(v0 {f['probe_v0']:.0%}, asked {f['probe_twin']:.0%})")
        if (rb := self.last_rollback) is not None:
            out["rollback"] = f"v{rb.version} = v{rb.restored}"
        if self.errors:
            out["learner errors"] = self.errors
        return out

    def lineage_status(self, user: str) -> dict[str, Any]:
        """One user's own adapter as its user's page shows it: its newest step and gate decision."""
        lineages = self.parts.lineages if self.parts is not None else None
        lineage = lineages.by_user.get(lineages.name_of(user)) if lineages is not None else None
        trainer = self.trainer if lineages is None else lineage.trainer if lineage is not None else None
        out: dict[str, Any] = {}
        if trainer is None:
            return out
        if trainer.last is not None:
            out["step"] = trainer.last.step
        if trainer.promotion.decisions:
            d = trainer.promotion.decisions[-1]
            out["gate"] = f"v{d.candidate} {d.decision}"
        return out

    def _priced(self) -> GateDecision | None:
        """The newest gate decision that measured the price of the preferences."""
        decisions = self.trainer.promotion.decisions if self.trainer is not None else []
        return next((d for d in reversed(decisions) if "price_points" in d.figures), None)

    def metrics(self) -> dict[str, float]:
        """Gauges for /metrics: judging and sample counts, and the last training step's metrics."""
        out: dict[str, float] = {"learner_errors": self.errors,
                                 "training_stopped": 1.0 if self.training_stopped else 0.0}
        if self.collector is not None:
            st = self.collector.stats
            out.update(learner_judged=st.judged, learner_samples=st.samples, learner_dropped=st.dropped)
            if st.mean_reward is not None:
                out["learner_mean_reward"] = st.mean_reward
        if self.episodes is not None:
            ep = self.episodes.stats
            out.update(episode_groups_trained=ep.groups_trained, episode_groups_dropped=ep.groups_dropped,
                       episodes_expired=ep.episodes_expired, episode_samples=ep.samples)
        if self.trainer is not None:
            every = [d for t in self.trainers() for d in t.promotion.decisions]  # every user's adapter's
            out["gate_accepted"] = float(sum(d.decision == "accepted" for d in every))
            out["gate_rejected"] = float(sum(d.decision == "rejected" for d in every))
            decisions = self.trainer.promotion.decisions  # the last one's figures: the default user's
            if decisions:
                out["gate_last_candidate"] = float(decisions[-1].candidate)
                out["gate_last_accepted"] = 1.0 if decisions[-1].decision == "accepted" else 0.0
                for name in ("probe_candidate", "probe_twin"):  # the last candidate's general probe, and its twin's
                    if isinstance(value := decisions[-1].figures.get(name), int | float):
                        out[f"gate_{name}"] = float(value)
            if (priced := self._priced()) is not None:
                out["preferences_price_points"] = priced.figures["price_points"]
                out["preferences_probe_plain"] = priced.figures["probe_v0"]
                out["preferences_probe_asked"] = priced.figures["probe_twin"]
        if (last := self.last_step) is not None:
            out["train_step"] = last.step
            out["train_samples"] = last.samples
            for key, value in last.metrics.items():
                if isinstance(value, int | float):
                    out[f"train_{key}"] = float(value)
        return out
