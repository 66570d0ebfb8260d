"""Episodes of general agents: outcome rewards → group-relative advantages (docs/design.md#methods).

    group of n episodes, each a multi-turn run ending in an outcome (a float)
      ──► step reward  r_{i,t} = outcome_i  [+ lam/m * sum(votes_{i,t})]  [+ overlong(len_{i,t})]
      ──► GRPO         A_{i,t} = (r_{i,t} - mean) / (std + eps), population std over the group's
                       steps (one step per assistant turn; an episode of one turn is plain GRPO)
      ──► one sample per assistant turn, A broadcast over exactly its sampled completion tokens

A hint the agent gave on a step (`ep.feedback(hint=...)`) adds hint OPD to that step with the
method's weights: A_t = w_opd * clip(teacher_t - old_t, +-c) + w_rl * A (not with `binary`).

A group whose rewards are all equal says nothing to prefer: it yields no sample, and its row and
its turns' samples say so. Episodes that expired (no outcome) train nothing; they are not
counted as failures, because nothing says they failed.

The math (`step_rewards`, `group_advantages`) is pure; `EpisodeLearner` is the pass the learner
runs beside the collector: expire, settle ready groups, write samples the trainer picks up like
any other.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from clawbridge.config import LearningSettings
from clawbridge.judges import Judges, Teacher
from clawbridge.learning.advantages import (
    anchored,
    binary_advantages,
    combine_advantages,
    group_normalise,
    integrated_reward,
    overlong_penalty,
)
from clawbridge.learning.collector import turn_context
from clawbridge.protocol import Backend
from clawbridge.store import EpisodeRow, GroupRow, JudgeVote, Judgment, Store, StoredTurn
from clawbridge.store.records import utcnow
from clawbridge.types import Method

log = logging.getLogger(__name__)


# --- the math (pure) ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One assistant turn of an episode, as the reward needs it."""

    n_tokens: int
    votes: tuple[int, ...] = ()  # the PRM's valid votes on this step (from its next state)


