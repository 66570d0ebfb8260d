"""The collector: judged turns become training samples (docs/design.md#the-loop, #judges, #methods).

    turn with a next state ──► sample `pending` (one per turn and method, created first)
                          ──► judges (only the kinds still missing) ──► judgments stored
                          ──► the hint heard as the user's preference (learning.preferences)
                          ──► teacher logprobs: backend.score on the hint-augmented prompt
                          ──► (rewrites > 0) the teacher's own answer as a demonstration
                          ──► advantages ──► sample `judged` (or `dropped`, with the reason)

Two paces (`Learner`'s collect loop): the quick pass (`judge_once`) opens, judges and hears each
new turn on every wake-up and asks nothing of the engine, so a preference applies at the user's
next request; the settle pass (`run_once`) does the engine's part (teacher scores, rewrites) at the
engine's background priority, however far behind the user's requests keep it.

The store is the source of truth, so a crash anywhere resumes exactly: the sample row exists
before any judge is called, a judgment is stored once per (turn, kind, judge) and read back
instead of judging again, and a `pending` sample is finished on the next pass. Explicit feedback
(`POST /v1/feedback`) is a judgment of kind `feedback`; it outranks the judges for the reward,
and its hint outranks theirs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from clawbridge.config import LearningSettings
from clawbridge.judges import HintJudgment as JudgeHint
from clawbridge.judges import Judges, Teacher, TurnContext
from clawbridge.judges import Judgment as JudgeReward
from clawbridge.learning import preferences
from clawbridge.learning.advantages import Advantages, anchored, sample_advantages, scale_negatives
from clawbridge.learning.baking import student_view
from clawbridge.learning.rewrite import write_rewrite
from clawbridge.protocol import Backend
from clawbridge.store import (
    JudgeVote,
    Judgment,
    Preference,
    Rewrite,
    Sample,
    SampleStateError,
    Store,
    StoredTurn,
)
from clawbridge.store.records import utcnow
from clawbridge.types import Method

log = logging.getLogger(__name__)

FEEDBACK = "feedback"
SETTLE_AT_ONCE = 8  # samples settled concurrently in one pass (`Collector.run_once`)


def judge_kinds(method: Method) -> tuple[str, ...]:
    """The judgment kinds a method needs: binary a reward, opd a hint, combine both. The one
    place that says so: the judges run the kinds they are asked for (`Judges.run`)."""
    return {"binary": ("prm",), "opd": ("hint",), "combine": ("prm", "hint")}[method]


@dataclass(frozen=True)
class Signal:
    """What the judgments of one turn say, whichever judge said it."""

    reward: float
    hint: str | None
    source: str  # "judge", "feedback", "feedback+judge"


def combine_signal(judgments: Sequence[Judgment]) -> Signal:
    """Explicit feedback first, then the judges (pure). A missing reward counts as 0."""
    fb = next((j for j in judgments if j.kind == FEEDBACK), None)
    prm = next((j for j in judgments if j.kind == "prm"), None)
    hint_j = next((j for j in judgments if j.kind == "hint"), None)
    reward = fb.reward if fb is not None and fb.reward is not None else None
    hint = fb.hint if fb is not None and fb.hint else None
    used_judge = False
    if reward is None and prm is not None and prm.reward is not None:
        reward, used_judge = prm.reward, True
    if hint is None and hint_j is not None and hint_j.hint:
        hint, used_judge = hint_j.hint, True
    source = "judge" if fb is None else ("feedback+judge" if used_judge else "feedback")
    return Signal(float(reward or 0.0), hint, source)


def _reward_record(turn_id: str, j: JudgeReward) -> Judgment:
    votes = tuple(JudgeVote(raw=v.raw_text, value=v.value, error=v.error) for v in j.votes)
    return Judgment(turn_id=turn_id, judge=j.judge, kind="prm", votes=votes, reward=float(j.reward))


def _hint_record(turn_id: str, h: JudgeHint) -> Judgment:
    votes = tuple(JudgeVote(raw=v.raw_text, value=v.hint, error=v.error) for v in h.votes)
    return Judgment(turn_id=turn_id, judge=h.judge, kind="hint", votes=votes, hint=h.hint)


def turn_context(turn: StoredTurn) -> TurnContext:
    """What the judges and the teacher see of a turn; the completion's ids, logprobs and
    temperature are what the teacher scores (OPD, and ranking hints: `hint_selection = overlap`)."""
    return TurnContext(
        messages=turn.messages, response=turn.response, next_state=turn.next_state or [],
        tools=turn.tools, completion_ids=tuple(turn.completion_ids), logprobs=tuple(turn.logprobs),
        temperature=turn.sampling.temperature, instruction=turn.instruction,
    )


@dataclass
class _TurnLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # callers holding or awaiting it: the last one out forgets it


@dataclass
class CollectorStats:
    judged: int = 0
    samples: int = 0
    dropped: int = 0
    failures: int = 0
    rewards: list[float] = field(default_factory=list)

    @property
    def mean_reward(self) -> float | None:
        recent = self.rewards[-64:]
        return sum(recent) / len(recent) if recent else None


def asked_of(turn: StoredTurn) -> str | None:
    """The turn's own question: its last user message's text."""
    asked = [m for m in turn.messages if m.get("role") == "user"]
    content = asked[-1].get("content") if asked else None
    return content if isinstance(content, str) else None


class Collector:
    def __init__(
        self, settings: LearningSettings, backend: Backend, store: Store, judges: Judges, teacher: Teacher, *,
        method: Method, on_preferences: Callable[[str, Sequence[Preference]], None] | None = None,
        distils_topk: bool = False, backend_of: Callable[[str], Backend] | None = None,
    ) -> None:
        self.settings = settings
        # a user's own lineage (`learning.lineages`): "policy" scores of their turns are their
        # adapter's, never another user's; None: one adapter for everyone
        self.backend_of: Callable[[str], Backend] = backend_of or (lambda _user: backend)
        # the trainer distils the teacher's top-k distribution on a taught sample's tokens
        # (`opd_topk`): a turn served under an instruction then trains even with no advantage
        self.distils_topk = distils_topk
        self.method = method
        self.backend = backend
        self.store = store
        self.judges = judges
        self.teacher = teacher  # OPD's hinted scoring, shared with the hint judge's ranking
        self.stats = CollectorStats()
        # told a user's preferences whenever a hearing changed them (the proxy's served instruction)
        self.on_preferences = on_preferences
        self._judging: dict[str, _TurnLock] = {}  # one judging of a turn at a time (both passes judge)

    async def hear(self, turn: StoredTurn, hint: str) -> Preference | None:
        """The user's correction heard: the hint (less what quotes the turn's question) counts for
        the preference of the turn's user that says it, once per turn (`preferences.merge` skips a
        turn heard before, so a sample settled again after a crash hears nothing twice); read,
        merged and written in one store transaction. Another user's preferences are never read:
        their hearings never count for this user's. Returns the preference it counted for (None:
        it said nothing)."""
        text = preferences.unquoted(hint, asked_of(turn))
        if not text:
            return None
        version, user = self.backend_of(turn.user).version, turn.user
        before = await self.store.run(self.store.preferences, user)
        after = await self.store.run(
            self.store.update_preferences, lambda known: preferences.merge(known, [(text, turn.id)], version, utcnow()),
            user)
        if self.on_preferences is not None and tuple(after) != before:
            self.on_preferences(user, after)
        return next((p for p in after if turn.id in p.turns), None)

    async def judge_once(self, limit: int = 32) -> int:
        """The quick pass: for each newly judgeable turn, open its sample (`pending`), run its
        judges and hear its hint. No engine work, so it keeps pace with the user: the settle pass
        (`run_once`) finishes the samples it opened, reading the judgments back. Returns how
        many turns it judged."""
        store = self.store
        turns = await store.run(store.turns_awaiting_judgment, judge_kinds(self.method), limit)
        for turn in turns:
            sid, created = await store.run(store.create_sample, turn.id, self.method, state="pending")
            pending = created or (await store.run(store.get_samples, [sid]))[0].state == "pending"
            signal = combine_signal(await self._judged(turn))
            if pending and signal.hint is not None:
                await self.hear(turn, signal.hint)
        return len(turns)

    async def run_once(self, limit: int = 32) -> int:
        """One pass: finish pending samples (a restart, or explicit feedback), then open
        samples for newly judgeable turns. Returns how many samples were settled.

        Samples are opened one by one (their ids keep the turns' order) and settled up to
        SETTLE_AT_ONCE at a time: each is its own judges, teacher scores and rewrite draws, and
        the backend batches the concurrent requests (one turn at a time left the engine decoding
        that turn's few rewrite draws alone)."""
        store = self.store
        pending = await store.run(store.pending_samples, limit, method=self.method, state="pending")
        jobs: list[Callable[[], Awaitable[int]]] = [partial(self._settle_pending, s) for s in pending]
        in_pass = {s.id for s in pending}
        turns = await store.run(store.turns_awaiting_judgment, judge_kinds(self.method), limit)
        for turn in turns:
            sid, created = await store.run(store.create_sample, turn.id, self.method, state="pending")
            if sid in in_pass:  # its pending sample is already in this pass (judged half-way before)
                continue
            if not created and (await store.run(store.get_samples, [sid]))[0].state != "pending":
                # settled earlier from explicit feedback alone; record the judges' view only
                await self._judged(turn)
                continue
            jobs.append(partial(self._settle, sid, turn))
        at_once = asyncio.Semaphore(SETTLE_AT_ONCE)

        async def one(job: Callable[[], Awaitable[int]]) -> int:
            async with at_once:
                return await job()

        return sum(await asyncio.gather(*map(one, jobs)))

    async def _settle_pending(self, s: Sample) -> int:
        turn = await self.store.run(self.store.get_turn, s.turn_id)
        if turn is None:  # pragma: no cover - a sample always has its turn (foreign key)
            return 0
        return await self._settle(s.id, turn)

    async def _settle(self, sample_id: int, turn: StoredTurn) -> int:
        try:
            await self._settle_one(sample_id, turn)
            return 1
        except asyncio.CancelledError:
            raise
        except SampleStateError as e:
            # the sample left the queue while it was judged (dropped as stale when a new version
            # began serving, or with a preference the user dropped): nothing to settle
            log.info("the sample of turn %s left the queue while it was judged: %s", turn.id, e)
            return 0
        except Exception:
            # judge endpoint down, backend busy...: the sample stays pending, retried next pass
            self.stats.failures += 1
            log.exception("could not settle the sample of turn %s (kept pending)", turn.id)
            return 0

    async def _settle_one(self, sample_id: int, turn: StoredTurn) -> None:
        store = self.store
        signal = combine_signal(await self._judged(turn))
        if signal.hint is not None:
            heard = await self.hear(turn, signal.hint)
            if heard is not None and heard.state == "dropped":  # the user dropped it: its samples never train
                await store.run(store.mark_samples, [sample_id], "dropped", f"the user dropped preference {heard.id}")
                self.stats.dropped += 1
                return
        self.stats.judged += 1
        self.stats.rewards.append(signal.reward)
        # a turn served under the applied preferences trains from the student's view (`baking`):
        # the prompt without the instruction, its logprobs re-scored there; its teacher is asked
        # with the instruction, so the turn distils it whether or not the user corrected it
        backend = self.backend_of(turn.user)  # the user's own adapter scores their turn
        turn = await student_view(turn, self.teacher.renderer, backend)
        teacher_lp: list[float] | None = None
        if (signal.hint is not None or turn.instruction) and self.method != "binary":
            teacher_lp = await self.teacher.logprobs(self.context(turn), signal.hint, backend=backend)
        advantages = sample_advantages(
            self.method, signal.reward, teacher_lp is not None, teacher_lp, turn.logprobs,
            w_opd=self.settings.w_opd, w_rl=self.settings.w_rl, clip=self.settings.opd_clip,
        )
        if advantages is not None and self.settings.w_negative != 1.0:
            advantages = scale_negatives(advantages, self.settings.w_negative)
        rewrite = None
        if teacher_lp is not None and self.settings.rewrites > 0 and signal.hint is not None:
            rewrite = await write_rewrite(
                backend, self.teacher.renderer, turn, signal.hint, samples=self.settings.rewrites,
                weight=self.settings.w_rewrite, teacher=self.teacher.model, rule=self.settings.rewrite_pick,
                min_relevance=self.settings.rewrite_min_relevance, min_lift=self.settings.rewrite_min_lift,
                max_tokens=self.settings.redraw_max_tokens,
            )
        if rewrite is None and (advantages is None or not any(advantages)) and not (turn.instruction and self.distils_topk):
            reason = (f"no signal ({signal.source}: reward {signal.reward:+g}, no hint)" if advantages is None
                      else f"only negative advantages, scaled by w_negative {self.settings.w_negative:g}")
            await store.run(store.mark_samples, [sample_id], "dropped", reason)
            self.stats.dropped += 1
            return
        if self.settings.kl_anchor > 0:
            advantages, rewrite = await self._anchor(turn, advantages, rewrite)
        if advantages is None:  # a rewrite alone: the turn's own answer trains nothing
            advantages = (0.0,) * len(turn.completion_ids)
        await store.run(
            store.set_sample_advantages, sample_id, advantages,
            teacher_logprobs=teacher_lp, reward=signal.reward, hint=signal.hint, rewrite=rewrite,
        )
        self.stats.samples += 1

    async def _anchor(
        self, turn: StoredTurn, advantages: Advantages | None, rewrite: Rewrite | None,
    ) -> tuple[Advantages | None, Rewrite | None]:
        """The anchor to the base model on every token this sample trains: the turn's own answer
        (when feedback gave it an advantage) and its rewrite, each against log pi_old of those
        tokens (docs/methods.md), scored by the base model (the adapter disabled) at the turn's
        temperature. It shapes what feedback trains and brings nothing else into the batch: a
        sample without feedback was dropped before, an answer whose advantages w_negative zeroed
        stays out, and it comes after w_negative, so its push-back is kept."""
        beta, temperature = self.settings.kl_anchor, turn.sampling.temperature
        if advantages is not None and any(advantages):
            base_lp = await self.backend.score(
                turn.prompt_ids, turn.completion_ids, model="base", temperature=temperature,
            )
            advantages = anchored(advantages, turn.logprobs, base_lp, beta)
        if rewrite is not None:
            base_lp = await self.backend.score(turn.prompt_ids, rewrite.ids, model="base", temperature=temperature)
            rewrite = replace(rewrite, advantages=anchored(rewrite.advantages, rewrite.logprobs, base_lp, beta))
        return advantages, rewrite

    @staticmethod
    def context(turn: StoredTurn) -> TurnContext:
        return turn_context(turn)

    async def _judged(self, turn: StoredTurn) -> list[Judgment]:
        """The turn's judgments: those stored, and (once it has a next state) the judges run for
        the kinds it lacks, every vote stored. One judging of a turn at a time: the quick pass and
        the settle pass may both come to a turn, and the second reads what the first stored."""
        store = self.store
        held = self._judging.setdefault(turn.id, _TurnLock())
        held.users += 1
        try:
            async with held.lock:
                judgments = await store.run(store.judgments, turn.id)
                have = {j.kind for j in judgments}
                want = [k for k in judge_kinds(self.method) if k not in have]
                if not want or turn.next_state is None:
                    return judgments
                reward, hint = await self.judges.run(self.context(turn), want)
                new = ([_reward_record(turn.id, reward)] if reward is not None else []) + (
                    [_hint_record(turn.id, hint)] if hint is not None else [])
                for rec in new:
                    await store.run(store.add_judgment, rec)
                return judgments + new
        finally:
            held.users -= 1
            if not held.users:
                del self._judging[turn.id]
