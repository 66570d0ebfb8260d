"""Shared by the page's tests and its benchmark: turns written to a real store the way the proxy
and the learning loop write them, and a Starlette app served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import uvicorn
from clawbridge.store import JudgeVote, Judgment, PolicyVersionRow, Store, TrainingStep, TurnRecord


def turn(session: str, ask: str, answer: str, *, version: int = 0, at: datetime | None = None,
         turn_type: str = "main", train: bool = True, history: list[dict[str, Any]] | None = None) -> TurnRecord:
    messages = [*(history or []), {"role": "user", "content": ask}]
    return TurnRecord(session_id=session, messages=messages, prompt_ids=(1, 2, 3), completion_ids=(4, 5),
                      logprobs=(-0.5, -0.25), version=version, finish_reason="stop",
                      response={"role": "assistant", "content": answer}, turn_type=turn_type,  # type: ignore[arg-type]
                      train=train, created_at=at or datetime.now(UTC))


def judge(store: Store, turn_id: str, reward: float, hint: str | None = None, state: str = "judged",
          reason: str | None = None, step: int | None = None) -> int:
    """A PRM judgment with three votes and the turn's sample in `state`, as the collector leaves them."""
    votes = tuple(JudgeVote(raw=f"\\boxed{{{int(reward)}}}", value=reward) for _ in range(3))
    store.add_judgment(Judgment(turn_id=turn_id, judge="rules", kind="prm", votes=votes, reward=reward))
    if hint is not None:
        store.add_judgment(Judgment(turn_id=turn_id, judge="rules", kind="hint", votes=(JudgeVote(raw=hint, value=hint),),
                                    hint=hint))
    if state == "dropped":
        sid, _ = store.create_sample(turn_id, "combine", state="dropped", reward=reward, reason=reason)
        return sid
    sid, _ = store.create_sample(turn_id, "combine", state="pending" if state == "pending" else "judged",
                                 reward=reward, hint=hint, advantages=None if state == "pending" else (reward, reward))
    if state == "trained":
        assert step is not None
        store.record_training_step(TrainingStep(step=step, version_before=step - 1, version_after=step,
                                                metrics={"loss": 0.1}), [sid],
                                   PolicyVersionRow(version=step, step=step, samples=1))
    return sid


def seed_store(store: Store, n: int, *, start: datetime | None = None, per_session: int = 4) -> list[str]:
    """n judged turns in sessions of `per_session`, one second apart, rewards cycling +1, 0, -1."""
    start = start or datetime(2026, 11, 25, 8, 0, tzinfo=UTC)
    ids = []
    for i in range(n):
        rec = turn(f"s{i // per_session}", f"question {i}", f"answer {i}", at=start + timedelta(seconds=i))
        tid = store.record_turn(rec)
        store.attach_next_state(tid, [{"role": "user", "content": f"reply {i}"}])
        judge(store, tid, (1.0, 0.0, -1.0)[i % 3], hint="be brief" if i % 3 == 2 else None)
        ids.append(tid)
    return ids


class Served:
    """An ASGI app under uvicorn on 127.0.0.1 (a free port), in a thread, until `stop()`."""

    def __init__(self, app: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the app did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
