"""Between records and rows: JSON for the database, packed arrays, and decoding rows back
into the store's frozen records."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from clawbridge.store.records import (
    JSONObject,
    JudgeVote,
    Judgment,
    Rewrite,
    Sample,
    StoredTurn,
    TurnRecord,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)
from clawbridge.types import SamplingParams, TokenLogprob


def dumps(obj: Any) -> str:
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (JSON allows "\ud800"; clients send them) cannot be stored as UTF-8:
        # escape everything rather than lose the turn.
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)
    return text


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def sampling_from_json(d: JSONObject) -> SamplingParams:
    kw = {k: v for k, v in d.items() if k in SAMPLING_FIELDS}
    for k in ("stop", "stop_token_ids"):
        if k in kw:
            kw[k] = tuple(kw[k])
    return SamplingParams(**kw)


def top_to_json(top: Sequence[Sequence[TokenLogprob]] | None) -> list[Any] | None:
    if top is None:
        return None
    return [[[c.token_id, c.logprob] for c in alts] for alts in top]


def top_from_json(data: list[Any] | None) -> tuple[tuple[TokenLogprob, ...], ...] | None:
    if data is None:
        return None
    return tuple(tuple(TokenLogprob(int(i), float(lp)) for i, lp in alts) for alts in data)


def turn_from_row(r: Any, judged: frozenset[str], messages: list[JSONObject]) -> StoredTurn:
    """A turn row back as a record; `messages` is its whole list (see `Store._whole_messages`)."""
    return StoredTurn(
        id=r.id,
        session_id=r.session_id,
        session_source=r.session_source,
        index=r.idx,
        turn_type=r.turn_type,
        tagged=r.tagged,
        train=r.train,
        messages=messages,
        tools=r.tools,
        request_params=r.request_params,
        prompt_ids=unpack_ids(r.prompt_ids),
        completion_ids=unpack_ids(r.completion_ids),
        logprobs=unpack_floats(r.logprobs),
        top_logprobs=top_from_json(r.top_logprobs),
        sampling=sampling_from_json(r.sampling),
        version=r.version,
        finish_reason=r.finish_reason,
        response=r.response,
        queued_ms=r.queued_ms,
        ttft_ms=r.ttft_ms,
        total_ms=r.total_ms,
        created_at=r.created_at,
        prompt_key=r.prompt_key,
        reply_key=r.reply_key,
        instruction=r.instruction,
        user=r.user,
        next_state=r.next_state,
        next_state_at=r.next_state_at,
        judged_kinds=judged,
    )


def judgment_from_row(r: Any) -> Judgment:
    return Judgment(
        id=r.id,
        turn_id=r.turn_id,
        judge=r.judge,
        kind=r.kind,
        votes=tuple(JudgeVote(**v) for v in r.votes),
        reward=r.reward,
        hint=r.hint,
        created_at=r.created_at,
    )


def sample_from_row(r: Any) -> Sample:
    return Sample(
        id=r.id,
        turn_id=r.turn_id,
        method=r.method,
        state=r.state,
        reason=r.reason,
        reward=r.reward,
        hint=r.hint,
        teacher_logprobs=None if r.teacher_logprobs is None else unpack_floats(r.teacher_logprobs),
        advantages=None if r.advantages is None else unpack_floats(r.advantages),
        version=r.version,
        step=r.step,
        prompt_ids=unpack_ids(r.prompt_ids),
        completion_ids=unpack_ids(r.completion_ids),
        logprobs=unpack_floats(r.logprobs),
        temperature=float(r.sampling.get("temperature", 1.0)),
        created_at=r.created_at,
        updated_at=r.updated_at,
        rewrite=None if r.rewrite_ids is None else Rewrite(
            unpack_ids(r.rewrite_ids), unpack_floats(r.rewrite_logprobs), unpack_floats(r.rewrite_advantages)
        ),
    )


def turn_row(
    rec: TurnRecord, idx: int, base: str | None = None, keep: int = 0
) -> dict[str, Any]:
    """The row of a turn; with a `base`, only the messages after the `keep` it shares."""
    return {
        "id": rec.id,
        "session_id": rec.session_id,
        "idx": idx,
        "turn_type": rec.turn_type,
        "tagged": rec.tagged,
        "train": rec.train,
        "messages_base": base,
        "messages_keep": keep if base is not None else 0,
        "messages": rec.messages[keep:] if base is not None else rec.messages,
        "tools": rec.tools,
        "request_params": rec.request_params,
        "prompt_ids": pack_ids(rec.prompt_ids),
        "completion_ids": pack_ids(rec.completion_ids),
        "logprobs": pack_floats(rec.logprobs),
        "top_logprobs": top_to_json(rec.top_logprobs),
        "n_prompt": len(rec.prompt_ids),
        "n_completion": len(rec.completion_ids),
        "sampling": {k: getattr(rec.sampling, k) for k in SAMPLING_FIELDS},
        "version": rec.version,
        "finish_reason": rec.finish_reason,
        "response": rec.response,
        "queued_ms": rec.queued_ms,
        "ttft_ms": rec.ttft_ms,
        "total_ms": rec.total_ms,
        "created_at": rec.created_at,
        "prompt_key": rec.prompt_key,
        "reply_key": rec.reply_key,
        "instruction": rec.instruction,
    }


def pack_opt(xs: Sequence[float] | None) -> bytes | None:
    return None if xs is None else pack_floats(xs)
