"""The pairwise judge the gate uses on the user's own recent prompts: given a conversation and
two replies, which one serves the user better? A judge compares more reliably than it grades,
and asking twice with the order swapped cancels its position bias.

The answer is the LAST `\\boxed{A}`, `\\boxed{B}` or `\\boxed{0}` (a tie) in the text; anything else
counts as a tie (no evidence either way), and is counted.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from clawbridge.judges.clients import JudgeClient
from clawbridge.judges.prompts import message_text
from clawbridge.judges.types import Message

_BOXED = re.compile(r"\\boxed\{\s*([AaBb0])\s*\}")

PAIRWISE_PROMPT = """You compare two replies an assistant could give at the end of a conversation.

Conversation so far:
{conversation}

Reply A:
{a}

Reply B:
{b}

Which reply serves the user better: it answers what was asked, is correct, and follows what the
user has asked for about the form of answers? Think briefly, then end with \\boxed{{A}}, \\boxed{{B}},
or \\boxed{{0}} if they are equally good."""


def parse_preference(text: str) -> float | None:
    """1.0 for A, 0.0 for B, 0.5 for a tie; None when no valid box is found (pure)."""
    found = _BOXED.findall(text)
    if not found:
        return None
    last = found[-1].upper()
    return {"A": 1.0, "B": 0.0, "0": 0.5}[last]


def _conversation(messages: Sequence[Message]) -> str:
    return "\n".join(f"{m.get('role', 'user')}: {message_text(m)}" for m in messages)


class PairwiseJudge:
    def __init__(self, client: JudgeClient, *, max_tokens: int = 512, seed: int | None = 0) -> None:
        self.client = client
        self.max_tokens = max_tokens
        self.seed = seed
        self.failed = 0

    async def _ask(self, messages: Sequence[Message], a: str, b: str) -> float | None:
        prompt = PAIRWISE_PROMPT.format(conversation=_conversation(messages), a=a, b=b)
        try:
            text = await self.client.complete([{"role": "user", "content": prompt}], temperature=0.0,
                                              max_tokens=self.max_tokens, seed=self.seed)
        except Exception:  # one failed comparison is a tie, not a crash of the gate
            return None
        return parse_preference(text)

    async def prefer(self, messages: Sequence[Message], first: str, second: str) -> float:
        """How much better `first` is than `second`: 1 (always preferred) .. 0 (never), 0.5 tie;
        asked in both orders and averaged."""
        ab, ba = await asyncio.gather(self._ask(messages, first, second), self._ask(messages, second, first))
        votes = [v for v in (ab, None if ba is None else 1.0 - ba) if v is not None]
        self.failed += 2 - len(votes)
        return sum(votes) / len(votes) if votes else 0.5


__all__ = ["PAIRWISE_PROMPT", "PairwiseJudge", "parse_preference"]
