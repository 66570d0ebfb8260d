"""The PRM judge: m concurrent votes on a turn, majority wins (docs/design.md#judges)."""

from __future__ import annotations

import asyncio
import logging

from clawbridge.judges.clients import JudgeClient
from clawbridge.judges.prompts import judge_messages
from clawbridge.judges.types import Judgment, TurnContext, Vote
from clawbridge.judges.votes import majority, parse_vote

log = logging.getLogger(__name__)


class PRMJudge:
    """Scores a turn -1/0/+1 from the next state. A vote whose request fails, or whose text
    holds no valid final box, is a failed vote: stored with its error, counted, never a value."""

    def __init__(
        self,
        client: JudgeClient,
        votes: int = 3,
        *,
        temperature: float = 0.7,  # votes must differ to be worth a majority
        max_tokens: int = 1024,
        seed: int | None = 0,
    ) -> None:
        if votes < 1:
            raise ValueError("a PRM judge needs at least one vote")
        self.client = client
        self.votes = votes
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.name = f"prm:{client.name}"

    async def judge(self, turn: TurnContext) -> Judgment:
        messages = judge_messages("prm", turn)
        cast = await asyncio.gather(*(self._vote(messages, i) for i in range(self.votes)))
        count = majority([v.value for v in cast])
        if count.failed:
            log.info("%s: %d of %d votes failed", self.name, count.failed, self.votes)
        return Judgment(reward=count.reward, votes=tuple(cast), failed=count.failed, judge=self.name)

    async def _vote(self, messages: list[dict[str, str]], i: int) -> Vote:
        seed = None if self.seed is None else self.seed + i
        try:
            text = await self.client.complete(
                messages, temperature=self.temperature, max_tokens=self.max_tokens, seed=seed
            )
        except Exception as e:  # one vote's failure must not sink the others
            log.warning("%s: vote %d failed: %s", self.name, i, e)
            return Vote(raw_text="", value=None, error=f"{type(e).__name__}: {e}")
        return parse_vote(text)
