"""The trainer recipe: batches -> train_step -> publish -> one store transaction; stale samples
dropped with a reason; checkpoints and --resume; and serving through the real HTTP server that
never fails a request while versions are published under concurrent load."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.learning.learner import Learner
from clawbridge.learning.promotion import CHECKPOINT_KEY, Resumed, next_step_number, resume
from clawbridge.learning.trainer import Trainer, step_record, warmed
from clawbridge.server import learner_hooks, learner_task
from clawbridge.store import Store
from clawbridge.types import OptimSpec, StepMetrics
from helpers.learning import judged_samples, settings_for
from live_server import LiveServer


def test_step_record_summarises_the_batch():
    m = StepMetrics(loss=0.5, clip_fraction=0.1, approx_kl=0.01, grad_norm=2.0, tokens=10, samples=2, seconds=1.0)

    class S:  # the fields step_record reads
        def __init__(self, reward: float, adv: tuple[float, ...], hint: str | None, rewrite: object = None) -> None:
            self.reward, self.advantages, self.hint, self.rewrite = reward, adv, hint, rewrite

    rec = step_record(m, [S(1.0, (1.0, 1.0), None), S(-1.0, (-1.0, 0.0), "shorter", "a rewrite")])  # type: ignore[list-item]
    assert rec["mean_reward"] == 0.0 and rec["mean_advantage"] == 0.25 and rec["hinted"] == 1.0
    assert rec["rewrites"] == 1.0
    assert rec["loss"] == 0.5 and rec["tokens"] == 10.0


def test_the_rate_ramps_up_over_the_warmup_after_a_fresh_optimizer():
    o = OptimSpec(learning_rate=3e-3, grad_clip_norm=0.5)
    assert [warmed(o, k, 3).learning_rate for k in (1, 2, 3, 4)] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])
    assert warmed(o, 1, 3).grad_clip_norm == 0.5  # only the rate changes
    assert warmed(o, 1, 0) == o and warmed(o, 1, 1) == o  # no warmup


async def test_every_fresh_optimizer_warms_up_again_and_the_rate_is_recorded(data_dir: Path):
    """A new run, then a rollback (a fresh optimizer, as a gate's hold-back is): each step's
    rate reaches the engine's optimizer and the step's stored metrics."""
    settings = settings_for(data_dir, batch_size=1, learning_rate=3e-3, warmup_steps=3, checkpoint_every=100,
                            max_staleness=100)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        judged_samples(store, 5)
        trainer = Trainer(settings.training, backend, store)
        rates = []
        for _ in range(4):
            await trainer.step_once()
            rates.append(backend.engine._optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]
        await trainer.promotion.rollback(2)
        await trainer.step_once()
        rates.append(backend.engine._optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]
        assert rates == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3, 1e-3])
        assert [s.metrics["learning_rate"] for s in store.training_steps()] == pytest.approx(rates)
    finally:
        await backend.close()
        store.close()


@pytest.mark.timeout(280)
def test_the_learner_trains_on_at_the_full_rate_after_serve_resumed_a_checkpoint(data_dir: Path):
    """A checkpoint brings the optimizer's moments back: after `serve` resumed from one, the
    learner's own trainer (the one the composition root built) trains at the full rate, not at
    the first rate of a warmup."""
    settings = settings_for(data_dir, batch_size=1, learning_rate=3e-3, warmup_steps=3, checkpoint_every=1,
                            max_staleness=100)

    async def first_step() -> None:
        store = Store.open(settings.db_url)
        backend = LocalBackend.from_settings(settings)
        await backend.start()
        try:
            judged_samples(store, 2)
            assert (await Trainer(settings.training, backend, store).step_once()) is not None
            assert store.get_meta(CHECKPOINT_KEY)["version"] == 1  # the resume point: v1 and its optimizer
        finally:
            await backend.close()
            store.close()

    asyncio.run(first_step())
    learner = Learner(settings, poll_s=0.1)
    live = LiveServer(settings, LocalBackend.from_settings(settings), hooks=learner_hooks(learner)).start()
    assert live.loop is not None and live.running is not None
    task = asyncio.run_coroutine_threadsafe(learner_task(learner)(live.running), live.loop)
    try:
        store = live.running.store
        deadline = time.monotonic() + 120
        while len(store.training_steps()) < 2:
            assert time.monotonic() < deadline and not task.done(), "the learner did not train the second sample"
            time.sleep(0.1)
        assert [s.metrics["learning_rate"] for s in store.training_steps()] == pytest.approx([1e-3, 3e-3])
    finally:
        live.loop.call_soon_threadsafe(task.cancel)
        live.stop()


async def test_a_full_batch_trains_publishes_and_checkpoints_then_resumes(data_dir: Path):
    settings = settings_for(data_dir, batch_size=3, checkpoint_every=1)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        ids = judged_samples(store, 4)
        trainer = Trainer(settings.training, backend, store)
        result = await trainer.step_once()
        assert result is not None and result.version == 1 and result.samples == 3
        assert await trainer.step_once() is None  # one sample left: not a full batch
        assert [s.state for s in store.get_samples(ids)] == ["trained"] * 3 + ["judged"]
        [step] = store.training_steps()
        assert (step.step, step.version_before, step.version_after, step.samples) == (1, 0, 1, 3)
        assert step.metrics["tokens"] > 0 and "loss" in step.metrics
        [v] = store.versions()
        assert v.version == 1 and v.step == 1 and v.samples == 3 and v.path
        ck = store.get_meta(CHECKPOINT_KEY)
        assert ck["step"] == 1 and ck["version"] == 1 and Path(ck["path"]).exists()
    finally:
        await backend.close()

    fresh = LocalBackend.from_settings(settings)
    await fresh.start()
    try:
        assert await resume(fresh, store) == Resumed(ck["path"], optimizer=True)
        assert fresh.version == 1 and await next_step_number(store) == 2
    finally:
        await fresh.close()
        store.close()


async def test_a_rollback_is_a_new_version_recorded_and_checkpointed_so_resume_continues_from_it(data_dir: Path):
    from clawbridge.cli.status import version_origin
    settings = settings_for(data_dir, batch_size=2, checkpoint_every=1)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    prompt, completion = (1, 520, 3121, 28), (17, 401, 2032)
    try:
        judged_samples(store, 4)
        trainer = Trainer(settings.training, backend, store)
        assert (await trainer.step_once()).version == 1  # type: ignore[union-attr]
        v1 = await backend.score(prompt, completion)
        assert (await trainer.step_once()).version == 2  # type: ignore[union-attr]
        rb = await trainer.promotion.rollback(1)
        assert (rb.version, rb.restored, rb.previous) == (3, 1, 2)
        rows = {r.version: r for r in store.versions()}
        assert rows[3].step is None and rows[3].samples == 0 and rows[3].path == rb.path
        assert store.history().copies == {3: 1} and rows[3].copy_of == 1
        assert [version_origin(rows[v]) for v in (1, 2, 3)] == ["1", "2", "rollback of v1"]
        ck = store.get_meta(CHECKPOINT_KEY)
        assert (ck["version"], ck["step"], ck["path"]) == (3, 2, rb.checkpoint)
    finally:
        await backend.close()

    fresh = LocalBackend.from_settings(settings)
    await fresh.start()
    try:
        await resume(fresh, store)
        assert fresh.version == 3 and await next_step_number(store) == 3
        assert await fresh.score(prompt, completion) == pytest.approx(v1, abs=1e-6)
    finally:
        await fresh.close()
        store.close()


async def test_a_rollback_asked_for_during_a_step_waits_for_the_step_to_publish(data_dir: Path):
    """Whatever the timing: the training step holds the lock from train_step to publish, and a
    rollback asked for meanwhile runs after it (not between its update and its publish)."""
    settings = settings_for(data_dir, batch_size=2)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    calls: list[str] = []
    gate = asyncio.Event()
    train_step, rollback = backend.train_step, backend.rollback

    async def held_train_step(*a: Any, **kw: Any) -> Any:
        calls.append("train_step")
        await gate.wait()
        return await train_step(*a, **kw)

    async def noted_rollback(version: int) -> Any:
        calls.append("rollback")
        return await rollback(version)

    backend.train_step, backend.rollback = held_train_step, noted_rollback  # type: ignore[method-assign]
    try:
        judged_samples(store, 2)
        trainer = Trainer(settings.training, backend, store)
        step = asyncio.create_task(trainer.step_once())
        while not calls:
            await asyncio.sleep(0.01)
        back = asyncio.create_task(trainer.promotion.rollback(0))
        await asyncio.sleep(0.2)
        assert calls == ["train_step"] and not back.done()  # the rollback waits on the lock
        gate.set()
        assert (await step).version == 1  # type: ignore[union-attr]
        assert (await back).version == 2 and calls == ["train_step", "rollback"]
    finally:
        await backend.close()
        store.close()


async def test_samples_older_than_max_staleness_are_dropped_with_the_reason(data_dir: Path):
    settings = settings_for(data_dir, batch_size=2, max_staleness=0)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        ids = judged_samples(store, 3)
        trainer = Trainer(settings.training, backend, store)
        assert (await trainer.step_once()) is not None  # trains 2 of the v0 samples -> v1
        assert await trainer.step_once() is None  # the third (from v0) is now too old
        [left] = [s for s in store.get_samples(ids) if s.state != "trained"]
        assert left.state == "dropped" and left.reason == "stale" and trainer.dropped_stale == 1
    finally:
        await backend.close()
        store.close()


@pytest.mark.timeout(280)
def test_no_request_fails_while_versions_are_published_under_concurrent_load(tmp_path: Path):
    settings = settings_for(tmp_path / "data", batch_size=2, default_max_tokens=8)
    (tmp_path / "data").mkdir()
    learner = Learner(settings)
    backend = LocalBackend.from_settings(settings)
    live = LiveServer(settings, backend, hooks=learner_hooks(learner)).start()
    assert live.running is not None
    store = live.running.store
    judged_samples(store, 6)
    statuses: list[int] = []
    versions: set[str] = set()
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as h:
            i = 0
            while not stop.is_set():
                stream = (k + i) % 2 == 1
                body = {"model": "tiny-random", "max_tokens": 8, "stream": stream,
                        "messages": [{"role": "user", "content": f"load {k} {i}"}]}
                r = h.post(f"{live.url}/v1/chat/completions", json=body, headers={"X-Train": "false"})
                statuses.append(r.status_code)
                if r.status_code == 200 and not stream:
                    versions.add(r.json().get("system_fingerprint", ""))
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        default = live.running.lineages.default  # type: ignore[union-attr]  # as the server's learner trains
        trainer = Trainer(settings.training, default.backend, default.store)  # type: ignore[arg-type]
        published = []
        for _ in range(3):
            result = live.call(trainer.step_once(), timeout=120)
            assert result is not None
            published.append(result.version)
            live.call(asyncio.sleep(0.5))
        deadline = time.monotonic() + 90  # let the clients run on the newest version too
        while len(statuses) < 12 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        live.stop()
    assert published == [1, 2, 3]
    assert statuses and set(statuses) == {200}, f"non-200 answers: {[s for s in statuses if s != 200]}"
    assert len(statuses) >= 8
    assert len(versions - {""}) >= 2  # requests were served by more than one version
