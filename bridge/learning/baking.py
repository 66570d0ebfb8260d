"""Baking an applied preference into the weights: context distillation (docs/methods.md#the-weights-later).

A turn served under the applied preferences' instruction `I` was sampled from pi(. | x, I), the
prompt `x` with the instruction in its system message. The weights should learn to answer `x`
alone as they answer `x, I`, so every such turn trains from the **student's view**:

    prompt      x            (the turn's messages rendered without the instruction)
    log pi_old  log pi(y | x) re-scored by the policy being trained (the recorded logprobs are
                log pi(y | x, I): with them the PPO ratio would start at pi(y|x) / pi(y|x,I), not 1)
    teacher     log pi_T(y | x, I [, hint])  the teacher asked with the instruction, and the turn's
                hint when the user corrected it (`judges.teacher_view`: the instruction first, then
                the feedback line, both in the system message)

so its OPD term, teacher - old, is the instruction's pull on each token, and a turn under an
instruction is a distillation datum whether or not the user corrected it.

**Retiring the instruction.** For each applied preference `p`, on the user's recent prompts `x`,
the twin (the base model asked with `p`) answers `y ~ pi_base(. | x, p)`, and two figures in nats
per token follow from three scores of the same answers:

    lift    = E_y log pi_base(y | x, p) - log pi_base(y | x)    = KL(twin || base)
    carried = E_y log pi_cand(y | x)    - log pi_base(y | x)    = KL(twin || base) - KL(twin || cand)
    share   = carried / lift                                    = 1 - KL(twin || cand) / KL(twin || base)

`share` is how much of the way from the base model to the twin the candidate's weights alone
have come, the instruction left out. `share` >= `retire_share` retires the instruction (the
preference is "learned"); a later version whose share falls below `restore_share` brings it back.
A lift below `MIN_LIFT` says the instruction hardly changes these answers: nothing to measure, no
change. The twin's answers are fresh draws, never the answers training saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from clawbridge.chat.instructions import instructed
from clawbridge.chat.renderer import Renderer
from clawbridge.protocol import Backend
from clawbridge.store import Preference, StoredTurn
from clawbridge.store.records import JSONObject
from clawbridge.types import Completion, SamplingParams

Prompt = tuple[Sequence[JSONObject], Sequence[JSONObject] | None]  # a user's messages and tools

MIN_LIFT = 0.02  # nats per token: an instruction whose lift on its own answers is below this is not measured


async def student_view(turn: StoredTurn, renderer: Renderer, backend: Backend) -> StoredTurn:
    """`turn` as the student sees it: without the instruction it was served with, its logprobs
    re-scored by the newest policy on that prompt (the turn itself when it had none)."""
    if not turn.instruction:
        return turn
    prompt = renderer.render(turn.messages, turn.tools)
    old = await backend.score(prompt, turn.completion_ids, model="policy", temperature=turn.sampling.temperature)
    if len(old) != len(turn.completion_ids):
        raise ValueError(f"the backend scored {len(old)} of {len(turn.completion_ids)} tokens")
    return replace(turn, prompt_ids=tuple(prompt), logprobs=tuple(old))


@dataclass(frozen=True)
class Carried:
    """What a version's weights alone carry of one instruction, over the turns measured."""

    lift: float  # the instruction's lift on the base model, nats per token
    carried: float  # the version's weights without it, over the base without it, nats per token
    tokens: int
    turns: int

    @property
    def share(self) -> float | None:
        """carried / lift; None when the lift is too small to measure against (`MIN_LIFT`)."""
        return self.share_at(MIN_LIFT)

    def share_at(self, min_lift: float) -> float | None:
        """carried / lift; None when the lift is below `min_lift` (or none at all)."""
        return self.carried / self.lift if self.lift >= min_lift and self.lift > 0 else None


def carried(base_with: Sequence[Sequence[float]], base_without: Sequence[Sequence[float]],
            version_without: Sequence[Sequence[float]]) -> Carried:
    """`Carried` from per-turn token logprobs of the same answers (pure): the base model with the
    instruction, the base without it, the version without it."""
    n = sum(len(x) for x in base_without)
    if n == 0:
        return Carried(0.0, 0.0, 0, 0)
    for a, b, c in zip(base_with, base_without, version_without, strict=True):
        if not len(a) == len(b) == len(c):
            raise ValueError("each answer needs one logprob per token from every model")
    lift = sum(sum(a) - sum(b) for a, b in zip(base_with, base_without, strict=True)) / n
    kept = sum(sum(c) - sum(b) for c, b in zip(version_without, base_without, strict=True)) / n
    return Carried(lift, kept, n, len(base_without))