def length_penalty(n_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """Overlong shaping: off when max_tokens is 0; a hard -1 beyond max_tokens when there is no
    ramp (cache 0); else DAPO's soft ramp (`overlong_penalty`)."""
    if max_tokens <= 0:
        return 0.0
    if cache_tokens <= 0:
        return -1.0 if n_tokens > max_tokens else 0.0
    return overlong_penalty(n_tokens, max_tokens, min(cache_tokens, max_tokens))


def step_rewards(
    outcome: float,
    steps: Sequence[Step],
    *,
    lam: float = 0.0,
    overlong: tuple[int, int] = (0, 0),
) -> tuple[float, ...]:
    """Each step's reward: the outcome broadcast, integrated with the step's votes when lam > 0
    (outcome + lam/m * sum(votes)), plus the overlong penalty of the step's length."""
    out = []
    for s in steps:
        r = integrated_reward(outcome, s.votes, lam) if lam > 0 else float(outcome)
        out.append(r + length_penalty(s.n_tokens, *overlong))
    return tuple(out)


def group_advantages(
    rewards: Sequence[Sequence[float]], eps: float = 1e-6
) -> tuple[tuple[float, ...], ...] | None:
    """GRPO over every step of the group (population std). None: all rewards are equal (or
    there is at most one), so there is nothing to prefer and no sample."""
    flat = [r for ep in rewards for r in ep]
    if len(flat) < 2 or max(flat) - min(flat) <= 1e-12:
        return None
    norm = iter(group_normalise(flat, eps))
    return tuple(tuple(next(norm) for _ in ep) for ep in rewards)


def all_equal_reason(group_id: str, rewards: Sequence[Sequence[float]]) -> str:
    flat = [r for ep in rewards for r in ep]
    if not flat:
        return f"group {group_id}: no scored episode with turns"
    if len(flat) == 1:
        return f"group {group_id}: one step only (reward {flat[0]:+g}), nothing to compare it with"
    return f"group {group_id}: all {len(flat)} step rewards equal ({flat[0]:+g}), nothing to prefer"


# --- the pass -----------------------------------------------------------------------------------
@dataclass
class EpisodeStats:
    groups_trained: int = 0
    groups_dropped: int = 0
    episodes_expired: int = 0
    samples: int = 0


@dataclass
class _Scored:
    episode: EpisodeRow
    turns: list[StoredTurn] = field(default_factory=list)


class EpisodeLearner:
    """Expires episodes past the timeout and turns settled groups into samples."""

    def __init__(
        self, settings: LearningSettings, backend: Backend, store: Store, judges: Judges | None, teacher: Teacher, *,
        method: Method,
    ) -> None:
        self.settings = settings
        self.method = method
        self.backend = backend
        self.store = store
        self.judges = judges
        self.teacher = teacher  # hint OPD's scorer, the collector's own
        self.stats = EpisodeStats()

    async def run_once(self, limit: int = 16) -> int:
        """One pass; returns the number of groups settled."""
        s, store = self.settings, self.store
        cutoff = utcnow() - timedelta(seconds=s.episode_timeout_s)
        reason = f"no outcome within episode_timeout_s = {s.episode_timeout_s:g} s"
        self.stats.episodes_expired += await store.run(store.expire_episodes, cutoff, reason)
        groups = await store.run(store.groups_to_settle, limit)
        for g in groups:
            await self.settle(g)
        return len(groups)

    async def episode_turns(self, e: EpisodeRow) -> list[StoredTurn]:
        store = self.store
        if e.turn_id is not None:
            turn = await store.run(store.get_turn, e.turn_id)
            return [turn] if turn is not None and turn.train else []
        turns = await store.run(store.session_turns, e.session_id)
        return sorted((t for t in turns if t.turn_type == "main" and t.train), key=lambda t: t.index)

    async def settle(self, g: GroupRow) -> None:
        s, store = self.settings, self.store
        scored = [_Scored(e) for e in g.episodes if e.state == "scored"]
        for sc in scored:
            sc.turns = await self.episode_turns(sc.episode)
        scored = [sc for sc in scored if sc.turns]
        rewards: list[tuple[float, ...]] = []
        for sc in scored:
            steps = [Step(len(t.completion_ids), await self.votes(t)) for t in sc.turns]
            assert sc.episode.outcome is not None
            rewards.append(step_rewards(
                sc.episode.outcome, steps, lam=s.episode_prm_lambda,
                overlong=(s.overlong_max_tokens, s.overlong_cache_tokens),
            ))
        adv = group_advantages(rewards)
        method = self.method
        if adv is None:
            why = all_equal_reason(g.id, rewards)
            for sc, rs in zip(scored, rewards, strict=True):
                for turn, r in zip(sc.turns, rs, strict=True):
                    await store.run(store.create_sample, turn.id, method, state="dropped", reward=r, reason=why)
            await store.run(store.settle_group, g.id, "dropped", why)
            self.stats.groups_dropped += 1
            return
        made = 0
        for sc, rs, As in zip(scored, rewards, adv, strict=True):
            for turn, r, a in zip(sc.turns, rs, As, strict=True):
                made += await self._sample(g, turn, r, a)
        await store.run(store.settle_group, g.id, "trained", f"{made} samples from {len(scored)} scored episodes")
        self.stats.groups_trained += 1

    async def _sample(self, g: GroupRow, turn: StoredTurn, reward: float, advantage: float) -> int:
        """One turn's sample: the group-relative advantage on every completion token it sampled
        (the prompt, tool results included, is masked by the trainer's datum)."""
        store, s = self.store, self.settings
        hint = await self.hint(turn) if self.method != "binary" else None
        if (abs(advantage) < 1e-9 and hint is None) or not turn.completion_ids:
            reason = f"group {g.id}: zero advantage (reward {reward:+g} is the group mean)"
            await store.run(store.create_sample, turn.id, self.method, state="dropped", reward=reward, reason=reason)
            return 0
        teacher_lp: list[float] | None = None
        if hint is None:
            token_adv = binary_advantages(s.w_rl * advantage, len(turn.completion_ids))
        else:  # hint OPD on top of the group advantage: w_opd * clip(teacher - old) + w_rl * A
            teacher_lp = await self.teacher.logprobs(turn_context(turn), hint)
            token_adv = combine_advantages(teacher_lp, turn.logprobs, advantage, s.w_opd, s.w_rl, s.opd_clip)
        if s.kl_anchor > 0:
            base_lp = await self.backend.score(
                turn.prompt_ids, turn.completion_ids, model="base", temperature=turn.sampling.temperature,
            )
            token_adv = anchored(token_adv, turn.logprobs, base_lp, s.kl_anchor)
        _, created = await store.run(
            store.create_sample, turn.id, self.method, state="judged", reward=reward, advantages=token_adv,
            teacher_logprobs=teacher_lp, hint=hint,
        )
        if created:
            self.stats.samples += 1
        return int(created)

    async def hint(self, turn: StoredTurn) -> str | None:
        """A hint the agent gave on this step (`ep.feedback(hint=...)`), if any."""
        js = await self.store.run(self.store.judgments, turn.id)
        return next((j.hint for j in js if j.kind == "feedback" and j.hint), None)

    async def votes(self, turn: StoredTurn) -> tuple[int, ...]:
        """The PRM's valid votes on a step, judged from its next state (stored once, read back
        after a restart); none when integration is off or the step has no next state (the last
        step: its outcome is the judgment)."""
        if self.settings.episode_prm_lambda <= 0 or turn.next_state is None or self.judges is None:
            return ()
        store = self.store
        have = [j for j in await store.run(store.judgments, turn.id) if j.kind == "prm"]
        if have:
            rec = have[0]
        else:
            j = await self.judges.reward.judge(turn_context(turn))
            rec = Judgment(
                turn_id=turn.id, judge=j.judge, kind="prm", reward=float(j.reward),
                votes=tuple(JudgeVote(raw=v.raw_text, value=v.value, error=v.error) for v in j.votes),
            )
            await store.run(store.add_judgment, rec)
        return tuple(int(v.value) for v in rec.votes if isinstance(v.value, int | float) and v.error is None)
