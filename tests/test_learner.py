"""The learner's two loops beside a live server: woken by events, not by polling (a next state
wakes the collector, settled samples wake the trainer), and closing the judges' HTTP clients
however they end."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
from clawbridge.backends.local import LocalBackend
from clawbridge.config import Settings
from clawbridge.learning.learner import Learner
from clawbridge.server import bind_learner, build_backend, learner_hooks, learner_task
from clawbridge.store import Store
from live_server import LiveServer

MODEL = "tiny-random"


def test_a_next_state_trains_at_once_though_the_learners_clock_is_a_minute(tmp_path: Path):
    settings = Settings(model=MODEL, data_dir=tmp_path, default_max_tokens=6, batch_size=1, method="binary",
                        judge="rules", gate="off", port=0)
    learner = Learner(settings, poll_s=60)  # a polling loop would wait up to a minute between looks
    server = LiveServer(settings, build_backend(settings), hooks=learner_hooks(learner)).start()
    assert server.loop is not None and server.running is not None
    task = asyncio.run_coroutine_threadsafe(learner_task(learner)(server.running), server.loop)
    try:
        time.sleep(1)  # both loops are waiting now
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        with httpx.Client(base_url=server.url, timeout=60, headers={"X-Session-Id": "wake-1"}) as h:
            r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
            assert r.status_code == 200, r.text
            messages += [r.json()["choices"][0]["message"],
                         {"role": "user", "content": "No, that is wrong: it is Paris."}]
            t0 = time.monotonic()
            assert h.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}).status_code == 200
        while learner.last_step is None:  # judged (the rules judge: -1), then one step of one sample
            assert time.monotonic() - t0 < 45, "no step: the loops did not wake"
            time.sleep(0.1)
        assert learner.last_step.samples == 1 and task.done() is False
    finally:
        server.loop.call_soon_threadsafe(task.cancel)
        server.stop()


async def test_the_learner_closes_its_judges_clients_when_it_is_cancelled(tmp_path: Path):
    settings = Settings(model=MODEL, data_dir=tmp_path, judge_url="http://127.0.0.1:9/v1", judge_model="judge",
                        gate="off")
    store = Store.open(settings.db_url)
    learner = Learner(settings, poll_s=0.05)
    bind_learner(learner, LocalBackend.from_settings(settings), store)  # not started: nothing to score
    assert learner.parts is not None
    client = learner.parts.judges.reward.client._client  # type: ignore[attr-defined]
    assert learner.parts.judges.hint.client._client is client  # type: ignore[attr-defined]  # one pool
    task = asyncio.create_task(learner.run())
    await asyncio.sleep(0.3)
    assert not task.done() and not client.is_closed
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert client.is_closed
    store.close()


async def test_the_learner_says_what_it_does_on_the_engine(tmp_path: Path):
    """`/v1/status` names the learner's work beside the user's requests (a benchmark splits a
    request's latency by it): "training" while the step's datums and train_step run, "judging"
    while its candidate is reviewed and gated, nothing once the step is done."""
    from clawbridge.chat.renderer import Renderer
    from clawbridge.server import build_learning
    from helpers.learning import record_turns, settings_for

    settings = settings_for(tmp_path, gate="on", gate_probes=2, gate_probes_max=2)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    store = Store.open(settings.db_url)
    try:
        learner = Learner(settings)
        learner.bind(build_learning(settings, backend, store, Renderer(backend.tokenizer())))
        trainer = learner.trainer
        assert trainer is not None and learner.busy() == [] and "busy" not in learner.status()
        record_turns(store, 4)
        assert learner.collector is not None and await learner.collector.run_once() > 0
        seen: list[str] = []
        train_step, promote = backend.train_step, trainer.promotion.promote

        async def training(*a, **kw):  # the real step; what the learner says meanwhile is noted
            seen.append(learner.status()["busy"])
            return await train_step(*a, **kw)

        async def judging(*a, **kw):
            seen.append(learner.status()["busy"])
            return await promote(*a, **kw)

        backend.train_step, trainer.promotion.promote = training, judging  # type: ignore[method-assign]
        assert await trainer.step_once() is not None
        assert seen == ["training", "judging"] and learner.busy() == []
    finally:
        store.close()
        await backend.close()
