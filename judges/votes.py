r"""Reading judge votes, and choosing a hint: pure functions over the judges' raw text.

A score is the LAST `\boxed{...}` in the text (models often restate the scale before answering,
so an earlier box is not the answer); it must hold 1, +1, -1 or 0, otherwise the vote failed —
an earlier valid box is never used instead. A hint sits between `HINT_START` and `HINT_END`
(the last complete pair counts).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from clawbridge.judges.types import HintVote, Vote


@dataclass(frozen=True)
class VoteCount:
    """The result of a majority over votes, with the tally kept for the record."""

    reward: int  # -1, 0 or +1
    plus: int
    zero: int
    minus: int
    failed: int  # votes that gave no valid value (unparseable, errors)

    @property
    def valid(self) -> int:
        return self.plus + self.zero + self.minus


def majority(votes: Sequence[int | None]) -> VoteCount:
    """The most frequent valid vote; a tie for first place, or no valid vote, gives 0.
    `None` is a failed vote: counted, never a value."""
    tally = Counter(v for v in votes if v is not None)
    unknown = set(tally) - {-1, 0, 1}
    if unknown:
        raise ValueError(f"votes must be -1, 0, +1 or None, got {sorted(unknown)}")
    failed = sum(1 for v in votes if v is None)
    ranked = tally.most_common()
    if not ranked or (len(ranked) > 1 and ranked[0][1] == ranked[1][1]):
        reward = 0
    else:
        reward = ranked[0][0]
    return VoteCount(reward, plus=tally[1], zero=tally[0], minus=tally[-1], failed=failed)


__all__ = [
    "HINT_END",
    "HINT_START",
    "MIN_HINT_CHARS",
    "VoteCount",
    "choose_hint",
    "hint_candidates",
    "majority",
    "parse_hint_vote",
    "parse_vote",
    "topk_overlap",
]

HINT_START = "[HINT_START]"
HINT_END = "[HINT_END]"
MIN_HINT_CHARS = 10  # a hint must be longer than this to be kept (shorter ones say nothing)

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HINT = re.compile(re.escape(HINT_START) + r"(.*?)" + re.escape(HINT_END), re.DOTALL)
_VALUES = {"1": 1, "+1": 1, "-1": -1, "0": 0, "−1": -1}  # "−" (U+2212) is what some models emit


def parse_score(text: str) -> tuple[int | None, str | None]:
    """(value, None) from the last box, or (None, why it failed)."""
    boxes = _BOXED.findall(text)
    if not boxes:
        return None, "no \\boxed{} score in the answer"
    last = boxes[-1].strip()
    value = _VALUES.get(last)
    if value is None:
        return None, f"last \\boxed{{{last}}} is not one of 1, -1, 0"
    return value, None


def parse_vote(text: str) -> Vote:
    value, error = parse_score(text)
    return Vote(raw_text=text, value=value, error=error)


def parse_hint_vote(text: str) -> HintVote:
    """A hint vote: its score, and the hint if the vote is positive."""
    value, error = parse_score(text)
    hints = _HINT.findall(text)
    hint = hints[-1].strip() if hints else None
    if value == 1 and not hint:
        error = f"positive vote without a hint between {HINT_START} and {HINT_END}"
    return HintVote(raw_text=text, value=value, hint=hint or None, error=error)


def hint_candidates(votes: Sequence[HintVote], min_chars: int = MIN_HINT_CHARS) -> list[str]:
    """The hints worth trying: from positive votes, longer than `min_chars`, in vote order."""
    return [
        v.hint
        for v in votes
        if v.value == 1 and v.hint is not None and len(v.hint) > min_chars
    ]


def choose_hint(candidates: Sequence[str], scores: Sequence[float] | None = None) -> str | None:
    """The longest candidate, or (with scores) the best-scored; ties go to the earlier vote."""
    if not candidates:
        return None
    if scores is None:
        return max(candidates, key=len)  # max keeps the first of equal keys
    if len(scores) != len(candidates):
        raise ValueError(f"{len(candidates)} candidates but {len(scores)} scores")
    best = max(range(len(candidates)), key=lambda i: scores[i])
    return candidates[best]


def topk_overlap(teacher_topk: Sequence[Sequence[int]], student_topk: Sequence[Sequence[int]]) -> float:
    """Mean over positions of |teacher top-k ∩ student top-k| / k: how much of the student's own
    distribution a hinted teacher keeps. A hint with high overlap moves the student a little on
    tokens it already considers, which trains more stably than one that rewrites the answer."""
    if len(teacher_topk) != len(student_topk):
        raise ValueError(f"{len(teacher_topk)} teacher positions but {len(student_topk)} student ones")
    if not teacher_topk:
        return 0.0
    total = 0.0
    for t, s in zip(teacher_topk, student_topk, strict=True):
        k = max(len(t), len(s), 1)
        total += len(set(t) & set(s)) / k
    return total / len(teacher_topk)
