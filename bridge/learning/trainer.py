"""The trainer: a recipe, not a framework (docs/design.md#the-loop, #the-backend-protocol).

    drop stale samples (with the reason) ─► take B judged samples ─► Datum per sample
    ─► backend.train_step ─► backend.publish (new requests go to v+1, in-flight ones finish on v)
    ─► ONE store transaction: the step, its samples judged → trained, the new policy version
    ─► every N steps: backend.save_state, remembered in the store for `--resume`

A crash before the store commit leaves the samples `judged`: they are trained again after the
restart, and the weights of that step were lost with the process too (the backend resumes from
its last checkpoint), so no sample is ever trained twice into the same weights.

A rollback (`clawbridge rollback K`) runs under the same lock as a step, so no train_step or
publish interleaves with it: backend.rollback(K) publishes vK's weights as v(N+1), the store
records that version (no step; `meta["policy.rollbacks"]` says which version it copies), and a
checkpoint is taken at once so that `--resume` continues from the rolled-back weights rather
than from a checkpoint of the weights rolled away from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from clawbridge.config import TrainingSettings
from clawbridge.judges import Teacher
from clawbridge.learning import preferences
from clawbridge.learning.collector import turn_context
from clawbridge.learning.gate import GATE_KEY, Gate, GateDecision, Recent
from clawbridge.learning.rewrite import Draw, redraw_params, scored
from clawbridge.protocol import (
    Backend,
    BackendError,
    Blends,
    DistillsTopK,
    Restorable,
    Screens,
    TransientBackendError,
)
from clawbridge.store import PolicyVersionRow, Sample, Store, StoredTurn, TrainingStep
from clawbridge.types import Completion, Datum, OptimSpec, PolicyVersion, StepMetrics

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "trainer.checkpoint"  # store meta: the latest resumable state
BLENDS_KEY = "policy.blends"  # store meta: {"<version>": {"of": <candidate>, "alpha": <scale>}}, accepted blends
def blend_name(of: int, alpha: float) -> str:
    """How a blend the gate served is named to the user (`clawbridge versions`, the demo)."""
    return f"v{of}'s delta x {alpha:g}"


ROLLBACKS_KEY = "policy.rollbacks"  # store meta: {"<version>": <the version it is a copy of>}
PERMANENT_FAILURES = 3  # a batch refused this many times in a row by a permanent error is dropped


def same_weights(rollbacks: dict[str, int], a: int, b: int) -> bool:
    """Whether versions `a` and `b` serve the same weights, read from the ROLLBACKS_KEY map: a gate
    rejection (or `clawbridge rollback`) publishes the serving version's weights as a new version,
    recorded as {"<new>": <copied>}, and a copy may be of a copy (pure)."""
    def origin(v: int) -> int:
        seen = set()
        while str(v) in rollbacks and v not in seen:
            seen.add(v)
            v = int(rollbacks[str(v)])
        return v

    return origin(a) == origin(b)


def to_datum(s: Sample) -> Datum:
    """The turn's own answer, exactly as sampled, with the sample's advantages."""
    if s.advantages is None:
        raise ValueError(f"sample {s.id} has no advantages yet (state {s.state})")
    return Datum(
        prompt_ids=s.prompt_ids,
        completion_ids=s.completion_ids,
        logprobs=s.logprobs,
        advantages=s.advantages,
        temperature=s.temperature,
    )


def to_datums(s: Sample, teacher_prompt_ids: Sequence[int] | None = None, *,
              distil_rewrite: bool = True) -> list[Datum]:
    """What one sample trains: the turn's answer, and its hint-guided rewrite when it has one
    (the teacher's answer under the turn's own prompt, docs/methods.md). Both in the same step,
    so a sample is trained exactly once whatever it carries. `teacher_prompt_ids` (top-k
    distillation): the answer also learns the teacher's distribution at every position, and the
    rewrite too unless `distil_rewrite` is False (`Settings.opd_topk_rewrite`)."""
    teacher = None if teacher_prompt_ids is None else tuple(teacher_prompt_ids)
    own = replace(to_datum(s), teacher_prompt_ids=teacher)
    if s.rewrite is None:
        return [own]
    # an own answer whose advantages are all zero adds no gradient, only tokens to the mean
    # (unless it is distilled)
    out = [own] if any(s.advantages or ()) or teacher is not None else []
    out.append(Datum(
        prompt_ids=s.prompt_ids, completion_ids=s.rewrite.ids, logprobs=s.rewrite.logprobs,
        advantages=s.rewrite.advantages, temperature=s.temperature,
        teacher_prompt_ids=teacher if distil_rewrite else None,
    ))
    return out


def warmed(optim: OptimSpec, k: int, warmup_steps: int) -> OptimSpec:
    """The optimizer of the k-th step (1-based) since the optimizer was fresh (pure): the rate
    ramps up linearly over `warmup_steps`. Adam's first step moves every parameter by the full
    rate, the sign of its gradient whatever the gradient's size (its moments know nothing yet), so
    a first step at the full rate is the largest and the noisiest of a run."""
    if warmup_steps <= 0 or k >= warmup_steps:
        return optim
    return replace(optim, learning_rate=optim.learning_rate * max(k, 1) / warmup_steps)


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


@dataclass(frozen=True)
class RollbackResult:
    version: int  # the new version, serving `restored`'s weights
    restored: int
    previous: int  # the version that served until the rollback
    path: str | None
    checkpoint: str


class Trainer:
    def __init__(
        self, settings: TrainingSettings, backend: Backend, store: Store, *,
        lock: asyncio.Lock | None = None, gate: Gate | None = None, teacher: Teacher | None = None,
    ) -> None:
        if settings.opd_topk > 0 and not (isinstance(backend, DistillsTopK) and backend.distills_topk):
            raise ValueError(f"opd_topk {settings.opd_topk}: the {backend.name} backend cannot distil the teacher's "
                             "top-k distribution (its loss never sees the teacher's logits); set opd_topk 0")
        if settings.opd_draws > 0 and settings.opd_topk <= 0:
            raise ValueError("opd_draws needs opd_topk > 0: fresh draws learn only the teacher's top-k distribution")
        self.settings = settings
        self.backend = backend
        self.store = store
        self.teacher = teacher if settings.opd_topk > 0 else None
        # With a gate, the backend keeps serving the current version (`serve`) while the gate
        # judges the candidate; without one every publish serves at once.
        self.gate = gate
        self.decisions: list[GateDecision] = []
        self.lock = lock or asyncio.Lock()  # one of: a step (train_step + publish + record), a rollback
        self.dropped_stale = 0
        self.dropped_untrainable = 0
        self._failures: dict[tuple[int, ...], int] = {}  # batch -> permanent train_step failures in a row
        self.last: StepResult | None = None  # the newest step this process trained
        # steps trained since the optimizer was fresh (the warmup's clock): a new run, a resume
        # from published weights, a rollback and a gate's hold-back all start a fresh optimizer
        self.fresh_steps = 0
        # gate_patience: the version held serving while training continues from held-back
        # candidates (None: the newest serves), and how many were held back in a row
        self.held: int | None = None
        self.held_back_in_a_row = 0

    async def resume(self) -> str | None:
        """At every start: serve the newest version the store recorded and train on from it,
        whatever the checkpoint cadence (versions are append-only: a restart never serves an
        older one, nor numbers a new one like an old one).

        - The latest checkpoint is of that version: it is loaded, weights and optimizer state
          exactly.
        - The newest version is newer than the last checkpoint (a kill between a step's commit
          and its checkpoint, or `checkpoint_every` > 1): its published weights are loaded with a
          fresh optimizer (Adam's moments restart; `backend.restore`), so no committed update is
          lost. A backend without `restore` falls back to the checkpoint, with a warning.

        Returns what was loaded (a path or `policy@vK`); None on a fresh store."""
        store = self.store
        newest = await store.run(store.latest_version)
        ck = await store.run(store.get_meta, CHECKPOINT_KEY)
        if ck and (newest is None or int(ck["version"]) >= newest.version):
            await self.backend.load_state(ck["path"])
            self.fresh_steps = self.settings.warmup_steps  # the optimizer's moments came back with it
            log.info("resumed from %s (step %s, policy@v%s)", ck["path"], ck["step"], ck["version"])
            return str(ck["path"])
        if newest is None or newest.version == 0:
            return None
        if not isinstance(self.backend, Restorable):
            log.warning("the %s backend cannot load published weights: resuming from the last checkpoint "
                        "(policy@v%s), older than the newest version v%d", self.backend.name,
                        ck["version"] if ck else 0, newest.version)
            if ck:
                await self.backend.load_state(ck["path"])
                self.fresh_steps = self.settings.warmup_steps
                return str(ck["path"])
            return None
        await self.backend.restore(newest.version, newest.path)
        log.info("resumed from policy@v%d's published weights (%s) with a fresh optimizer%s", newest.version,
                 newest.path, f"; the last checkpoint is of v{ck['version']}" if ck else "")
        return newest.path or f"policy@v{newest.version}"

    async def judge_pending(self) -> int | None:
        """A candidate that was recorded but never judged (the process died while the gate was
        at work) is judged now, before training goes on: no version serves ungated across a
        restart. `serve` pinned its predecessor before the first request; the pin ends here.
        Returns the version that serves afterwards (None: nothing was pending)."""
        pending = await pending_candidate(self.store) if self.gate is not None else None
        if pending is None:
            held = await held_candidate(self.store)
            if held is None:
                return None
            candidate, serving = held
            log.warning("policy@v%d was held back by the gate and training had gone on from it (gate_patience): "
                        "a restart trains on from the served v%d's weights", candidate, serving)
            async with self.lock:
                try:
                    return await self._restore_served(serving)
                finally:
                    self.backend.serve(None)
        candidate, before = pending
        log.warning("policy@v%d was published but the gate never decided on it (a restart during the "
                    "gate): judging it now; v%d serves meanwhile", candidate, before)
        async with self.lock:
            self.backend.serve(before)
            try:
                known = preferences.from_json(await self.store.run(self.store.get_meta, preferences.PREFERENCES_KEY))
                return await self._gate(candidate, before, asked=preferences.instruction(preferences.standing(known)))
            finally:
                self.backend.serve(None)

    async def next_step_number(self) -> int:
        steps = await self.store.run(self.store.training_steps)
        return (steps[-1].step if steps else 0) + 1

    async def step_once(self) -> StepResult | None:
        """Train one step if a full batch is waiting; None otherwise."""
        async with self.lock:
            return await self._step()

    async def _step(self) -> StepResult | None:
        s, store = self.settings, self.store
        self.dropped_stale += await store.run(store.drop_stale_samples, self.backend.version, s.max_staleness)
        # A sample the backend can never train (a greedy turn on a temperature-1-only platform)
        # leaves the queue with its reason, instead of failing the same oldest batch for ever.
        untrainable = self.backend.untrainable if isinstance(self.backend, Screens) else None
        while True:
            batch = await store.run(store.pending_samples, s.batch_size, method=s.method)
            unfit = {x.id: why for x in batch if untrainable and (why := next(filter(None, map(untrainable, to_datums(x))), None))}
            if not unfit:
                break
            for sid, why in unfit.items():
                await store.run(store.mark_samples, [sid], "dropped", why)
            self.dropped_untrainable += len(unfit)
            log.info("dropped %d sample(s) the %s backend cannot train: %s", len(unfit), self.backend.name,
                     next(iter(unfit.values())))
        if len(batch) < s.batch_size:
            return None
        step = await self.next_step_number()
        before = self.backend.version  # the served version (held, while training goes on from a held-back candidate)
        if self.gate is not None:
            self.backend.serve(before)  # the candidate is published but not served until it passes
        try:
            metrics = await self._train_step(batch)
            policy = await self.backend.publish()
            record = step_record(metrics, batch)
            await store.commit_step(  # waits out a store that is down: the step is published
                TrainingStep(step=step, version_before=before, version_after=policy.version, metrics=record),
                [x.id for x in batch],
                PolicyVersionRow(
                    version=policy.version, path=policy.path, step=step,
                    mean_reward=record["mean_reward"], samples=len(batch),
                ),
            )
            served = policy.version
            asked = await self._learn_preferences(batch, policy.version)
            if self.gate is not None:
                served = await self._gate(policy.version, before, await self._recent(batch), asked)
        finally:
            if self.gate is not None:
                # between steps the newest version serves (accepted, or the restored copy), unless
                # training goes on from a held-back candidate: then the served version stays
                self.backend.serve(self.held)
        log.info(
            "step %d: %d samples, loss %.4f, mean reward %+.2f -> policy@v%d%s",
            step, len(batch), metrics.loss, record["mean_reward"], policy.version,
            "" if served == policy.version else f" (held back by the gate; v{served} serves)",
        )
        if step % s.checkpoint_every == 0 and self.held is None:  # a held lineage is never a resume point
            await self.checkpoint(step, served)
        self.last = StepResult(step, policy.version, len(batch), record, served)
        return self.last

    async def _train_step(self, batch: Sequence[Sample]) -> StepMetrics:
        """backend.train_step; a batch refused PERMANENT_FAILURES times in a row by a permanent
        error (not a transient one: those are retried for ever) is dropped with the error as its
        reason, so a sample that can never train never blocks the queue."""
        s = self.settings
        key = tuple(x.id for x in batch)
        optim = warmed(s.optim, self.fresh_steps + 1, s.warmup_steps)
        # one request per sample: the engine batches the fresh draws of the whole batch together
        datums = [d for row in await asyncio.gather(*(self._datums(x) for x in batch)) for d in row]
        try:
            metrics = await self.backend.train_step(datums, s.loss, optim)
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
        self.fresh_steps += 1
        return replace(metrics, extra={**metrics.extra, "learning_rate": optim.learning_rate})

    async def _datums(self, sample: Sample) -> list[Datum]:
        """What the sample trains (`to_datums`); with top-k distillation on, a hinted sample's
        datums carry the teacher prompt, and `opd_draws` fresh answers join them."""
        if self.settings.opd_topk <= 0 or not sample.hint:
            return to_datums(sample)
        turn = await self.store.run(self.store.get_turn, sample.turn_id)
        if turn is None:
            return to_datums(sample)
        teacher = self._teacher_prompt(turn, sample.hint)
        drawn = await self._fresh_draws(sample, turn, teacher) if self.settings.opd_draws > 0 else []
        return to_datums(sample, teacher, distil_rewrite=self.settings.opd_topk_rewrite) + drawn

    def _teacher_prompt(self, turn: StoredTurn, hint: str) -> list[int]:
        """The teacher's prompt: the turn's prompt with the hint, exactly as the collector scored it."""
        if self.teacher is None:
            raise ValueError("opd_topk > 0 needs the trainer built with the teacher (build_learning does)")
        return self.teacher.prompt_ids(turn_context(turn), hint)

    async def _fresh_draws(self, sample: Sample, turn: StoredTurn, teacher_prompt_ids: Sequence[int]) -> list[Datum]:
        """`opd_draws` answers of the policy being trained (the newest published weights, which a
        gate may not be serving) to the sample's prompt at the turn's sampling settings, each to
        learn the teacher's top-k distribution alone: on-policy distillation whatever version
        the user talked to. With `opd_draw_max_lift`, only the draws the hint is against (`against`).
        Drawn for the step and not stored: a step lost in a crash draws anew."""
        params = redraw_params(turn)
        drawn = [c for c in await self.backend.sample(sample.prompt_ids, params, n=self.settings.opd_draws,
                                                      version=self.backend.newest) if c.tokens]
        if (bound := self.settings.opd_draw_max_lift) is not None:
            drawn = await self._against(drawn, sample.prompt_ids, teacher_prompt_ids, params.temperature, bound)
        zeros = lambda c: (0.0,) * len(c.tokens)  # noqa: E731
        return [Datum(sample.prompt_ids, tuple(c.tokens), tuple(c.logprobs), zeros(c), sample.temperature,
                      tuple(teacher_prompt_ids)) for c in drawn]

    async def _against(self, drawn: Sequence[Completion], prompt_ids: Sequence[int],
                       teacher_prompt_ids: Sequence[int], temperature: float, bound: float) -> list[Completion]:
        """The draws whose lift (`rewrite.Draw.lift`: the teacher's model with the hint minus
        without it, mean per token) is at most `bound` (`opd_draw_max_lift`). A draw the hint makes likelier
        already carries the preference: the teacher's distribution along it would pull a student
        that meets the preference more often than its teacher back to the teacher's rate."""
        model = self.settings.teacher
        hinted = await asyncio.gather(*(self.backend.score(teacher_prompt_ids, c.tokens, model=model,
                                                           temperature=temperature) for c in drawn))
        if any(len(lp) != len(c.tokens) for c, lp in zip(drawn, hinted, strict=True)):
            raise ValueError("the backend scored a fresh draw with the wrong number of logprobs")
        draws = [Draw(tuple(c.tokens), tuple(lp)) for c, lp in zip(drawn, hinted, strict=True)]
        # the same model without the hint, with `scored`'s check that every token got its score
        draws = await scored(self.backend, draws, range(len(draws)), prompt_ids, "plain", model=model,
                             temperature=temperature)
        lifts = [d.lift for d in draws]
        log.info("fresh draws: lifts %s, %d of %d distilled (at most %+.2f)",
                 " ".join(f"{x:+.2f}" for x in lifts), sum(x <= bound for x in lifts), len(drawn), bound)
        return [c for c, x in zip(drawn, lifts, strict=True) if x <= bound]

    async def _recent(self, batch: Sequence[Sample]) -> list[Recent]:
        """The user's own recent prompts for the gate's pairwise comparison: those of the batch."""
        if self.gate is None or self.gate.pairwise is None:
            return []
        out: list[Recent] = []
        for sample in batch[: self.settings.gate_recent]:
            turn = await self.store.run(self.store.get_turn, sample.turn_id)
            if turn is not None:
                out.append((sample.prompt_ids, turn.messages))
        return out

    async def _learn_preferences(self, batch: Sequence[Sample], version: int) -> str | None:
        """Add the hints trained into `version` to the standing preferences (store meta); returns
        the twin's instruction: what the user has asked for so far (None: nothing yet)."""
        store = self.store
        known = preferences.from_json(await store.run(store.get_meta, preferences.PREFERENCES_KEY))
        hints = []
        for x in batch:
            if x.hint:
                turn = await store.run(store.get_turn, x.turn_id)
                asked = [m for m in turn.messages if m.get("role") == "user"] if turn is not None else []
                content = asked[-1].get("content") if asked else None
                hints.append((preferences.general(x.hint, content if isinstance(content, str) else None), x.turn_id))
        if hints:
            known = preferences.merge(known, hints, version)
            await store.run(store.set_meta, preferences.PREFERENCES_KEY, preferences.to_json(known))
        return preferences.instruction(preferences.standing(known))

    async def _gate(self, candidate: int, serving: int, recent: Sequence[Recent] = (), asked: str | None = None) -> int:
        """Judge the candidate against the serving version; returns the version that serves next.
        A rejected candidate (or a gate that failed: no evidence is no pass) is trained on from
        while `gate_patience` allows; then it is given up: first its blends (`gate_blend`), the
        first the gate accepts serving, else a copy of the serving weights, so training continues
        from what was served."""
        decision = await self._judge(candidate, serving, recent, asked)
        if decision.decision == "accepted":
            log.info("gate: policy@v%d accepted (%s)", candidate, decision.reason)
            self.held, self.held_back_in_a_row = None, 0
            return candidate
        self.held_back_in_a_row += 1
        if self.held_back_in_a_row <= self.settings.gate_patience:
            self.held = serving
            log.warning("gate: policy@v%d rejected (%s); v%d keeps serving and training goes on from v%d "
                        "(%d of gate_patience %d held back in a row)", candidate, decision.reason, serving,
                        candidate, self.held_back_in_a_row, self.settings.gate_patience)
            return serving
        log.warning("gate: policy@v%d rejected (%s)", candidate, decision.reason)
        blended = await self._blends(candidate, serving, recent, asked)
        if blended is not None:
            return blended
        restored = await self._restore_served(serving)
        log.warning("gate: policy@v%d given up; v%d serves v%d's weights", candidate, restored, serving)
        return restored

    async def _judge(self, candidate: int, serving: int, recent: Sequence[Recent], asked: str | None) -> GateDecision:
        """The gate's decision on `candidate`, recorded (store meta GATE_KEY) before it acts."""
        assert self.gate is not None
        try:
            decision = await self.gate.evaluate(candidate, serving, recent=recent, asked=asked)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("the gate failed on policy@v%d; holding it back", candidate)
            decision = GateDecision(candidate, serving, "rejected", f"gate failed: {type(e).__name__}: {e}")
        self.decisions.append(decision)
        store = self.store
        records = list(await store.run(store.get_meta, GATE_KEY) or [])
        records.append(decision.record())
        await store.run(store.set_meta, GATE_KEY, records[-500:])
        return decision

    async def _blends(self, candidate: int, serving: int, recent: Sequence[Recent], asked: str | None) -> int | None:
        """Before `candidate` is given up: its delta scaled by each `gate_blend` alpha in turn
        (`backend.blend`, a fresh optimizer), judged like any candidate; the first accepted serves
        and training goes on from it. Returns its version; None when none passed (or the backend
        cannot blend). A blend is recorded as a version only once accepted: a restart in between
        finds the held-back candidate newest and restores the served weights (`held_candidate`)."""
        alphas = self.settings.gate_blend
        if not alphas:
            return None
        if not isinstance(self.backend, Blends):
            log.warning("gate_blend is set but the %s backend cannot blend weights: v%d is given up unblended",
                        self.backend.name, candidate)
            return None
        store = self.store
        for alpha in alphas:
            policy = await self.backend.blend(candidate, alpha)
            self.fresh_steps = 0
            decision = await self._judge(policy.version, serving, recent, asked)
            if decision.decision != "accepted":
                log.warning("gate: policy@v%d (v%d's delta x %g) rejected (%s)", policy.version, candidate,
                            alpha, decision.reason)
                continue
            blends = dict(await store.run(store.get_meta, BLENDS_KEY) or {})
            blends[str(policy.version)] = {"of": candidate, "alpha": alpha}
            await store.run(store.set_meta, BLENDS_KEY, blends)
            await store.run(store.record_policy_version,
                            PolicyVersionRow(version=policy.version, path=policy.path, samples=0))
            log.info("gate: policy@v%d (v%d's delta x %g) accepted (%s); training goes on from it",
                     policy.version, candidate, alpha, decision.reason)
            self.held, self.held_back_in_a_row = None, 0
            return policy.version
        return None

    async def _restore_served(self, serving: int) -> int:
        """Publish the served version's weights as a new version (a copy, with a fresh optimizer)
        and train on from it; returns the new version."""
        restored = await self._copy_of(serving)
        if self.gate is not None:
            self.gate.alias(restored.version, serving)
        return restored.version

    async def _copy_of(self, version: int) -> PolicyVersion:
        """backend.rollback(version) (its weights published as a new version, a fresh optimizer),
        recorded in the store with what it copies; training goes on from it, and a lineage held
        back by the gate (gate_patience) is given up."""
        store = self.store
        policy = await self.backend.rollback(version)
        self.fresh_steps = 0
        self.held, self.held_back_in_a_row = None, 0
        await store.run(store.record_policy_version,
                        PolicyVersionRow(version=policy.version, path=policy.path, samples=0))
        rollbacks = dict(await store.run(store.get_meta, ROLLBACKS_KEY) or {})
        rollbacks[str(policy.version)] = version
        await store.run(store.set_meta, ROLLBACKS_KEY, rollbacks)
        return policy

    async def rollback(self, version: int) -> RollbackResult:
        """Serve `version`'s weights again, as a new version; the next step trains from them.
        Waits for a running step to finish first. UnknownVersion (a BackendError) changes
        nothing."""
        async with self.lock:
            previous = self.backend.version
            policy = await self._copy_of(version)
            self.backend.serve(None)  # the copy serves (a pin held for a gate's lineage ends here)
            step = await self.next_step_number() - 1
            path = await self.checkpoint(step, policy.version, f"rollback-v{policy.version:06d}")
            log.info("rollback: policy@v%d serves policy@v%d's weights (was v%d)", policy.version, version, previous)
            return RollbackResult(policy.version, version, previous, policy.path, path)

    async def checkpoint(self, step: int, version: int, name: str | None = None) -> str:
        path = await self.backend.save_state(name or f"step-{step:06d}")
        await self.store.run(
            self.store.set_meta, CHECKPOINT_KEY, {"path": path, "step": step, "version": version}
        )
        return path


async def held_candidate(store: Store) -> tuple[int, int] | None:
    """(candidate, the version that served while it was judged) when the newest recorded version
    is a candidate the gate held back and no copy of the served weights followed it: training had
    gone on from it (`gate_patience`). None otherwise."""
    newest = await store.run(store.latest_version)
    if newest is None or newest.step is None:
        return None
    decisions = await store.run(store.get_meta, GATE_KEY) or []
    last = next((d for d in reversed(decisions) if int(d["version"]) == newest.version), None)
    if last is None or last.get("decision") != "rejected":
        return None
    return newest.version, int(last["serving"])


async def pending_candidate(store: Store) -> tuple[int, int] | None:
    """(candidate, the version it was trained from) when the newest recorded version came from a
    training step and the gate has no decision on it; None otherwise. A rollback's copy (no step)
    or v0 is never pending."""
    newest = await store.run(store.latest_version)
    if newest is None or newest.step is None:
        return None
    decided = {int(r["version"]) for r in await store.run(store.get_meta, GATE_KEY) or []}
    if newest.version in decided:
        return None
    steps = await store.run(store.training_steps)
    step = next((st for st in reversed(steps) if st.version_after == newest.version), None)
    return None if step is None else (newest.version, step.version_before)
