"""The hint judge (OPD) and the teacher prompt (DESIGN.md §5).

m votes each either decline or give a hindsight hint. Hints from positive votes longer than 10
characters are candidates; the longest wins, or, with `selection="overlap"`, the one a scoring
callable rates highest (OpenClaw-RL's newest recipe scores by how much the hinted teacher's
top-k tokens overlap the student's; see `votes.topk_overlap`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from clawbridge.judges.clients import JudgeClient
from clawbridge.judges.prompts import judge_messages
from clawbridge.judges.types import HintJudgment, HintVote, Message, TurnContext
from clawbridge.judges.votes import MIN_HINT_CHARS, choose_hint, hint_candidates, parse_hint_vote

log = logging.getLogger(__name__)

HINT_HEADER = "[user's hint / instruction]"
Selection = Literal["longest", "overlap"]
HintScorer = Callable[[TurnContext, str], Awaitable[float]]


def teacher_messages(messages: Sequence[Message], hint: str) -> list[dict[str, Any]]:
    """A copy of the prompt with the hint appended to the LAST user message as
    `\\n\\n[user's hint / instruction]\\n{hint}`. The input is never mutated. Content parts get
    the hint on their last text part (or a new one); a prompt with no user message gets one."""
    out = [copy.deepcopy(dict(m)) for m in messages]
    suffix = f"\n\n{HINT_HEADER}\n{hint}"
    last_user = next((m for m in reversed(out) if m.get("role") == "user"), None)
    if last_user is None:
        out.append({"role": "user", "content": suffix.lstrip("\n")})
        return out
    content = last_user.get("content")
    if isinstance(content, list):
        texts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if texts:
            texts[-1]["text"] = str(texts[-1].get("text", "")) + suffix
        else:
            content.append({"type": "text", "text": suffix.lstrip("\n")})
    else:
        last_user["content"] = (content or "") + suffix
    return out


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
