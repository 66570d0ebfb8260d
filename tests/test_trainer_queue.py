"""The training queue never stalls (issue 14): a greedy turn (temperature 0) on a platform that
trains temperature-1 samples only (Tinker, Fireworks) is dropped with its reason and the
version advances; a batch a backend refuses permanently is dropped after a few attempts."""

from __future__ import annotations

from pathlib import Path

import pytest
from clawbridge.backends.tinker import TinkerBackend
from clawbridge.learning.trainer import PERMANENT_FAILURES, Trainer
from clawbridge.protocol import BackendError
from clawbridge.store import Store
from clawbridge.store.records import TurnRecord
from clawbridge.types import SamplingParams
from fakes.fake_tinker import FakeTinkerService
from helpers.cloud import FAST
from helpers.cloud import TINKER_BASE as BASE
from helpers.learning import settings_for


def samples(store: Store, tokenizer, temperatures: list[float]) -> list[int]:
    ids = []
    for i, temp in enumerate(temperatures):
        completion = tuple(tokenizer.encode(f" answer {i}"))
        tid = store.record_turn(TurnRecord(
            session_id=f"q{i}", messages=[{"role": "user", "content": f"question {i}"}],
            prompt_ids=tuple(tokenizer.encode(f"question {i}")), completion_ids=completion,
            logprobs=tuple(-1.0 for _ in completion), version=0, finish_reason="stop",
            response={"role": "assistant", "content": f"answer {i}"}, sampling=SamplingParams(temperature=temp),
        ))
        sid, _ = store.create_sample(tid, "combine", reward=1.0, advantages=(1.0,) * len(completion))
        ids.append(sid)
    return ids


async def test_greedy_turns_on_tinker_are_dropped_with_a_reason_and_training_goes_on(data_dir: Path, tokenizer):
    settings = settings_for(data_dir, batch_size=2)
    store = Store.open(settings.db_url)
    backend = TinkerBackend(service_client=FakeTinkerService(), base_model=BASE, tokenizer=tokenizer, retry=FAST)
    await backend.start()
    try:
        # the two oldest are greedy: today they made every step fail, for ever
        ids = samples(store, tokenizer, [0.0, 0.0, 1.0, 1.0])
        trainer = Trainer(settings.training, backend, store)
        result = await trainer.step_once()
        assert result is not None and result.version == 1
        got = {s.id: s for s in store.get_samples(ids)}
        assert [got[i].state for i in ids] == ["dropped", "dropped", "trained", "trained"]
        assert "temperature 0" in (got[ids[0]].reason or "") and "Tinker" in (got[ids[0]].reason or "")
        assert trainer.dropped_untrainable == 2
    finally:
        await backend.close()
        store.close()


async def test_a_batch_refused_permanently_is_dropped_and_the_queue_moves(data_dir: Path, tokenizer):
    settings = settings_for(data_dir, batch_size=2)
    store = Store.open(settings.db_url)
    backend = TinkerBackend(service_client=FakeTinkerService(), base_model=BASE, tokenizer=tokenizer, retry=FAST)
    await backend.start()
    try:
        ids = samples(store, tokenizer, [1.0] * 4)
        real = backend.train_step
        poisoned = set(ids[:2])

        async def refuse_poisoned(batch, *a, **kw):  # type: ignore[no-untyped-def]
            if any(d.prompt_ids == tuple(tokenizer.encode("question 0")) for d in batch):
                raise BackendError("the platform refuses this datum (permanently)")
            return await real(batch, *a, **kw)

        backend.train_step = refuse_poisoned  # type: ignore[method-assign]
        trainer = Trainer(settings.training, backend, store)
        for _ in range(PERMANENT_FAILURES):
            with pytest.raises(BackendError):
                await trainer.step_once()
        result = await trainer.step_once()
        assert result is not None and result.version == 1
        got = {s.id: s for s in store.get_samples(ids)}
        assert {i for i in ids if got[i].state == "dropped"} == poisoned
        assert "failed 3 times" in (got[ids[0]].reason or "")
    finally:
        await backend.close()
        store.close()
