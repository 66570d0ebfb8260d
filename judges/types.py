"""The judges' records: what a judge reads (a turn in context) and what it returns (every vote,
raw text included, so the store keeps the evidence behind each reward and hint)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, Any]  # an OpenAI chat message: role, content (str | parts | None), ...


@dataclass(frozen=True)
class TurnContext:
    """One main turn made judgeable: the prompt messages the model answered, the assistant
    message it produced, and the next state (what the next main request appended after it: the
    user's reply, or tool results)."""

    messages: Sequence[Message]
    response: Message
    next_state: Sequence[Message]
    # what the OPD teacher needs to score the student's own tokens (empty when not known)
    tools: Sequence[Mapping[str, Any]] | None = None
    completion_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()  # log pi_old of completion_ids, as sampled
    temperature: float = 1.0  # the sampling temperature the logprobs were taken at
    instruction: str | None = None  # the applied preferences it was served with (the teacher is asked with them)


@dataclass(frozen=True)
class Vote:
    """One judge sample. `value` is None when the vote failed (then `error` says why)."""

    raw_text: str
    value: int | None
    error: str | None = None


@dataclass(frozen=True)
class Judgment:
    """A reward for a turn: the majority of `votes` (tie or no valid vote: 0)."""

    reward: int
    votes: tuple[Vote, ...]
    failed: int  # votes without a valid value
    judge: str  # which judge produced it: "rules", "prm:http:<model>", "prm:backend", ...


@dataclass(frozen=True)
class HintVote:
    """One hint-judge sample: a positive vote with a hint, or a decline."""

    raw_text: str
    value: int | None
    hint: str | None
    error: str | None = None


@dataclass(frozen=True)
class HintJudgment:
    """The hint chosen for a turn (None: no hint accepted, the turn gets no OPD term)."""

    hint: str | None
    votes: tuple[HintVote, ...]
    candidates: tuple[str, ...]  # the hints that passed the filter, in vote order
    failed: int
    judge: str

    @property
    def accepted(self) -> bool:
        return self.hint is not None


@runtime_checkable
class RewardJudge(Protocol):
    """Anything that turns a turn into a reward: the PRM judge or the rules judge."""

    name: str

    async def judge(self, turn: TurnContext) -> Judgment: ...


@runtime_checkable
class HintSource(Protocol):
    """Anything that finds a hindsight hint for a turn: the hint judge or the rules judge."""

    name: str

    async def hint(self, turn: TurnContext) -> HintJudgment: ...
