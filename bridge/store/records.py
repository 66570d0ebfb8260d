"""The store's records: what goes in (`TurnRecord`, ...) and what comes back (`StoredTurn`, ...).

Frozen, keyword-only dataclasses. Token ids and logprobs are tuples, exactly as sampled; they are
kept as packed little-endian arrays in the database (see `pack_ids` / `pack_floats`), which is
both smaller and faster than JSON and round-trips every float64 bit for bit (inf included).
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from clawbridge.types import SampleState, SamplingParams, TokenLogprob, TurnType

SessionSource = Literal["header", "body", "path", "matched", "new"]
JudgmentKind = Literal["prm", "hint", "feedback"]
JSONObject = dict[str, Any]


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_turn_id() -> str:
    return f"turn-{os.urandom(16).hex()}"


# --- packed arrays ------------------------------------------------------------------------------
# array('i') is 4 bytes and array('d') 8 bytes on every platform CPython supports; the byte order
# is fixed to little-endian so a database file moves between machines.
_SWAP = sys.byteorder == "big"


def pack_ids(ids: Sequence[int]) -> bytes:
    a = array("i", ids)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> tuple[int, ...]:
    a = array("i")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return tuple(a)


def pack_floats(xs: Sequence[float]) -> bytes:
    a = array("d", xs)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack_floats(data: bytes) -> tuple[float, ...]:
    a = array("d")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return tuple(a)


# The user a request is for when it names none (`serving.users`): a single-user install's only one.
DEFAULT_USER = "default"


# --- turns --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TurnRecord:
    """One answered request, as the proxy captured it. `record_turn` assigns its index in the
    session; `tagged` is False when the turn type came from the default setting (so untagged
    traffic is counted, never silent); `train=False` is the client's opt-out."""

    session_id: str
    messages: list[JSONObject]
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    finish_reason: str
    response: JSONObject
    tools: list[JSONObject] | None = None
    request_params: JSONObject = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None
    turn_type: TurnType = "main"
    tagged: bool = True
    train: bool = True
    session_source: SessionSource = "new"
    queued_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    id: str = field(default_factory=new_turn_id)
    created_at: datetime = field(default_factory=utcnow)
    # structural fingerprints of the history it answered and of history + reply (`reply_key`
    # is what a request that continues the conversation starts with): docs/scale-out.md
    prompt_key: bytes | None = None
    reply_key: bytes | None = None
    # the user's standing preferences it was served with, as a system instruction in its prompt
    # (`chat.instructions.instructed`): `messages` are as the client sent them, `prompt_ids` what
    # was rendered with it; the student's view is the prompt rendered from `messages` alone
    instruction: str | None = None
    # the user the request was for: its session's user (the session row keeps it, `user_name`)
    user: str = DEFAULT_USER

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"turn {self.id}: {len(self.completion_ids)} completion tokens but "
                f"{len(self.logprobs)} logprobs"
            )


@dataclass(frozen=True, kw_only=True)
class StoredTurn(TurnRecord):
    """A turn read back: its index in the session and, once the next main request of the
    session arrived, its next state (the user's reply or tool results)."""

    index: int
    next_state: list[JSONObject] | None = None
    next_state_at: datetime | None = None
    judged_kinds: frozenset[str] = frozenset()


# --- sessions -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SessionRow:
    id: str
    source: SessionSource
    created_at: datetime
    updated_at: datetime
    turns: int
    main_turns: int
    done: bool
    done_reason: str | None
    done_at: datetime | None
    user: str = DEFAULT_USER


# --- judgments ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class JudgeVote:
    """One judge call: the raw text, the parsed value (a reward in {-1, 0, 1}, or a hint, or
    None when the vote declined or failed) and the error, if the call failed."""

    raw: str
    value: float | str | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Judgment:
    turn_id: str
    judge: str
    kind: JudgmentKind
    votes: tuple[JudgeVote, ...]
    reward: float | None = None
    hint: str | None = None
    id: int | None = None  # assigned by the store
    created_at: datetime = field(default_factory=utcnow)


# --- samples ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rewrite:
    """A hint-guided rewrite trained beside a turn's own answer: the teacher's answer (the model
    with the hint in its prompt) as token ids, the policy's logprobs of them under the turn's
    own prompt (log pi_old for the ratio), and one advantage per token."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    advantages: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.ids or not len(self.ids) == len(self.logprobs) == len(self.advantages):
            raise ValueError(
                f"a rewrite needs one logprob and one advantage per token, got {len(self.ids)} "
                f"ids, {len(self.logprobs)} logprobs, {len(self.advantages)} advantages"
            )


@dataclass(frozen=True, kw_only=True)
class Sample:
    """A turn turned into a training sample for one method. The token sequences come from the
    turn (exactly as sampled) so the trainer can build a `Datum` without another query."""

    id: int
    turn_id: str
    method: str
    state: SampleState
    reason: str | None
    reward: float | None
    hint: str | None
    teacher_logprobs: tuple[float, ...] | None
    advantages: tuple[float, ...] | None
    version: int
    step: int | None
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    temperature: float
    created_at: datetime
    updated_at: datetime
    rewrite: Rewrite | None = None


# --- training -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainingStep:
    step: int
    version_before: int
    version_after: int
    metrics: JSONObject = field(default_factory=dict)
    samples: int = 0  # filled in by the store from the sample ids it marks
    created_at: datetime = field(default_factory=utcnow)
    user: str = DEFAULT_USER  # whose lineage it trained


@dataclass(frozen=True, kw_only=True)
class PolicyVersionRow:
    version: int
    path: str | None = None
    step: int | None = None
    mean_reward: float | None = None
    samples: int = 0
    created_at: datetime = field(default_factory=utcnow)
    copy_of: int | None = None  # a copy of this version's weights (a rollback, or a candidate given up)
    blend_of: int | None = None  # this held-back candidate's delta, scaled by `blend_alpha` (a blend)
    blend_alpha: float | None = None
    user: str = DEFAULT_USER  # whose adapter it is (v0, the base, begins every user's lineage)


@dataclass(frozen=True, kw_only=True)
class StoreStats:
    """Counts for the status line."""

    sessions: int
    sessions_done: int
    turns: int
    main_turns: int
    side_turns: int
    untagged_turns: int
    opted_out_turns: int
    awaiting_next_state: int
    judged_turns: int
    samples: dict[str, int]
    steps: int
    latest_version: int
