"""The hint judge (OPD) and the teacher prompt (docs/design.md#judges).

m votes each either decline or give a hindsight hint. Hints from positive votes longer than 10
characters are candidates; the longest wins, or, with `selection="overlap"`, the one a scoring
callable rates highest (OpenClaw-RL's newest recipe scores by how much the hinted teacher's
top-k tokens overlap the student's; see `votes.topk_overlap`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from clawbridge.chat.instructions import instructed, restates, with_system_line
from clawbridge.judges.clients import JudgeClient
from clawbridge.judges.prompts import judge_messages
from clawbridge.judges.types import HintJudgment, HintVote, Message, TurnContext
from clawbridge.judges.votes import MIN_HINT_CHARS, choose_hint, hint_candidates, parse_hint_vote

log = logging.getLogger(__name__)

# The teacher reads the hint as a system instruction: a small model follows it there more often
# than appended to the user's message, where a header leaks into its answers
# (docs/methods.md#the-teacher-prompt).
HINT_SYSTEM = "The user gave this feedback on your previous answer; follow it in this answer: {hint}"
Selection = Literal["longest", "overlap"]
HintScorer = Callable[[TurnContext, str], Awaitable[float]]


def teacher_messages(messages: Sequence[Message], hint: str) -> list[dict[str, Any]]:
    """A copy of the prompt with the hint as a system instruction (`HINT_SYSTEM`), placed as the
    served instruction is (`chat.instructions.with_system_line`)."""
    return with_system_line(messages, HINT_SYSTEM.format(hint=hint))


def teacher_view(messages: Sequence[Message], hint: str | None, instruction: str | None = None) -> list[dict[str, Any]]:
    """The teacher's prompt for a turn: the instruction the turn was served with
    (`chat.instructions.instructed`) and then the user's hint (`teacher_messages`), both in the
    system message, in that order: the standing preferences first, this answer's feedback after.
    A hint that is word for word one of the instruction's preferences (`restates`: the user
    repeating a correction already applied) is left out: asked the same thing twice, a small
    teacher over-shoots into answers about the request instead of the question
    (docs/methods.md#the-weights-later-baking-an-applied-preference-in)."""
    asked = instructed(messages, instruction)
    return teacher_messages(asked, hint) if hint and not restates(instruction, hint) else asked


class HintJudge:
    def __init__(
        self,
        client: JudgeClient,
        votes: int = 3,
        selection: Selection = "longest",
        *,
        scorer: HintScorer | None = None,
        temperature: float = 0.7,
        max_tokens: int = 1024,
        seed: int | None = 0,
        min_chars: int = MIN_HINT_CHARS,
    ) -> None:
        if votes < 1:
            raise ValueError("a hint judge needs at least one vote")
        if selection == "overlap" and scorer is None:
            raise ValueError("selection='overlap' needs a scorer(turn, hint) -> overlap")
        self.client = client
        self.votes = votes
        self.selection = selection
        self.scorer = scorer
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.min_chars = min_chars
        self.name = f"hint:{client.name}"

    async def hint(self, turn: TurnContext) -> HintJudgment:
        messages = judge_messages("hint", turn)
        cast = await asyncio.gather(*(self._vote(messages, i) for i in range(self.votes)))
        candidates = hint_candidates(cast, self.min_chars)
        scores: list[float] | None = None
        if self.selection == "overlap" and self.scorer is not None and len(candidates) > 1:
            scores = list(await asyncio.gather(*(self.scorer(turn, c) for c in candidates)))
        return HintJudgment(
            hint=choose_hint(candidates, scores),
            votes=tuple(cast),
            candidates=tuple(candidates),
            failed=sum(1 for v in cast if v.value is None),
            judge=self.name,
        )

    async def _vote(self, messages: list[dict[str, str]], i: int) -> HintVote:
        seed = None if self.seed is None else self.seed + i
        try:
            text = await self.client.complete(
                messages, temperature=self.temperature, max_tokens=self.max_tokens, seed=seed
            )
        except Exception as e:  # one vote's failure must not sink the others
            log.warning("%s: vote %d failed: %s", self.name, i, e)
            return HintVote(raw_text="", value=None, hint=None, error=f"{type(e).__name__}: {e}")
        return parse_hint_vote(text)
