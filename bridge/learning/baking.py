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

**Keeping what was learned.** A learned preference is served by the weights alone, so a candidate
that carries it clearly less than the serving version serves the user worse on it. The serving
version's share is kept with the prompts it was measured on (`Kept`); the candidate is measured
again on the same twin answers, so the two shares are paired (the same answers, the same lift: no
sampling between them), and `lost` holds the candidate back when it carries `LOSS_MARGIN` less.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from clawbridge.chat.instructions import instructed
from clawbridge.chat.renderer import Renderer
from clawbridge.learning.gate import Asked
from clawbridge.learning.preferences import instruction
from clawbridge.protocol import Backend
from clawbridge.store import Preference, StoredTurn
from clawbridge.store.records import JSONObject
from clawbridge.types import Completion, SamplingParams

Prompt = tuple[Sequence[JSONObject], Sequence[JSONObject] | None]  # a user's messages and tools

log = logging.getLogger(__name__)

MIN_LIFT = 0.02  # nats per token: an instruction whose lift on its own answers is below this is not measured
LOSS_MARGIN = 0.1  # share: a candidate carrying a learned preference this much less than the serving version is held back


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


@dataclass(frozen=True)
class Kept:
    """What the serving version's weights alone carry of one instruction, and the prompts it was
    measured on (their twin answers are kept: a candidate measured on them is paired with it)."""

    version: int
    prompts: tuple[Prompt, ...]
    share: float


def lost(kept: Kept | None, now: float | None, margin: float = LOSS_MARGIN) -> bool:
    """Whether a candidate whose weights alone carry `now` of a learned preference, measured on
    `kept`'s answers, carries it clearly less than the serving version did (pure); never when
    either could not be measured."""
    return kept is not None and now is not None and now < kept.share - margin


@dataclass(frozen=True)
class Reviewed:
    """One instruction's measurement of the newest weights: on the batch's prompts (`carried`,
    `share`, the verdict `learned`) and, where the serving version's is kept, on its answers
    (`kept`, `share_on_kept`)."""

    carried: Carried
    share: float | None
    learned: bool
    kept: Kept | None = None
    share_on_kept: float | None = None
    lost: bool = False  # `lost`: carries it clearly less than the serving version


__all__ = ["LOSS_MARGIN", "MIN_LIFT", "Carried", "Kept", "Prompt", "Retirement", "Review", "Reviewed", "Twin",
           "carried", "lost", "retired", "review_of", "student_view", "verdict"]


@dataclass(frozen=True)
class Review:
    """What one version's weights alone carry of each applied or learned preference
    (`Retirement`), and so how it would be served: `changed` (preference id -> learned)
    is what its serving would change, `instruction` the applied preferences it would still be
    served with (None: none; the weights carry every one), `lost` why it would serve a learned
    preference clearly worse than the serving version (`lost`: it is held back)."""

    changed: dict[int, bool]
    instruction: str | None
    users: tuple[str, ...] = ()  # whose preferences change
    lost: tuple[str, ...] = ()
    measured: dict[str, Reviewed] = field(default_factory=dict)  # by instruction
    prompts: tuple[Prompt, ...] = ()  # what it was measured on

    def asked(self, asked: Asked) -> Asked:
        """`asked` with the candidate asked as it would be served."""
        return replace(asked, candidate=self.instruction)


def review_of(version: int, prefs: Sequence[Preference], reviewed: Sequence[Reviewed],
              prompts: Sequence[Prompt]) -> Review:
    """`version`'s `Review` from its measurement of each of `prefs` (pure, but for the log)."""
    changed: dict[int, bool] = {}
    losses: list[str] = []
    for p, r in zip(prefs, reviewed, strict=True):
        kept = "" if r.kept is None or r.share_on_kept is None else (
            f"{r.share_on_kept:.2f} on v{r.kept.version}'s answers, where v{r.kept.version} carries {r.kept.share:.2f}")
        log.info("preference %d %r: v%d's weights alone carry %s of its instruction (lift %.3f nats/token, "
                 "%d tokens)%s%s", p.id, p.text, version, "unmeasurable" if r.share is None else f"{r.share:.2f}",
                 r.carried.lift, r.carried.tokens, kept and f"; {kept}",
                 "" if r.learned == (p.state == "learned") else (" -> learned if it serves" if r.learned
                                                                 else " -> applied again if it serves"))
        if r.learned != (p.state == "learned"):
            changed[p.id] = r.learned
        if r.lost:
            losses.append(f"learned preference {p.id} lost: v{version}'s weights alone carry {kept} "
                        "(clearly less: it would serve the user worse)")
    still = [p for p, r in zip(prefs, reviewed, strict=True) if not r.learned]
    return Review(changed, instruction(still), tuple(dict.fromkeys(p.user for p in prefs if p.id in changed)),
                  tuple(losses), {p.text: r for p, r in zip(prefs, reviewed, strict=True)}, tuple(prompts))


class Retirement:
    """Which applied preferences the newest weights carry alone (`Twin.measure`, `verdict`), and
    how much the serving version carried of each (`kept`, by instruction)."""

    def __init__(self, twin: Twin, retire_share: float, restore_share: float, min_lift: float = MIN_LIFT) -> None:
        if restore_share > retire_share:
            raise ValueError(f"restore_share {restore_share:g} above retire_share {retire_share:g} would flap")
        self.twin, self.retire_share, self.restore_share = twin, retire_share, restore_share
        self.min_lift = min_lift  # an instruction whose lift is below this is not measured (`MIN_LIFT`)
        self.loss_margin = LOSS_MARGIN  # `lost`
        # the serving version's measurement of each instruction; empty after a restart or a
        # rollback (nothing to pair with: no candidate is held back for a loss until a version serves)
        self.kept: dict[str, Kept] = {}

    async def review(self, prompts: Sequence[Prompt], instructions: Sequence[tuple[str, bool]]) -> list[Reviewed]:
        """For each (instruction, learned now): what the newest weights carry of it, its share
        (None: not measurable), whether it is learned after this measurement, and for a learned
        one the serving version kept a measurement of, the share on that version's answers."""
        out = []
        for text, learned in instructions:
            c = await self.twin.measure(prompts, text)
            share = c.share_at(self.min_lift)
            kept = self.kept.get(text) if learned else None
            on_kept = (await self.twin.measure(kept.prompts, text)).share_at(self.min_lift) if kept else None
            out.append(Reviewed(c, share, verdict(share, learned, self.retire_share, self.restore_share),
                                kept, on_kept, lost(kept, on_kept, self.loss_margin)))
        return out

    def serves(self, version: int, prompts: Sequence[Prompt], reviewed: Mapping[str, Reviewed]) -> None:
        """`version`, reviewed on `prompts`, serves: its shares are what later candidates keep to."""
        for text, r in reviewed.items():
            if r.share is not None:
                self.kept[text] = Kept(version, tuple(prompts), r.share)

    def forget_kept(self) -> None:
        """Other weights serve (a rollback): no measurement to pair with until a reviewed one serves."""
        self.kept.clear()


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
