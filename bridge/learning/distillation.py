"""What one sample trains: its datums (docs/methods.md).

    the turn's own answer, with the sample's advantages
    + its hint-guided rewrite, when it has one (the teacher's answer under the turn's own prompt)
    + with top-k distillation (`opd_topk`): the teacher's prompt (the turn's prompt with the hint)
      on the hinted sample's datums, and `opd_draws` fresh answers of the policy being trained,
      each learning the teacher's top-k distribution alone, less those the hint lifts
      (`opd_draw_max_lift`, `drop_lifted`)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

from clawbridge.config import TrainingSettings
from clawbridge.judges import Teacher
from clawbridge.learning.baking import student_view
from clawbridge.learning.collector import turn_context
from clawbridge.learning.rewrite import Draw, redraw_params, scored
from clawbridge.protocol import Backend, DistillsTopK
from clawbridge.store import Sample, Store, StoredTurn
from clawbridge.types import Completion, Datum

log = logging.getLogger(__name__)


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


class Distillation:
    """A sample's datums, with the teacher's prompt and fresh draws when top-k distillation is on."""

    def __init__(self, settings: TrainingSettings, backend: Backend, store: Store, teacher: Teacher | None,
                 redraw_max_tokens: int = 0) -> None:
        if settings.opd_topk > 0 and not (isinstance(backend, DistillsTopK) and backend.distills_topk):
            raise ValueError(f"opd_topk {settings.opd_topk}: the {backend.name} backend cannot distil the teacher's "
                             "top-k distribution (its loss never sees the teacher's logits); set opd_topk 0")
        if settings.opd_draws > 0 and settings.opd_topk <= 0:
            raise ValueError("opd_draws needs opd_topk > 0: fresh draws learn only the teacher's top-k distribution")
        self.settings = settings
        self.backend = backend
        self.store = store
        self.redraw_max_tokens = redraw_max_tokens  # a fresh draw's length at most (0: the turn's budget)
        self.teacher = teacher if settings.opd_topk > 0 else None
        self.renderer = teacher.renderer if teacher is not None else None

    async def datums(self, sample: Sample) -> list[Datum]:
        """What the sample trains (`to_datums`): a turn served under an instruction from the
        student's view (`baking.student_view`: the prompt without it, log pi_old re-scored there
        by the policy about to train, so the PPO ratio starts at 1). With top-k distillation on,
        a hinted or instructed sample's datums carry the teacher prompt, and `opd_draws` fresh
        answers join them."""
        turn = await self.store.run(self.store.get_turn, sample.turn_id)
        if turn is not None and turn.instruction:
            if self.renderer is None:
                raise ValueError("a turn served under an instruction needs the trainer built with the teacher's renderer")
            turn = await student_view(turn, self.renderer, self.backend)
            sample = replace(sample, prompt_ids=turn.prompt_ids, logprobs=turn.logprobs)
        if self.settings.opd_topk <= 0 or not (sample.hint or (turn is not None and turn.instruction)) or turn is None:
            return to_datums(sample)
        teacher = self.teacher_prompt(turn, sample.hint)
        drawn = await self.fresh_draws(sample, turn, teacher) if self.settings.opd_draws > 0 else []
        return to_datums(sample, teacher, distil_rewrite=self.settings.opd_topk_rewrite) + drawn

    def teacher_prompt(self, turn: StoredTurn, hint: str | None) -> list[int]:
        """The teacher's prompt: the turn's prompt with its instruction and the hint, exactly as
        the collector scored it."""
        if self.teacher is None:
            raise ValueError("opd_topk > 0 needs the trainer built with the teacher (build_learning does)")
        return self.teacher.prompt_ids(turn_context(turn), hint)

    async def fresh_draws(self, sample: Sample, turn: StoredTurn, teacher_prompt_ids: Sequence[int]) -> list[Datum]:
        """`opd_draws` answers of the policy being trained (the newest published weights, which a
        gate may not be serving) to the sample's prompt at the turn's sampling settings, each to
        learn the teacher's top-k distribution alone: on-policy distillation whatever version
        the user talked to. With `opd_draw_max_lift`, the draws the hint lifts are left out
        (`drop_lifted`). Drawn for the step and not stored: a step lost in a crash draws anew."""
        params = redraw_params(turn, self.redraw_max_tokens)
        drawn = [c for c in await self.backend.sample(sample.prompt_ids, params, n=self.settings.opd_draws,
                                                      version=self.backend.newest, priority="background")
                 if c.tokens]
        if (bound := self.settings.opd_draw_max_lift) is not None:
            drawn = await self.drop_lifted(drawn, sample.prompt_ids, teacher_prompt_ids, params.temperature, bound)
        zeros = lambda c: (0.0,) * len(c.tokens)  # noqa: E731
        return [Datum(sample.prompt_ids, tuple(c.tokens), tuple(c.logprobs), zeros(c), sample.temperature,
                      tuple(teacher_prompt_ids)) for c in drawn]

    async def drop_lifted(self, drawn: Sequence[Completion], prompt_ids: Sequence[int],
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
