"""What happens to a candidate once a step has published it: which version serves next
(docs/methods.md, "The gate"), and the restarts and rollbacks that change what serves.

    the preferences the user wants (heard by the collector) are what the gate's twin is asked with
    ─► where instructions are served, the candidate's review: which applied preferences its
       weights carry alone (`baking.Retirement`); it is judged, and would serve, without them
    ─► no gate: the candidate serves at once
    ─► the gate judges it against the serving version, the decision is recorded, then:
         accepted ─► it serves; its review applies (preferences learned, or applied again)
         rejected, within `gate_patience` ─► the served version keeps serving, training goes on
                                             from the candidate (a held lineage)
         rejected, patience spent ─► its blends (`gate_blend`), the first accepted serving;
                                     else a copy of the served weights serves and is trained on
    ─► a full batch already waits (`gate_every`): the candidate is trained on unjudged while the
       served version keeps serving, and the gate judges the newest once the learner catches up

A copy (`backend.rollback`) and a blend start a fresh optimizer (`OptimizerAge`: the warmup's
clock). `clawbridge rollback K` is a copy of vK, under the step's lock (no train_step or
publish interleaves with it), checkpointed at once so that `--resume` continues from the
rolled-back weights rather than from a checkpoint of the weights rolled away from.

At every start `resume` serves the newest version the store recorded, and the learner's trainer
goes on from what it loaded. A restart that interrupted the gate (`interrupted`, the one place
that decides it: a candidate never judged, or a held lineage) pins the version that served then
(`pin_interrupted`, before the first request) until the learner's `Promotion.recover` has
settled it.

The records (gate decisions and standing preferences in the store's history tables, the resume
point in its meta) are read and written only by the small functions at the top of this module;
a copy or a blend is recorded with its version (`copy_of`, `blend_of`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from clawbridge.config import TrainingSettings
from clawbridge.learning import baking, preferences
from clawbridge.learning.gate import Asked, Gate, GateDecision, Recent
from clawbridge.protocol import Backend, Blends, Restorable
from clawbridge.store import GateRecord, History, PolicyVersionRow, Sample, Store
from clawbridge.types import PolicyVersion

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "trainer.checkpoint"  # store meta: the latest resumable state


# --- the records ----------------------------------------------------------------------------------

async def history_of(store: Store) -> History:
    """The gate's decisions, the versions' origins and the standing preferences (typed tables)."""
    return await store.run(store.history)


async def record_decision(store: Store, decision: GateDecision) -> None:
    await store.run(store.record_gate_decision, GateRecord.of(decision.record()))


async def resume_point(store: Store) -> dict[str, Any] | None:
    """The latest checkpoint: {"path", "step", "version"}; None before the first."""
    ck: dict[str, Any] | None = await store.run(store.get_meta, CHECKPOINT_KEY)
    return ck


async def checkpoint(backend: Backend, store: Store, step: int, version: int, name: str | None = None) -> str:
    """backend.save_state, remembered in the store as the resume point."""
    path = await backend.save_state(name or f"step-{step:06d}")
    await store.run(store.set_meta, CHECKPOINT_KEY, {"path": path, "step": step, "version": version})
    return path


# --- reading the records (pure) -----------------------------------------------------------------

def blend_name(of: int, alpha: float) -> str:
    """How a blend the gate served is named to the user (`clawbridge versions`, the demo)."""
    return f"v{of}'s delta x {alpha:g}"


# --- standing preferences -----------------------------------------------------------------------

async def what_was_asked(store: Store, *, served: bool) -> Asked:
    """What the users asked for, as the gate asks it: the twin with every applied or learned
    preference the collector heard; the serving version and the candidate with the instructions
    served now (None when no instruction is served: `instant_preferences` off; a candidate's own
    is narrowed by its `Review`). Every user's together: one adapter serves them all, so its
    candidate is judged against what each of them wants (a single user's are exactly that user's)."""
    known = await store.run(store.all_preferences, ("applied", "learned"))
    now = preferences.instruction([p for p in known if p.state == "applied" and preferences.refusal(p) is None])
    now = now if served else None
    return Asked(preferences.wanted_instruction(known), now, now)


# --- restarts -----------------------------------------------------------------------------------

@dataclass
class OptimizerAge:
    """Steps trained since the optimizer was fresh: the warmup's clock. A new run, a resume from
    published weights, a copy and a blend start a fresh optimizer; a checkpoint brings the
    moments back with the weights."""

    steps: int = 0


@dataclass(frozen=True)
class Resumed:
    loaded: str  # a checkpoint's path, or the published weights (`policy@vK` without a path)
    optimizer: bool  # the optimizer's moments came back too (a checkpoint); False: a fresh optimizer


async def resume(backend: Backend, store: Store) -> Resumed | None:
    """At every start: serve the newest version the store recorded and train on from it,
    whatever the checkpoint cadence (versions are append-only: a restart never serves an
    older one, nor numbers a new one like an old one).

    - The latest checkpoint is of that version: it is loaded, weights and optimizer state
      exactly.
    - The newest version is newer than the last checkpoint (a kill between a step's commit
      and its checkpoint, or `checkpoint_every` > 1): its published weights are loaded with a
      fresh optimizer (Adam's moments restart; `backend.restore`), so no committed update is
      lost. A backend without `restore` falls back to the checkpoint, with a warning.

    Returns what was loaded; None on a fresh store. The learner's trainer is built with it."""
    newest = await store.run(store.latest_version)
    ck = await resume_point(store)
    if ck and (newest is None or int(ck["version"]) >= newest.version):
        await backend.load_state(ck["path"])
        log.info("resumed from %s (step %s, policy@v%s)", ck["path"], ck["step"], ck["version"])
        return Resumed(str(ck["path"]), optimizer=True)
    if newest is None or newest.version == 0:
        return None
    if not isinstance(backend, Restorable):
        log.warning("the %s backend cannot load published weights: resuming from the last checkpoint "
                    "(policy@v%s), older than the newest version v%d", backend.name,
                    ck["version"] if ck else 0, newest.version)
        if ck:
            await backend.load_state(ck["path"])
            return Resumed(str(ck["path"]), optimizer=True)
        return None
    await backend.restore(newest.version, newest.path)
    log.info("resumed from policy@v%d's published weights (%s) with a fresh optimizer%s", newest.version,
             newest.path, f"; the last checkpoint is of v{ck['version']}" if ck else "")
    return Resumed(newest.path or f"policy@v{newest.version}", optimizer=False)


@dataclass(frozen=True)
class Interrupted:
    """A restart found the gate's work unfinished: `candidate`, the newest version, either never
    judged (`decided` False: the process died while the gate was at work) or held back while
    training went on from it (`decided` True, `gate_patience`). `serving` served meanwhile."""

    candidate: int
    serving: int
    decided: bool


async def interrupted(store: Store, *, gated: bool) -> Interrupted | None:
    """What a restart must settle before training goes on; None: nothing. `gated`: a gate will
    judge (a candidate never judged counts only then)."""
    newest = await store.run(store.latest_version)
    if newest is None or newest.step is None:  # a rollback's copy (no step), or v0
        return None
    last = (await history_of(store)).decision(newest.version)
    if gated and last is None:
        steps = await store.run(store.training_steps)
        step = next((st for st in reversed(steps) if st.version_after == newest.version), None)
        return None if step is None else Interrupted(newest.version, step.version_before, decided=False)
    if last is None or last.decision != "rejected":
        return None
    return Interrupted(newest.version, last.serving, decided=True)


async def pin_interrupted(backend: Backend, store: Store) -> Interrupted | None:
    """Before the first request after a restart: the version that served while the gate's work
    was interrupted serves again, until `Promotion.recover` has settled it."""
    found = await interrupted(store, gated=True)
    if found is not None:
        backend.serve(found.serving)
    return found


async def next_step_number(store: Store) -> int:
    """One numbering of every user's steps."""
    return await store.run(store.next_step)


# --- promotion ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RollbackResult:
    version: int  # the new version, serving `restored`'s weights
    restored: int
    previous: int  # the version that served until the rollback
    path: str | None
    checkpoint: str


class Promotion:
    """Which version serves after each step; the held lineage (`gate_patience`) and the
    decisions of this process. Every method runs under the trainer's lock."""

    def __init__(self, settings: TrainingSettings, backend: Backend, store: Store, *, lock: asyncio.Lock,
                 gate: Gate | None = None, optimizer: OptimizerAge | None = None,
                 retirement: baking.Retirement | None = None) -> None:
        self.settings = settings
        # what retires an applied preference's instruction; None: no instruction is served
        # (`instant_preferences` off), so the gate asks the candidate plain and nothing retires
        self.retirement = retirement
        self.backend = backend
        self.store = store
        self.lock = lock
        # With a gate, the backend keeps serving the current version while the gate judges the
        # candidate; without one every publish serves at once.
        self.gate = gate
        self.optimizer = optimizer or OptimizerAge()
        self.decisions: list[GateDecision] = []
        # the version held serving while training continues from held-back (gate_patience) or
        # unjudged (gate_every) candidates (None: the newest serves), and how many in a row of each
        self.held: int | None = None
        self.held_back_in_a_row, self.unjudged = 0, 0

    def pin(self, serving: int) -> None:
        """While a step trains and its candidate is judged, `serving` goes on serving."""
        if self.gate is not None:
            self.backend.serve(serving)

    def release(self) -> None:
        """Between steps the newest version serves (accepted, or the restored copy), unless
        training goes on from a held-back candidate: then the served version stays."""
        if self.gate is not None:
            self.backend.serve(self.held)

    async def promote(self, batch: Sequence[Sample], candidate: int, serving: int) -> int:
        """The step's candidate, just published from `batch`: returns the version that serves next.
        A full batch waiting behind it: trained on unjudged, within `gate_every` (`_defer`).
        Where instructions are served, each version the gate judges is first reviewed
        (`_review`): the applied preferences its weights carry alone are left out of its
        instruction, so the gate judges it as it would be served (a candidate that learned a
        preference, asked for it again on top, answers worse than either); what serves applies it."""
        s = self.settings
        if (self.gate is not None and self.unjudged + 1 < s.gate_every
                and len(await self.store.run(self.store.pending_samples, s.batch_size, method=s.method)) >= s.batch_size):
            return self._defer(candidate, serving)
        self.unjudged = 0
        asked = await what_was_asked(self.store, served=self.retirement is not None)
        prompts = await self._prompts(batch) if self.retirement is not None else []
        if self.gate is None:
            review = await self._review(candidate, prompts)
            if review is not None:
                await self._apply(review, candidate)
            return candidate
        return await self._gate(candidate, serving, await self._recent(batch), asked, prompts)

    def _defer(self, candidate: int, serving: int) -> int:
        """`candidate` is trained on unjudged while `serving` keeps serving: the next candidate
        is a full batch away, and judging this one costs as long as the step. Not a decision:
        patience is not spent; a restart judges the newest (`interrupted`: never judged)."""
        self.unjudged += 1
        self.held = serving
        log.info("policy@v%d is trained on unjudged: a full batch waits behind it (%d of gate_every %d); "
                 "v%d keeps serving", candidate, self.unjudged, self.settings.gate_every, serving)
        return serving

    async def prepare(self) -> None:
        """What every gate needs before its candidate exists, asked while the learner waits for a
        batch: v0's and the twin's answers to the whole general probe (`Gate.general_rates`, kept
        for every candidate). In real use the first batch fills while the user talks; without this
        the first gate asked them after the step, twice the probe of the candidate itself."""
        if self.gate is None:
            return
        asked = await what_was_asked(self.store, served=self.retirement is not None)
        await self.gate.general_rates(asked.wanted if self.gate.reference == "twin" else None)

    async def _review(self, version: int, prompts: Sequence[baking.Prompt]) -> baking.Review | None:
        """What `version` (the newest weights) carries alone of each applied or learned preference,
        measured on the user's prompts (`baking.Retirement`); None: nothing measured (no
        instruction is served, no preference or no prompt), so it is judged as served now."""
        if self.retirement is None or not prompts:
            return None
        prefs = [p for p in await self.store.run(self.store.all_preferences, ("applied", "learned"))  # every user's
                 if preferences.refusal(p) is None]
        if not prefs:
            return None
        reviewed = await self.retirement.review(prompts, [(p.text, p.state == "learned") for p in prefs])
        return baking.review_of(version, prefs, reviewed, prompts)

    async def _apply(self, review: baking.Review, version: int) -> None:
        """`version` serves: the preferences its weights carry alone are learned (their
        instruction stops), those a learned one's weights lost are applied again."""
        now = datetime.now(UTC)
        if self.retirement is not None:  # what later candidates keep to (`baking.lost`)
            self.retirement.serves(version, review.prompts, review.measured)
        for user in review.users:  # each user's apart
            await self.store.run(self.store.update_preferences,
                                 lambda known: baking.retired(known, review.changed, version, now), user)
        for pid, learned in review.changed.items():
            log.info("preference %d %s with v%d", pid, "learned: its instruction retired" if learned
                     else "applied again: its instruction is back", version)

    async def _prompts(self, batch: Sequence[Sample]) -> list[baking.Prompt]:
        """The user's own prompts of the batch that an instruction would be served with (the last
        message the user's)."""
        out: list[baking.Prompt] = []
        for sample in batch:
            turn = await self.store.run(self.store.get_turn, sample.turn_id)
            if turn is not None and turn.messages and turn.messages[-1].get("role") == "user":
                out.append((turn.messages, turn.tools))
        return out

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

    async def _gate(self, candidate: int, serving: int, recent: Sequence[Recent] = (), asked: Asked = Asked(),
                    prompts: Sequence[baking.Prompt] = ()) -> int:
        """Judge the candidate against the serving version; returns the version that serves next.
        A rejected candidate (or a gate that failed: no evidence is no pass) is trained on from
        while `gate_patience` allows; then it is given up: first its blends (`gate_blend`), the
        first the gate accepts serving, else a copy of the serving weights, so training continues
        from what was served."""
        decision = await self._judge(candidate, serving, recent, asked, prompts)
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
        blended = await self._blends(candidate, serving, recent, asked, prompts)
        if blended is not None:
            return blended
        restored = await self._restore_served(serving)
        log.warning("gate: policy@v%d given up; v%d serves v%d's weights", candidate, restored, serving)
        return restored

    async def _judge(self, candidate: int, serving: int, recent: Sequence[Recent], asked: Asked,
                     prompts: Sequence[baking.Prompt] = ()) -> GateDecision:
        """The gate's decision on `candidate` (the newest weights) as it would be served
        (`_review`), recorded before it acts; accepted, its review applies. A candidate that
        lost a learned preference is held back without asking the probes."""
        assert self.gate is not None
        try:
            review = await self._review(candidate, prompts)
            if review is not None:
                asked = review.asked(asked)
                if asked.candidate != asked.served:
                    log.info("gate: policy@v%d is judged with the instruction it would be served with: %s",
                             candidate, "none" if asked.candidate is None else repr(asked.candidate))
            if review is not None and review.lost:
                decision = GateDecision(candidate, serving, "rejected", "; ".join(review.lost))
            else:
                decision = await self.gate.evaluate(candidate, serving, recent=recent, asked=asked)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("the gate failed on policy@v%d; holding it back", candidate)
            review, decision = None, GateDecision(candidate, serving, "rejected", f"gate failed: {type(e).__name__}: {e}")
        self.decisions.append(decision)
        await record_decision(self.store, decision)
        if decision.decision == "accepted" and review is not None:
            await self._apply(review, candidate)
        return decision

    async def _blends(self, candidate: int, serving: int, recent: Sequence[Recent], asked: Asked,
                      prompts: Sequence[baking.Prompt] = ()) -> int | None:
        """Before `candidate` is given up: its delta scaled by each `gate_blend` alpha in turn
        (`backend.blend`, a fresh optimizer), judged like any candidate; the first accepted serves
        and training goes on from it. Returns its version; None when none passed (or the backend
        cannot blend). A blend is recorded as a version only once accepted: a restart in between
        finds the held-back candidate newest and restores the served weights (`interrupted`)."""
        alphas = self.settings.gate_blend
        if not alphas:
            return None
        if not isinstance(self.backend, Blends):
            log.warning("gate_blend is set but the %s backend cannot blend weights: v%d is given up unblended",
                        self.backend.name, candidate)
            return None
        for alpha in alphas:
            policy = await self.backend.blend(candidate, alpha)
            self.optimizer.steps = 0
            decision = await self._judge(policy.version, serving, recent, asked, prompts)
            if decision.decision != "accepted":
                log.warning("gate: policy@v%d (%s) rejected (%s)", policy.version, blend_name(candidate, alpha),
                            decision.reason)
                continue
            await self.store.run(self.store.record_policy_version,
                                 PolicyVersionRow(version=policy.version, path=policy.path, samples=0,
                                                  blend_of=candidate, blend_alpha=alpha))
            log.info("gate: policy@v%d (%s) accepted (%s); training goes on from it",
                     policy.version, blend_name(candidate, alpha), decision.reason)
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
        policy = await self.backend.rollback(version)
        self.optimizer.steps = 0
        self.held, self.held_back_in_a_row, self.unjudged = None, 0, 0
        await self.store.run(self.store.record_policy_version,
                             PolicyVersionRow(version=policy.version, path=policy.path, samples=0, copy_of=version))
        return policy

    async def recover(self) -> int | None:
        """The gate's work a restart interrupted (`interrupted`), settled before training goes on,
        so no version serves ungated across a restart: a candidate never judged is judged now;
        a held lineage is given up for a copy of the served weights. The pin `pin_interrupted`
        set before the first request ends here. Returns the version that serves afterwards
        (None: nothing was interrupted)."""
        found = await interrupted(self.store, gated=True)
        if found is None:
            return None
        candidate, serving = found.candidate, found.serving
        if not found.decided and self.gate is None:
            if self.backend.version == candidate:  # nothing pinned it: the gate is off
                return None
            # the settings ask for a gate but it has nothing to ask (no probes, no judge model):
            # as without a gate, the candidate serves
            log.warning("policy@v%d was published but never judged, and the gate has nothing to ask: it serves",
                        candidate)
            self.backend.serve(None)
            return candidate
        if found.decided:
            log.warning("policy@v%d was held back by the gate and training had gone on from it (gate_patience): "
                        "a restart trains on from the served v%d's weights", candidate, serving)
            async with self.lock:
                try:
                    return await self._restore_served(serving)
                finally:
                    self.backend.serve(None)
        log.warning("policy@v%d was published but the gate never decided on it (a restart during the "
                    "gate): judging it now; v%d serves meanwhile", candidate, serving)
        async with self.lock:
            self.backend.serve(serving)
            try:
                return await self._gate(candidate, serving, asked=await what_was_asked(self.store, served=self.retirement is not None))
            finally:
                self.backend.serve(None)

    async def rollback(self, version: int) -> RollbackResult:
        """Serve `version`'s weights again, as a new version; the next step trains from them.
        Waits for a running step to finish first. UnknownVersion (a BackendError) changes
        nothing."""
        async with self.lock:
            previous = self.backend.version
            policy = await self._copy_of(version)
            if self.retirement is not None:
                self.retirement.forget_kept()
            self.backend.serve(None)  # the copy serves (a pin held for a gate's lineage ends here)
            step = await next_step_number(self.store) - 1
            path = await checkpoint(self.backend, self.store, step, policy.version, f"rollback-v{policy.version:06d}")
            log.info("rollback: policy@v%d serves policy@v%d's weights (was v%d)", policy.version, version, previous)
            return RollbackResult(policy.version, version, previous, policy.path, path)
