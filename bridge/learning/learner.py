"""The learning loop beside the server: the collector and the trainer as two background tasks
that never block serving (DESIGN.md §1).

The composition root (`clawbridge.server`) wires it to the proxy: the `POST /v1/feedback` and
`POST /v1/admin/rollback` routes (`clawbridge.routes`), a wake-up on every next state, and the
status-line and metrics fields. The learner binds to the live backend and store when its
background task starts. A rollback and a training step share one lock: neither runs while the
other does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from clawbridge.backends.costs import BudgetExceeded
from clawbridge.config import Settings
from clawbridge.judges import build_judges, judge_kind
from clawbridge.judges.pairwise import PairwiseJudge
from clawbridge.learning.collector import Collector
from clawbridge.learning.episodes import EpisodeLearner
from clawbridge.learning.gate import Gate, GateProbe, probe_check
from clawbridge.learning.probes import Probe, general_probes
from clawbridge.learning.trainer import RollbackResult, StepResult, Trainer
from clawbridge.types import SamplingParams

if TYPE_CHECKING:
    from clawbridge.protocol import Backend
    from clawbridge.store import Store

log = logging.getLogger(__name__)


class Learner:
    def __init__(self, settings: Settings, *, poll_s: float = 1.0, probes: Sequence[GateProbe] = ()) -> None:
        self.settings = settings
        self.extra_probes = list(probes)  # the caller's own gate probes (the demo: a validation split)
        self.poll_s = poll_s
        self.wake = asyncio.Event()  # a next state arrived, feedback came, or samples are ready
        self.collector: Collector | None = None
        self.episodes: EpisodeLearner | None = None  # SDK groups: outcome rewards (learning.episodes)
        self.trainer: Trainer | None = None
        self.judge_name = judge_kind(settings)
        self.errors = 0
        self.training_stopped: str | None = None  # why training stopped (the budget)
        self.lock = asyncio.Lock()  # a training step or a rollback, never both
        self.last_rollback: RollbackResult | None = None

    def bind(self, backend: Backend, store: Store) -> None:
        teacher = None
        if self.settings.hint_selection == "overlap":
            # the hint judge ranks its candidates by the hinted teacher's agreement with the
            # student's own tokens (judges/teacher.py), scored on this backend
            from clawbridge.chat.renderer import Renderer
            from clawbridge.judges.teacher import Teacher

            teacher = Teacher(backend, Renderer(backend.tokenizer()), model=self.settings.teacher,
                              clip=self.settings.opd_clip)
        judges = build_judges(self.settings, backend, teacher=teacher)
        self.collector = Collector(self.settings, backend, store, judges)
        self.episodes = EpisodeLearner(self.settings, backend, store, judges)
        client = getattr(judges.reward, "client", None)  # a judge model (the rules judge has none)
        pairwise = PairwiseJudge(client, seed=self.settings.seed) if client is not None else None
        self.trainer = Trainer(self.settings, backend, store, lock=self.lock,
                               gate=self.build_gate(backend, pairwise))

    def build_gate(self, backend: Backend, pairwise: PairwiseJudge | None = None) -> Gate | None:
        """The gate the settings ask for: a spread of the general probe set plus the caller's
        probes, and with a judge model the user's recent prompts compared pairwise (the offline
        rules judge cannot compare two answers)."""
        s = self.settings
        if s.gate == "off":
            return None
        from clawbridge.chat.renderer import Renderer

        pool = general_probes()
        k = min(s.gate_probes, len(pool))
        chosen = [pool[(i * len(pool)) // k] for i in range(k)] if k else []
        rest = [p for p in pool if p not in chosen][: max(0, min(s.gate_probes_max, len(pool)) - k)]

        def ask(qs: list[Probe]) -> list[GateProbe]:
            return [GateProbe("probe", ({"role": "user", "content": p.question},), probe_check(p.check.answered))
                    for p in qs]

        probes = ask(chosen) + self.extra_probes
        if s.gate_recent == 0:
            pairwise = None
        if not probes and pairwise is None:
            return None
        params = SamplingParams(max_tokens=s.gate_max_tokens, temperature=s.gate_temperature, seed=s.seed)
        return Gate(backend, Renderer(backend.tokenizer()), probes, params=params, samples=s.gate_samples,
                    margin=s.gate_margin, alpha=s.gate_alpha, alpha_base=s.gate_alpha_base,
                    non_inferiority=s.gate_v0_test == "non_inferiority", pairwise=pairwise,
                    reserve=ask(rest))

    async def rollback(self, backend: Backend, store: Store, version: int) -> RollbackResult:
        """Serve `version`'s weights again as a new version (the route's work). Works before the
        background task has bound the trainer, too: the lock is the learner's."""
        trainer = self.trainer or Trainer(self.settings, backend, store, lock=self.lock)
        self.last_rollback = await trainer.rollback(version)
        return self.last_rollback

    async def run(self, backend: Backend, store: Store) -> None:
        """The background task: collect and train until cancelled."""
        self.bind(backend, store)
        assert self.trainer is not None
        # the trainer resumed before serving began (`server.serve`: the newest version serves);
        # a candidate the gate never decided on (a restart mid-gate) is judged first
        await self.trainer.judge_pending()
        await asyncio.gather(self._collect_loop(), self._train_loop())

    async def _collect_loop(self) -> None:
        assert self.collector is not None and self.episodes is not None
        while True:
            try:
                if await self.collector.run_once() + await self.episodes.run_once():
                    self.wake.set()
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:
                self.errors += 1
                log.exception("collector pass failed; retrying")
            await self._sleep()

    async def _train_loop(self) -> None:
        assert self.trainer is not None
        while True:
            try:
                if await self.trainer.step_once() is not None:
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

    async def _sleep(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), self.poll_s)
        self.wake.clear()

    @property
    def last_step(self) -> StepResult | None:
        return self.trainer.last if self.trainer is not None else None

    def status(self) -> dict[str, Any]:
        """Fields for `/v1/status` and the status line (judge, judged, samples, step, reward)."""
        out: dict[str, Any] = {"judge": self.judge_name, "method": self.settings.method}
        if self.training_stopped:
            out["training_stopped"] = self.training_stopped
        if self.collector is not None:
            st = self.collector.stats
            out.update(judged=st.judged, samples=st.samples, dropped=st.dropped)
            if st.mean_reward is not None:
                out["mean reward"] = f"{st.mean_reward:+.2f}"
        if self.episodes is not None and (ep := self.episodes.stats).groups_trained + ep.groups_dropped:
            out["groups"] = f"{ep.groups_trained} trained, {ep.groups_dropped} dropped"
        if (last := self.last_step) is not None:
            out["step"] = last.step
        if self.trainer is not None and self.trainer.decisions:
            d = self.trainer.decisions[-1]
            out["gate"] = f"v{d.candidate} {d.decision}"
        if (rb := self.last_rollback) is not None:
            out["rollback"] = f"v{rb.version} = v{rb.restored}"
        if self.errors:
            out["learner errors"] = self.errors
        return out


    def metrics(self) -> dict[str, float]:
        """Gauges for /metrics: judging and sample counts, and the last training step's metrics."""
        out: dict[str, float] = {"learner_errors": self.errors,
                                 "training_stopped": 1.0 if self.training_stopped else 0.0}
        if self.collector is not None:
            st = self.collector.stats
            out.update(learner_judged=st.judged, learner_samples=st.samples, learner_dropped=st.dropped)
        if self.episodes is not None:
            ep = self.episodes.stats
            out.update(episode_groups_trained=ep.groups_trained, episode_groups_dropped=ep.groups_dropped,
                       episodes_expired=ep.episodes_expired, episode_samples=ep.samples)
            if st.mean_reward is not None:
                out["learner_mean_reward"] = st.mean_reward
        if self.trainer is not None:
            decisions = self.trainer.decisions
            out["gate_accepted"] = float(sum(d.decision == "accepted" for d in decisions))
            out["gate_rejected"] = float(sum(d.decision == "rejected" for d in decisions))
            if decisions:
                out["gate_last_candidate"] = float(decisions[-1].candidate)
                out["gate_last_accepted"] = 1.0 if decisions[-1].decision == "accepted" else 0.0
        if (last := self.last_step) is not None:
            out["train_step"] = last.step
            out["train_samples"] = last.samples
            for key, value in last.metrics.items():
                if isinstance(value, int | float):
                    out[f"train_{key}"] = float(value)
        return out
