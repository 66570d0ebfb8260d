"""Settings, a collector and stored turns for the learning loop's tests (tiny random model, rules
judge, real SQLite store)."""

from __future__ import annotations

from pathlib import Path

from clawbridge.chat.renderer import Renderer
from clawbridge.config import Settings
from clawbridge.learning.collector import Collector
from clawbridge.local_gpu import models
from clawbridge.protocol import Backend
from clawbridge.server import build_learning
from clawbridge.store import Store, TurnRecord

REPLIES = ["Thanks, that's perfect.", "Too long. Please answer in one short sentence.", "ok"]


def settings_for(data_dir: Path, **kw: object) -> Settings:
    base: dict[str, object] = dict(model="tiny-random", data_dir=data_dir, judge="rules",
                                   method="combine", batch_size=2, lora_rank=4, lora_alpha=4)
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


def collector_for(settings: Settings, backend: Backend, store: Store) -> Collector:
    """The collector as the composition root wires it (its judges, the teacher, one renderer)."""
    return build_learning(settings, backend, store, Renderer(backend.tokenizer())).collector


def record_turns(store: Store, n: int) -> list[str]:
    """n main turns of n sessions, each with the user's reply attached as its next state."""
    tok = models.load_tokenizer(models.resolve(models.TINY))
    renderer = Renderer(tok)
    ids = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question number {i}?"}]
        completion = tuple(tok.encode(f" An answer to question {i}."))
        rec = TurnRecord(
            session_id=f"s{i}", messages=messages, prompt_ids=tuple(renderer.render(messages)),
            completion_ids=completion, logprobs=tuple(-1.5 for _ in completion), version=0,
            finish_reason="stop", response={"role": "assistant", "content": f"An answer to question {i}."},
        )
        tid = store.record_turn(rec)
        store.attach_next_state(tid, [{"role": "user", "content": REPLIES[i % len(REPLIES)]}])
        ids.append(tid)
    return ids


def judged_samples(store: Store, n: int, method: str = "combine") -> list[int]:
    """n recorded turns (`record_turns`), each with a sample judged +1 / -1 in turn."""
    ids = []
    for tid in record_turns(store, n):
        turn = store.get_turn(tid)
        assert turn is not None
        reward = 1.0 if len(ids) % 2 == 0 else -1.0
        sid, _ = store.create_sample(tid, method, reward=reward, advantages=(reward,) * len(turn.completion_ids))
        ids.append(sid)
    return ids


def record_priorities(backend: Backend) -> list[str]:
    """The priority of every `backend.sample` call from now on, in order (the backend still samples)."""
    priorities: list[str] = []
    real_sample = backend.sample

    async def sampled(*args, priority="user", **kwargs):  # type: ignore[no-untyped-def]
        priorities.append(priority)
        return await real_sample(*args, priority=priority, **kwargs)

    backend.sample = sampled  # type: ignore[method-assign]
    return priorities
