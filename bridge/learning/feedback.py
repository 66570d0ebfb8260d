"""Explicit feedback for SDK users: `POST /v1/feedback` (docs/design.md#judges).

    {"session_id": "...", "turn_id": null, "reward": 1, "hint": null}

A reward in [-1, +1] (-1, 0, +1 or a graded value between) and/or a hint for one turn:
`turn_id`, or else the session's last main turn. Stored as a judgment of kind `feedback` (judge
`user`) with the request as its raw vote; the collector lets it outrank the judges, used alongside them or instead (a turn with no next state
is trained from feedback alone). One feedback per turn: a second answers 409. A turn of an
episode (`learning.episodes`) is trained by its group's outcomes, not by a feedback reward; a
feedback hint on it adds the OPD term there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clawbridge.store import JudgeVote, Judgment
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from clawbridge.store import Store
    from clawbridge.types import Method

USER_JUDGE = "user"


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(None, description="The session (or header X-Session-Id).")
    turn_id: str | None = Field(None, description="The turn; default: the session's last main turn.")
    reward: float | None = Field(None, ge=-1, le=1, allow_inf_nan=False, description="In [-1, +1]: -1, 0 or +1, or any value between (a graded score).")
    hint: str | None = Field(None, min_length=1, max_length=4000, description="What the answer should have done.")

    @model_validator(mode="after")
    def _something(self) -> FeedbackRequest:
        if self.reward is None and self.hint is None:
            raise ValueError("give a reward, a hint, or both")
        if self.session_id is None and self.turn_id is None:
            raise ValueError("give a session_id (or X-Session-Id) or a turn_id")
        return self


class FeedbackRejected(Exception):
    """Feedback that cannot be recorded; `status`, `param` and `code` say how (the HTTP route
    answers them as an OpenAI-style error)."""

    def __init__(self, status: int, message: str, *, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


async def record_feedback(
    store: Store, method: Method, fb: FeedbackRequest, *, replay: bool = False
) -> dict[str, Any]:
    """Store the feedback and its turn's sample. `replay`: the feedback was spooled while the
    store was down and is replayed; the same feedback found stored is a replay that landed
    before (its sample is then made sure of), not a duplicate."""
    if fb.turn_id is not None:
        turn = await store.run(store.get_turn, fb.turn_id)
        if turn is not None and fb.session_id is not None and turn.session_id != fb.session_id:
            turn = None
    else:
        assert fb.session_id is not None
        turn = await store.run(store.last_turn, fb.session_id, "main")
    if turn is None:
        what = f"turn `{fb.turn_id}`" if fb.turn_id else f"main turn in session `{fb.session_id}`"
        raise FeedbackRejected(404, f"No {what}.", param="turn_id" if fb.turn_id else "session_id", code="not_found")
    if not turn.train:
        raise FeedbackRejected(400, f"Turn `{turn.id}` opted out of training (X-Train: false).", param="turn_id")
    before = await store.run(store.judgments, turn.id)
    raw = fb.model_dump_json(exclude_none=True)
    mine = [j for j in before if j.kind == "feedback" and j.judge == USER_JUDGE]
    if mine and not (replay and any(v.raw == raw for j in mine for v in j.votes)):
        raise FeedbackRejected(409, f"Turn `{turn.id}` already has feedback.", param="turn_id", code="duplicate_feedback")
    value: float | str | None = fb.reward if fb.reward is not None else fb.hint
    if not mine:
        await store.run(
            store.add_judgment,
            Judgment(
                turn_id=turn.id, judge=USER_JUDGE, kind="feedback",
                votes=(JudgeVote(raw=raw, value=value),),
                reward=None if fb.reward is None else float(fb.reward), hint=fb.hint,
            ),
        )
    episode = await store.run(store.episode_of_turn, turn.id, turn.session_id)
    if episode is not None:
        # an episode's turn trains from its group's outcomes; a hint joins them (learning.episodes)
        return {"object": "feedback", "session_id": turn.session_id, "turn_id": turn.id,
                "reward": fb.reward, "hint": fb.hint, "sample": None, "episode": episode.id}
    sample_id, created = await store.run(store.create_sample, turn.id, method, state="pending")
    state = (await store.run(store.get_samples, [sample_id]))[0].state
    return {
        "object": "feedback",
        "session_id": turn.session_id,
        "turn_id": turn.id,
        "reward": fb.reward,
        "hint": fb.hint,
        "sample": {"id": sample_id, "method": method, "state": state, "new": created},
    }
