"""The user first (docs/engine.md#the-user-first), on the real engine with the tiny model: a
user's request goes ahead of background sampling already queued or running, a background row
paused for it resumes with the tokens it draws alone, a train step waits between micro-batches
while a user's request runs, and a request over HTTP is a user's. Each fails with the engine's
`user_first` off (arrival order). And the learner is not starved: users who never pause leave it
its share of the engine (`background_share`), which a share of 0 withholds."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.config import Settings
from clawbridge.local_gpu import scheduling
from clawbridge.server import build_backend
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams
from live_server import LiveServer

PROMPT = (1, 520, 3121, 28, 1830, 446, 17, 905)
LONG = SamplingParams(max_tokens=120, temperature=0.8, seed=11, stop_token_ids=())
SHORT = SamplingParams(max_tokens=4, seed=3)


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()  # the engine's setting is process-wide: restored
    yield
    torch.set_num_threads(before)


def started(tmp_path: Path, **kw: Any) -> LocalBackend:
    backend = LocalBackend("tiny-random", tmp_path, lora_rank=4, lora_alpha=4, threads=1, **kw)
    backend.engine.start()
    return backend


async def in_order_of_finishing(named: dict[str, Awaitable[Any]]) -> tuple[list[str], dict[str, Any]]:
    """Start `named`'s awaitables in turn (each queued after the one before); the names in the
    order they finish, and their results."""
    order: list[str] = []
    results: dict[str, Any] = {}

    async def run(name: str, work: Awaitable[Any]) -> None:
        results[name] = await work
        order.append(name)

    tasks = []
    for name, work in named.items():
        tasks.append(asyncio.ensure_future(run(name, work)))
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    return order, results


async def test_a_users_request_sent_after_background_ones_finishes_before_them(tmp_path, threads) -> None:
    """Four rows, all taken by background requests and four more waiting: the user's request,
    sent last, is admitted at the next step (a background row paused for it) and done first."""
    backend = started(tmp_path, max_batch=4)
    try:
        background = {f"b{i}": backend.sample(PROMPT, LONG, priority="background") for i in range(8)}
        order, _ = await in_order_of_finishing({**background, "user": backend.sample(PROMPT, SHORT)})
        assert order[0] == "user"
    finally:
        backend.engine.close()


async def test_a_paused_background_request_resumes_with_the_tokens_it_draws_alone(tmp_path, threads) -> None:
    """One row: the user's request runs only by pausing the background one, which then resumes
    from its prompt and what it drew (one prefill) as if it had never stopped."""
    backend = started(tmp_path, max_batch=1)
    try:
        (alone,) = await backend.sample(PROMPT, LONG, priority="background")
        order, results = await in_order_of_finishing(
            {"background": backend.sample(PROMPT, LONG, priority="background"), "user": backend.sample(PROMPT, SHORT)}
        )
        assert order == ["user", "background"]
        (resumed,) = results["background"]
        assert resumed.tokens == alone.tokens
        assert max(abs(a - b) for a, b in zip(resumed.logprobs, alone.logprobs, strict=True)) < 1e-4
    finally:
        backend.engine.close()


async def test_a_train_step_waits_between_micro_batches_while_a_users_request_runs(tmp_path, threads) -> None:
    """A step of 80 micro-batches (one datum each): a user's request sent while it trains is
    answered before the step ends, and the step's result is the step's alone."""
    backend = started(tmp_path, train_token_budget=16)
    try:
        (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=8, seed=1, stop_token_ids=()))
        batch = [Datum(PROMPT, c.tokens, c.logprobs, (0.5,) * len(c.tokens))] * 80
        order, results = await in_order_of_finishing(
            {"step": backend.train_step(batch, LossSpec(), OptimSpec(learning_rate=0.0)),
             "user": backend.sample(PROMPT, SHORT)}
        )
        assert order == ["user", "step"]
        assert results["step"].samples == 80
    finally:
        backend.engine.close()


def test_a_request_over_http_goes_ahead_of_background_sampling(tmp_path, threads) -> None:
    """The serving path is a user's: with one row taken by the learner's sampling and more of it
    waiting, a chat completion is answered first."""
    settings = Settings(model="tiny-random", port=0, data_dir=tmp_path, train=False, engine_max_batch=1)
    backend = build_backend(settings)
    server = LiveServer(settings, backend).start()
    longer = SamplingParams(max_tokens=400, temperature=0.8, seed=11, stop_token_ids=())

    async def go() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")

        def chat() -> Awaitable[Any]:
            return client.chat.completions.create(
                model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=4)

        await chat()  # the server's first request pays for what is built once
        background = {f"b{i}": backend.sample(PROMPT, longer, priority="background") for i in range(3)}
        order, _ = await in_order_of_finishing({**background, "user": chat()})
        await client.close()
        return order

    try:
        assert asyncio.run(go())[0] == "user"
    finally:
        server.stop()


@pytest.mark.parametrize("share", [0.25, 0.0])
async def test_users_who_never_pause_leave_the_learner_its_share(tmp_path, threads, share) -> None:
    """Two users' requests always in flight (each sent as the one before it ends, of two lengths,
    so that they rarely end together), and once a second both between two requests at once for a
    client's round trip, as two such users are now and then: background sampling still finishes
    with a share of the engine (a round trip without a user's request does not restart the
    learner's patience), and never does with none (it draws a token or two in each round trip)."""
    backend = started(tmp_path, max_batch=4, background_share=share)
    try:
        await backend.sample(PROMPT, SHORT)  # what is built once, paid before the clock starts
        learner = asyncio.ensure_future(backend.sample(PROMPT, LONG, priority="background"))
        loop = asyncio.get_running_loop()
        stop = loop.time() + 15.0  # the learner's first burst comes after PATIENCE_S
        served = 0

        async def user(length: int, until: float) -> None:
            nonlocal served
            while not learner.done() and loop.time() < until:
                await backend.sample(PROMPT, SamplingParams(max_tokens=length, seed=served, stop_token_ids=()))
                served += 1

        await asyncio.sleep(0.05)  # the learner's request is running when the users come
        while not learner.done() and loop.time() < stop:
            second = min(stop, loop.time() + 1.0)  # then both send their next request at once
            first = asyncio.ensure_future(user(24, second))
            await asyncio.sleep(0.01)
            await asyncio.gather(first, user(17, second))
            await asyncio.sleep(0.005)  # a round trip the engine surely sees (the gather alone: a race)
        assert served > 0
        assert learner.done() == (share > 0)
        if share == 0:
            (c,) = await learner  # it finishes once the users stop
            assert len(c.tokens) == LONG.max_tokens
    finally:
        backend.engine.close()


def test_a_round_trip_without_a_users_request_keeps_the_learners_share(monkeypatch) -> None:
    """The share's accounts on a clock of their own: users' requests in flight all the time but
    for a 5 ms round trip each second give the learner its bursts (a quarter of the time after
    the patience, less what it has earned and not spent); a pause of `GAP_S` ends the stretch
    (the next one waits out the patience again)."""
    now = [0.0]
    monkeypatch.setattr(scheduling, "time", SimpleNamespace(monotonic=lambda: now[0]))
    engine = scheduling.Scheduling()
    engine.user_first, engine.background_share = True, 0.25
    engine._credit, engine._clock, engine._turn, engine._gap = 0.0, None, False, None
    engine._waiting, engine._active = deque(), []
    user = SimpleNamespace(priority="user", cancelled=False)

    def seconds(n: int) -> float:
        """`n` seconds of users' requests, the scheduler asked every 10 ms, each second followed
        by a round trip without them; the time the learner's burst was on."""
        turn = 0.0
        for _ in range(n):
            engine._active = [user]
            for _ in range(100):
                turn += 0.01 if engine._background_may_run() else 0.0
                now[0] += 0.01
            engine._active = []
            assert engine._background_may_run()
            now[0] += 0.005
        return turn

    assert seconds(5) == 0.0  # the patience (4 s), then half a second earned by the 6th second
    assert 0.25 * 16 - scheduling.BURST_S <= seconds(15) <= 0.25 * 16
    now[0] += scheduling.GAP_S
    assert seconds(5) == 0.0
