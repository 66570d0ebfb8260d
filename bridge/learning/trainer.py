"""The trainer: a recipe, not a framework (docs/design.md#the-loop, #the-backend-protocol).

    drop stale samples (with the reason) ─► take B judged samples ─► their datums
    (`distillation`) ─► backend.train_step ─► backend.publish: a candidate, v+1
    ─► ONE store transaction: the step, its samples judged → trained, the candidate
    ─► the candidate's promotion (`promotion`): the version that serves next (with a gate, the
       serving version keeps serving until the gate has judged the candidate; without one the
       candidate serves at once)
    ─► every N steps: backend.save_state, remembered in the store for `--resume`

A crash before the store commit leaves the samples `judged`: they are trained again after the
restart, and the weights of that step were lost with the process too (the backend resumes from
its last checkpoint), so no sample is ever trained twice into the same weights.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from clawbridge.config import TrainingSettings
from clawbridge.judges import Teacher
from clawbridge.learning.baking import Retirement
from clawbridge.learning.distillation import Distillation, to_datums
from clawbridge.learning.gate import Gate
from clawbridge.learning.promotion import (
    OptimizerAge,
    Promotion,
    Resumed,
    checkpoint,
    history_of,
    next_step_number,
)
from clawbridge.protocol import Backend, BackendError, Screens, TransientBackendError
from clawbridge.store import PolicyVersionRow, Sample, Store, TrainingStep
from clawbridge.types import Datum, OptimSpec, StepMetrics

log = logging.getLogger(__name__)

PERMANENT_FAILURES = 3  # a batch refused this many times in a row by a permanent error is dropped


def warmed(optim: OptimSpec, k: int, warmup_steps: int) -> OptimSpec:
    """The optimizer of the k-th step (1-based) since the optimizer was fresh (pure): the rate
    ramps up linearly over `warmup_steps`. Adam's first step moves every parameter by the full
    rate, the sign of its gradient whatever the gradient's size (its moments know nothing yet), so
    a first step at the full rate is the largest and the noisiest of a run."""
    if warmup_steps <= 0 or k >= warmup_steps:
        return optim
    return replace(optim, learning_rate=optim.learning_rate * max(k, 1) / warmup_steps)


def oldest_fresh(served: Sequence[int], max_staleness: int) -> int:
    """The oldest version whose samples still train (pure): the one that served `max_staleness`
    servings before the newest of `served` (oldest first); 0 while fewer have served."""
    return served[-1 - max_staleness] if len(served) > max_staleness else 0


def step_record(metrics: StepMetrics, batch: Sequence[Sample]) -> dict[str, float]:
    """The metrics stored with a step (pure)."""
    rewards = [s.reward for s in batch if s.reward is not None]
    advantages = [a for s in batch for a in (s.advantages or ())]
    return {
        "loss": metrics.loss,
        "clip_fraction": metrics.clip_fraction,
        "approx_kl": metrics.approx_kl,
        "grad_norm": metrics.grad_norm,
        "tokens": float(metrics.tokens),
        "samples": float(metrics.samples),
        "seconds": metrics.seconds,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "mean_advantage": sum(advantages) / len(advantages) if advantages else 0.0,
        "hinted": float(sum(1 for s in batch if s.hint)),
        "rewrites": float(sum(1 for s in batch if s.rewrite is not None)),
        **metrics.extra,
    }


@dataclass(frozen=True)
class StepResult:
    step: int
    version: int
    samples: int
    metrics: dict[str, float]
    served: int | None = None  # the version serving after the step (the gate may hold `version` back)


class Trainer:
    def __init__(
        self, settings: TrainingSettings, backend: Backend, store: Store, *,
        lock: asyncio.Lock | None = None, gate: Gate | None = None, teacher: Teacher | None = None,
        resumed: Resumed | None = None, retirement: Retirement | None = None, redraw_max_tokens: int = 0,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self.lock = lock or asyncio.Lock()  # one of: a step (train_step + publish + record), a rollback
        self.distillation = Distillation(settings, backend, store, teacher, redraw_max_tokens)
        # the warmup's clock: a checkpoint `resume` loaded brought the optimizer's moments back
        self.optimizer = OptimizerAge(settings.warmup_steps if resumed is not None and resumed.optimizer else 0)
        self.promotion = Promotion(settings, backend, store, lock=self.lock, gate=gate, optimizer=self.optimizer,
                                   retirement=retirement)
        self.dropped_stale = 0
        self.dropped_untrainable = 0
        self._failures: dict[tuple[int, ...], int] = {}  # batch -> permanent train_step failures in a row
        self.last: StepResult | None = None  # the newest step this process trained
        self.doing: str | None = None  # "training" or "judging" while a step runs (`/v1/status`)

    async def step_once(self) -> StepResult | None:
        """Train one step if a full batch is waiting; None otherwise."""
        async with self.lock:
            return await self._step()

    async def _step(self) -> StepResult | None:
        s, store, backend = self.settings, self.store, self.backend
        oldest = await self._oldest_fresh(s.max_staleness)
        self.dropped_stale += await store.run(store.drop_stale_samples, oldest)
        batch = await self._batch()
        if len(batch) < s.batch_size:
            return None
        step = await next_step_number(store)
        before = backend.version  # the served version (held, while training goes on from a held-back candidate)
        self.promotion.pin(before)  # the candidate is published but not served until it passes
        self.doing = "training"
        try:
            optim = warmed(s.optim, self.optimizer.steps + 1, s.warmup_steps)
            # one request per sample: the engine batches the fresh draws of the whole batch together
            datums = [d for row in await asyncio.gather(*(self.distillation.datums(x) for x in batch)) for d in row]
            metrics = await self._train_step(batch, datums, optim)
            policy = await backend.publish()
            record = step_record(metrics, batch)
            await store.commit_step(  # waits out a store that is down: the step is published
                TrainingStep(step=step, version_before=before, version_after=policy.version, metrics=record),
                [x.id for x in batch],
                PolicyVersionRow(
                    version=policy.version, path=policy.path, step=step,
                    mean_reward=record["mean_reward"], samples=len(batch),
                ),
            )
            self.doing = "judging"
            served = await self.promotion.promote(batch, policy.version, before)
        finally:
            self.doing = None
            self.promotion.release()
        log.info(
            "step %d: %d samples, loss %.4f, mean reward %+.2f -> policy@v%d%s",
            step, len(batch), metrics.loss, record["mean_reward"], policy.version,
            "" if served == policy.version else f" (unjudged; v{served} serves)" if self.promotion.unjudged
            else f" (held back by the gate; v{served} serves)",
        )
        if step % s.checkpoint_every == 0 and self.promotion.held is None:  # a held lineage is never a resume point
            await checkpoint(backend, store, step, served)
        self.last = StepResult(step, policy.version, len(batch), record, served)
        return self.last

    async def _oldest_fresh(self, max_staleness: int) -> int:
        """The oldest version whose samples still train. Staleness counts the versions that
        served since a sample's (`History.served`), so a backlog drawn by the serving version
        stays fresh however many candidates were trained on it unjudged or held back, and when
        one of them begins serving. Without a gate every version serves. Only this lineage's
        versions count (the store is one user's: `lineages.UserStore`)."""
        serving = self.backend.version
        if self.promotion.gate is None:  # this lineage's versions (another user's never make these stale)
            return oldest_fresh([v.version for v in await self.store.run(self.store.versions) if v.version <= serving],
                                max_staleness)
        return oldest_fresh((await history_of(self.store)).served(serving), max_staleness)

    async def _batch(self) -> list[Sample]:
        """The oldest `batch_size` judged samples. A sample the backend can never train (a greedy
        turn on a temperature-1-only platform) leaves the queue with its reason, instead of
        failing the same oldest batch for ever."""
        store = self.store
        untrainable = self.backend.untrainable if isinstance(self.backend, Screens) else None
        while True:
            batch = await store.run(store.pending_samples, self.settings.batch_size, method=self.settings.method)
            unfit = {x.id: why for x in batch if untrainable and (why := next(filter(None, map(untrainable, to_datums(x))), None))}
            if not unfit:
                return batch
            for sid, why in unfit.items():
                await store.run(store.mark_samples, [sid], "dropped", why)
            self.dropped_untrainable += len(unfit)
            log.info("dropped %d sample(s) the %s backend cannot train: %s", len(unfit), self.backend.name,
                     next(iter(unfit.values())))

    async def _train_step(self, batch: Sequence[Sample], datums: list[Datum], optim: OptimSpec) -> StepMetrics:
        """backend.train_step; a batch refused PERMANENT_FAILURES times in a row by a permanent
        error (not a transient one: those are retried for ever) is dropped with the error as its
        reason, so a sample that can never train never blocks the queue."""
        key = tuple(x.id for x in batch)
        try:
            metrics = await self.backend.train_step(datums, self.settings.loss, optim)
        except TransientBackendError:
            raise
        except BackendError as e:
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            if failures >= PERMANENT_FAILURES:
                reason = f"train_step failed {failures} times: {e}"[:500]
                await self.store.run(self.store.mark_samples, list(key), "dropped", reason)
                self._failures.pop(key, None)
                log.error("dropped a batch of %d samples: %s", len(key), reason)
            raise
        self._failures.clear()
        self.optimizer.steps += 1
        return replace(metrics, extra={**metrics.extra, "learning_rate": optim.learning_rate})