class Twin:
    """The twin's answers to the user's recent prompts, per instruction, drawn once (the base
    model does not change) and scored by each candidate the gate judges (`measure`)."""

    def __init__(self, backend: Backend, renderer: Renderer, params: SamplingParams, samples: int) -> None:
        self.backend, self.renderer, self.params, self.samples = backend, renderer, params, samples
        self._answers: dict[tuple[str, str], list[tuple[list[int], Completion, list[float]]]] = {}

    async def _answers_to(self, prompt: Prompt, instruction: str) -> list[tuple[list[int], Completion, list[float]]]:
        """(plain prompt ids, a twin answer, the base model's scores of it without the instruction)."""
        messages, tools = prompt
        key = (self.renderer.render_text(messages, tools), instruction)
        if key not in self._answers:
            plain = self.renderer.render(messages, tools)
            asked = self.renderer.render(instructed(messages, instruction), tools)
            drawn = [c for c in await self.backend.sample(asked, self.params, n=self.samples, version=0, priority="background")
                     if c.tokens]
            base = await asyncio.gather(*(self.backend.score(plain, c.tokens, model="base", temperature=self.params.temperature)
                                          for c in drawn))
            self._answers[key] = [(plain, c, b) for c, b in zip(drawn, base, strict=True)]
        return self._answers[key]

    async def measure(self, prompts: Sequence[Prompt], instruction: str) -> Carried:
        """`Carried` of `instruction` by the newest policy (the candidate the gate judges)."""
        rows = [r for got in await asyncio.gather(*(self._answers_to(p, instruction) for p in prompts)) for r in got]
        t = self.params.temperature
        now = await asyncio.gather(*(self.backend.score(plain, c.tokens, model="policy", temperature=t) for plain, c, _ in rows))
        return carried([list(c.logprobs) for _, c, _ in rows], [b for *_, b in rows], now)


def verdict(share: float | None, learned: bool, retire_share: float, restore_share: float) -> bool:
    """Whether the preference is learned after this measurement (pure): retired at
    `retire_share`, back at `restore_share` (below it), unchanged when nothing could be measured."""
    if share is None:
        return learned
    return share >= restore_share if learned else share >= retire_share


__all__ = ["MIN_LIFT", "Carried", "Prompt", "Retirement", "Twin", "carried", "retired", "student_view", "verdict"]


class Retirement:
    """Which applied preferences the newest weights carry alone (`Twin.measure`, `verdict`)."""

    def __init__(self, twin: Twin, retire_share: float, restore_share: float, min_lift: float = MIN_LIFT) -> None:
        if restore_share > retire_share:
            raise ValueError(f"restore_share {restore_share:g} above retire_share {retire_share:g} would flap")
        self.twin, self.retire_share, self.restore_share = twin, retire_share, restore_share
        self.min_lift = min_lift  # an instruction whose lift is below this is not measured (`MIN_LIFT`)

    async def review(self, prompts: Sequence[Prompt],
                     instructions: Sequence[tuple[str, bool]]) -> list[tuple[Carried, float | None, bool]]:
        """For each (instruction, learned now): what the newest weights carry of it, its share
        (None: not measurable), and whether it is learned after this measurement."""
        out = []
        for text, learned in instructions:
            c = await self.twin.measure(prompts, text)
            share = c.share_at(self.min_lift)
            out.append((c, share, verdict(share, learned, self.retire_share, self.restore_share)))
        return out


def retired(known: Sequence[Preference], changed: Mapping[int, bool], version: int, now: datetime) -> list[Preference]:
    """`known` after a measurement (pure): each preference in `changed` (id -> learned) learned
    with `version` (its instruction stops) or applied again (it comes back). A preference the
    user dropped or a newer one superseded in the meantime stays as it is."""
    out = []
    for p in known:
        learned = changed.get(p.id)
        if learned is None or p.state not in ("applied", "learned"):
            out.append(p)
        elif learned:
            out.append(replace(p, state="learned", state_at=now, learned_version=version))
        else:
            out.append(replace(p, state="applied", state_at=now, learned_version=None))
    return out
