"""The proxy against the official `openai` client: a live uvicorn server on loopback, the local
backend on the tiny random model, a real SQLite store. Every captured turn is checked for token
exactness: its prompt ids are the renderer's ids for the request, and the backend's `score` of
its completion ids reproduces the recorded logprobs."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from clawbridge.config import Settings
from clawbridge.server import build_backend
from clawbridge.serving.metrics import status as server_status
from clawbridge.serving.proxy import ProxyHooks
from clawbridge.store import Store, StoredTurn
from live_server import LiveServer

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("proxy")
    settings = Settings(model=MODEL, port=0, data_dir=data, train=False, max_request_bytes=256 * 1024,
                        default_max_tokens=16)
    signalled = asyncio.Event()  # set by the hook the learner wakes on, for every next state
    hooks = ProxyHooks(on_next_state=lambda _ns: signalled.set())
    server = LiveServer(settings, build_backend(settings), hooks=hooks).start()
    server.signalled = signalled  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def store_of(live: LiveServer) -> Store:
    return live.running.store  # type: ignore[union-attr]


def turns(live: LiveServer, session_id: str) -> list[StoredTurn]:
    return store_of(live).session_turns(session_id)


def assert_exact(live: LiveServer, turn: StoredTurn) -> None:
    """Prompt ids = the renderer's; score(completion) = recorded logprobs (same version, temp)."""
    renderer = live.proxy.renderer
    assert list(turn.prompt_ids) == renderer.render(turn.messages, turn.tools)
    scored = live.call(
        live.backend.score(turn.prompt_ids, turn.completion_ids, temperature=turn.sampling.temperature)
    )
    assert len(scored) == len(turn.logprobs) > 0
    # a batched decode step and a lone scoring pass round differently: on the order of 1e-4 nats
    # for a token near -11 (a full run of the suite saw 2.1e-4 once)
    for got, want in zip(scored, turn.logprobs, strict=True):
        assert math.isclose(got, want, abs_tol=5e-4), (got, want)


def test_models_lists_the_served_model(client: openai.OpenAI):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_non_streaming_completion_is_openai_shaped_and_captured_exactly(live: LiveServer, client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        seed=7,
        extra_headers={"X-Session-Id": "sync-1"},
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 8
    assert ch.logprobs is not None and len(ch.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    [turn] = turns(live, "sync-1")
    assert turn.response["content"] == ch.message.content
    assert [t.logprob for t in ch.logprobs.content] == pytest.approx(list(turn.logprobs))
    assert turn.sampling.seed == 7 and turn.version == 0 and turn.turn_type == "main"
    assert_exact(live, turn)


def test_streaming_sends_role_first_then_tokens_then_finish_and_usage(live: LiveServer, client: openai.OpenAI):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_completion_tokens=12,
        temperature=0.7,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Session-Id": "stream-1"},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    [turn] = turns(live, "stream-1")
    assert "".join(texts) == (turn.response["content"] or "")
    assert chunks[-1].usage.completion_tokens == len(turn.completion_ids)
    content_chunks = [t for t in texts if t]
    if len(turn.completion_ids) > 4:  # token by token, not one chunk at the end
        assert len(content_chunks) >= 2
    assert turn.sampling.temperature == 0.7
    assert_exact(live, turn)


def test_n_choices_are_each_captured(live: LiveServer, client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "pick"}], n=3, max_tokens=4,
        extra_headers={"X-Session-Id": "n-3"},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(turns(live, "n-3")) == 3


async def test_async_client_serves_concurrent_sessions(live: LiveServer):
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"number {i}"}], max_tokens=6,
            extra_headers={"X-Session-Id": f"async-{i}"},
        )
        return r.choices[0].message.content or ""

    answers = await asyncio.gather(*(one(i) for i in range(4)))
    await client.close()
    for i, text in enumerate(answers):
        [turn] = turns(live, f"async-{i}")
        assert turn.response["content"] == text


def test_session_keys_and_unknown_keys_are_stripped_and_never_leak(live: LiveServer, client: openai.OpenAI):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"session_id": "body-1", "turn_type": "side", "my_custom_key": {"x": 1}},
    )
    raw = r.model_dump_json()
    assert "body-1" not in raw and "my_custom_key" not in raw and "turn_type" not in raw
    [turn] = turns(live, "body-1")
    assert turn.turn_type == "side"
    dumped = json.dumps([turn.messages, turn.request_params])
    assert "my_custom_key" not in dumped and "session_id" not in dumped


def test_url_prefix_names_the_session(live: LiveServer):
    c = openai.OpenAI(base_url=f"{live.url}/s/prefixed-7/v1", api_key="unused", max_retries=0)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert len(turns(live, "prefixed-7")) == 1


def test_next_main_request_attaches_the_next_state_and_signals_it(live: LiveServer, client: openai.OpenAI):
    signalled: asyncio.Event = live.signalled  # type: ignore[attr-defined]
    signalled.clear()
    h = {"X-Session-Id": "ns-1"}
    m1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"}]
    r1 = client.chat.completions.create(model=MODEL, messages=m1, max_tokens=5, extra_headers=h)
    reply = {"role": "assistant", "content": r1.choices[0].message.content}
    side = [{"role": "user", "content": "title this chat"}]
    client.chat.completions.create(model=MODEL, messages=side, max_tokens=3,
                                   extra_headers={**h, "X-Turn-Type": "side"})
    user2 = {"role": "user", "content": "second"}
    client.chat.completions.create(model=MODEL, messages=[*m1, reply, user2], max_tokens=5,
                                   extra_headers={**h, "X-Session-Done": "true"})
    live.call(asyncio.wait_for(signalled.wait(), 10))
    t1, t_side, t2 = turns(live, "ns-1")
    assert t1.next_state == [user2]
    assert t_side.turn_type == "side" and t_side.next_state is None
    assert t2.next_state is None
    assert store_of(live).get_session("ns-1").done  # type: ignore[union-attr]


def test_untagged_follow_up_joins_its_conversation(live: LiveServer, client: openai.OpenAI):
    m1 = [{"role": "user", "content": "untagged conversation start 42"}]
    r1 = client.chat.completions.create(model=MODEL, messages=m1, max_tokens=5)
    m2 = [*m1, {"role": "assistant", "content": r1.choices[0].message.content},
          {"role": "user", "content": "and then?"}]
    client.chat.completions.create(model=MODEL, messages=m2, max_tokens=5)
    with store_of(live).engine.connect() as conn:
        import sqlalchemy as sa
        from clawbridge.store import schema as t

        rows = conn.execute(
            sa.select(t.turns.c.session_id, t.turns.c.idx, t.turns.c.tagged)
            .where(t.turns.c.tagged == sa.false())
            .order_by(t.turns.c.created_at)
        ).all()
    assert len({r.session_id for r in rows[-2:]}) == 1 and [r.idx for r in rows[-2:]] == [0, 1]


def test_opt_out_header_answers_and_marks_the_turn_untrainable(live: LiveServer, client: openai.OpenAI):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "private"}],
                                   max_tokens=3, extra_headers={"X-Session-Id": "opt-1", "X-Train": "false"})
    [turn] = turns(live, "opt-1")
    assert turn.train is False


def test_health_metrics_and_status(live: LiveServer, client: openai.OpenAI):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=2)
    assert httpx.get(f"{live.url}/healthz").json()["status"] == "ok"
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'clawbridge_requests_total{status="200"}' in metrics and "clawbridge_turns_recorded" in metrics
    status = httpx.get(f"{live.url}/v1/status").json()
    assert status["model"] == MODEL and status["store"]["turns"] >= 1


# --- errors: OpenAI-shaped 4xx, nothing written ---------------------------------------------------


def _turn_count(live: LiveServer) -> int:
    return store_of(live).stats().turns


def _post(live: LiveServer, content: bytes | dict[str, Any], **headers: str) -> httpx.Response:
    body = content if isinstance(content, bytes) else json.dumps(content).encode()
    return httpx.post(f"{live.url}/v1/chat/completions", content=body,
                      headers={"Content-Type": "application/json", **headers}, timeout=30)


def _ok(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (_ok(model="gpt-nonexistent"), 404, "model_not_found"),
        (_ok(messages=[]), 400, None),
        (_ok(messages="hi"), 400, None),
        (_ok(temperature="hot"), 400, None),
        (_ok(max_tokens=-1), 400, None),
        (_ok(messages=[{"role": "wizard", "content": "x"}]), 400, None),
        (_ok(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, None),
        (_ok(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), 400, None),
        (_ok(tool_choice={"type": "function", "function": {"name": "missing"}}), 400, None),
        (_ok(messages=[{"role": "user", "content": "word " * 40000}]), 400, "context_length_exceeded"),
        (_ok(messages=[{"role": "user", "content": "x" * 300_000}]), 413, "request_too_large"),
        (b'{"model": "tiny-random", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
        (_ok(stream=True, n=2), 400, None),
    ],
)
def test_bad_requests_get_openai_shaped_4xx_and_write_nothing(live: LiveServer, body: Any, status: int, code: str | None):
    before = _turn_count(live)
    r = _post(live, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code
    assert _turn_count(live) == before


def test_unicode_content_round_trips(live: LiveServer, client: openai.OpenAI):
    text = "héllo 😀 中文 \u200b\u0000 done"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                   max_tokens=3, extra_headers={"X-Session-Id": "uni-1"})
    [turn] = turns(live, "uni-1")
    assert turn.messages[0]["content"] == text
    assert_exact(live, turn)


def test_openai_client_raises_typed_errors(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_api_key_is_required_when_configured(tmp_path: Path, live: LiveServer):
    from clawbridge.serving.app import create_app
    from starlette.testclient import TestClient

    settings = Settings(model=MODEL, port=0, data_dir=tmp_path, api_key="sk-secret-123", train=False)
    app = create_app(settings, live.backend, store_of(live), renderer=live.proxy.renderer)
    with TestClient(app) as tc:
        assert tc.get("/v1/models").status_code == 401
        bad = tc.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert "sk-secret-123" not in bad.text
        assert tc.get("/v1/models", headers={"Authorization": "Bearer sk-secret-123"}).status_code == 200


def test_both_chat_routes_answer_errors_the_same_way(tmp_path: Path, live: LiveServer):
    """`/v1/chat/completions` skips Starlette's middleware stack (`app._App`); its errors must
    still get the handlers the session-prefixed route gets through the stack."""
    from clawbridge.serving.app import create_app
    from starlette.testclient import TestClient

    class Broken:  # a backend with a bug: sampling raises something that is no BackendError
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        async def sample(self, *a: Any, **kw: Any) -> Any:
            raise RuntimeError("a bug in the backend")

    settings = Settings(model=MODEL, port=0, data_dir=tmp_path, api_key="sk-secret-123", train=False)
    app = create_app(settings, Broken(live.backend), store_of(live), renderer=live.proxy.renderer)  # type: ignore[arg-type]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    auth = {"Authorization": "Bearer sk-secret-123"}
    with TestClient(app, raise_server_exceptions=False) as tc:
        for path in ("/v1/chat/completions", "/s/errs/v1/chat/completions"):
            r = tc.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            r = tc.post(path, content=b"{", headers=auth)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", path
            r = tc.post(path, json=body, headers=auth)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", path
            assert "a bug" not in r.text
        assert tc.get("/v1/chat/completions", headers=auth).status_code == 405  # the router's answer
        assert app.state.proxy.counters.errors_5xx == 2


def test_banner_has_endpoint_curl_context_and_the_openclaw_install_command(live: LiveServer):
    from clawbridge.server import banner, status_line

    text = banner(live.settings, live.backend, live.proxy, live.url)
    assert f"{live.url}/v1" in text and "curl " in text and "sk-" not in text
    assert f"context   {live.backend.context_length} tokens" in text
    # a port other than the default: install must be told where the server is
    assert f"clawbridge openclaw install --url {live.url}" in text and "$OPENCLAW_HOME" in text
    line = status_line(live.call(server_status(live.proxy)))
    assert "requests" in line and "policy@v0" in line


def test_a_client_leaving_mid_stream_stops_generation_and_records_nothing(live: LiveServer):
    """A turn whose answer was not fully sent is no training sample: nothing is recorded, and
    the engine stops generating for it at once (its batch row is freed)."""
    import threading
    import time

    engine = live.backend.engine
    drawn = [0]
    lock = threading.Lock()
    original = engine._take

    def counting_take(seq: Any, logits: Any) -> Any:
        with lock:
            drawn[0] += 1
        return original(seq, logits)

    first = [{"role": "user", "content": "hello"}]
    reply = httpx.post(f"{live.url}/v1/chat/completions", headers={"X-Session-Id": "left-early"}, timeout=30,
                       json={"model": MODEL, "messages": first, "max_tokens": 4}).json()["choices"][0]["message"]
    engine._take = counting_take
    before = store_of(live).stats().turns
    ask = {"role": "user", "content": "count to a million"}
    body = {"model": MODEL, "messages": [*first, reply, ask],
            "stream": True, "max_tokens": 20_000, "temperature": 0}
    try:
        with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{live.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "left-early"}
        ) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events >= 5:
                    break  # leaving the block closes the connection mid-answer
        deadline = time.monotonic() + 10
        while engine._active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine._active, "the engine is still generating for a client that left"
        stopped_at = drawn[0]
        time.sleep(0.5)
        assert drawn[0] == stopped_at and stopped_at < 2_000  # no compute after the stop
    finally:
        engine._take = original
    deadline = time.monotonic() + 5
    while live.proxy.counters.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.proxy.counters.in_flight == 0
    assert store_of(live).stats().turns == before
    # the only turn is the first request's; the next state the second carried for it is kept
    deadline = time.monotonic() + 5
    while not turns(live, "left-early")[0].next_state and time.monotonic() < deadline:
        time.sleep(0.02)
    [kept] = turns(live, "left-early")
    assert kept.next_state == [ask]


def _threads() -> str:
    """Where every thread of this process is (its last frames): for a failure that hangs."""
    import threading

    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- {names.get(ident, '?')}:\n" + "".join(traceback.format_stack(frame)[-8:])
                     for ident, frame in sys._current_frames().items())


def test_a_client_leaving_before_the_first_byte_is_counted_out_and_its_next_state_kept(live: LiveServer):
    """A client that is gone before the stream's first byte, with an ASGI server whose `send`
    fails then (spec 2.4 servers may; uvicorn drops the send and the generator cleans up after
    itself): the event generator never runs, so its own cleanup never happens. The request must
    still be counted out, the next state it carried kept, and the backend's stream closed (no
    generation for nobody). Driven at the ASGI boundary."""
    import time

    from starlette.requests import ClientDisconnect

    first = [{"role": "user", "content": "hi"}]
    reply = httpx.post(f"{live.url}/v1/chat/completions", headers={"X-Session-Id": "gone-early"}, timeout=30,
                       json={"model": MODEL, "messages": first, "max_tokens": 4}).json()["choices"][0]["message"]
    ask = {"role": "user", "content": "and now a very long story"}
    body = json.dumps({"model": MODEL, "messages": [*first, reply, ask], "stream": True,
                       "max_tokens": 20_000, "temperature": 0}).encode()
    app = live.running.server.config.app  # type: ignore[union-attr]  # the live server's own app
    before = store_of(live).stats().turns
    sent: list[dict[str, Any]] = []
    received = []

    async def receive() -> dict[str, Any]:
        received.append(1)
        if len(received) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            raise OSError("the client is gone")
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"x-session-id", b"gone-early")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    with pytest.raises(ClientDisconnect):
        live.call(app(scope, receive, send))
    assert not sent and live.proxy.counters.errors_5xx == 0
    assert live.proxy.counters.in_flight == 0
    engine = live.backend.engine
    rows = list(engine._active)  # the request's row, if the scheduler has not dropped it yet
    # Dropped at the engine's next decode step. In wall time that is usually milliseconds, but
    # a loop of this file under load caught one decode step's forward of the tiny model taking
    # 30 s on a 2-core machine (the row went at the step's end, a second later), and a fresh-clone
    # CI run one taking over 120 s (the row cancelled, still at its prefill's one token, the engine
    # inside that forward): what the test checks is steps, that nothing is generated after the
    # client left. A row still there after the wait must be that row, cancelled, with nothing
    # generated since; an engine that kept generating would have drawn many of its 20000 tokens.
    deadline = time.monotonic() + 120
    while (engine._active or not turns(live, "gone-early")[0].next_state) and time.monotonic() < deadline:
        time.sleep(0.02)
    thread = engine._thread
    # (the row may have reached the batch after `rows` was read: its prefill ran during the wait;
    # the server serves nothing else, so every row is this request's)
    stalled = [r for r in engine._active if r.cancelled and len(r.tokens) <= 2]
    assert len(stalled) == len(engine._active), (
        "the engine is still generating for a client that left "
        f"(scheduler alive: {thread is not None and thread.is_alive()}, jobs {len(engine._jobs)}, "
        f"waiting {len(engine._waiting)}, rows {engine._active!r}); every thread, twice, 2 s apart:\n"
        f"{_threads()}\n{time.sleep(2) or _threads()}")
    # at most the prefill's token and one drawn by a step already under way when the client left
    assert all(row.cancelled and len(row.tokens) <= 2 for row in rows), rows
    assert turns(live, "gone-early")[0].next_state == [ask]
    assert store_of(live).stats().turns == before


def test_stream_chunks_that_arrive_together_leave_together_and_in_order():
    from clawbridge.protocol import BackendError
    from clawbridge.serving.streaming import Prefetch
    from clawbridge.types import TokenChunk

    closed = []

    async def source(gaps: bool, fail: bool = False):
        try:
            for i in range(6):
                if gaps and i:
                    await asyncio.sleep(0.01)
                if fail and i == 4:
                    raise BackendError("engine died")
                yield TokenChunk((i,), (-float(i),), 0, "stop" if i == 5 else None)
        finally:
            closed.append(True)

    async def read(gaps: bool) -> list[TokenChunk]:
        feed, out = Prefetch(source(gaps)), []
        while (c := await feed.next()) is not None:
            out.append(c)
            if c.finish_reason:
                break
        await feed.aclose()
        return out

    burst = asyncio.run(asyncio.wait_for(read(gaps=False), 10))
    assert [c.tokens for c in burst] == [(0, 1, 2, 3, 4, 5)] and burst[-1].finish_reason == "stop"
    assert burst[0].logprobs == (-0.0, -1.0, -2.0, -3.0, -4.0, -5.0)
    spaced = asyncio.run(asyncio.wait_for(read(gaps=True), 10))
    assert [c.tokens for c in spaced] == [(i,) for i in range(6)]  # nothing waits for company

    async def failing() -> list[tuple[int, ...]]:
        feed, got = Prefetch(source(gaps=False, fail=True)), []
        with pytest.raises(BackendError):
            while True:
                got.append((await feed.next()).tokens)  # type: ignore[union-attr]
        await feed.aclose()
        return got

    assert asyncio.run(asyncio.wait_for(failing(), 10)) == [(0, 1, 2, 3)]  # the error comes after what preceded it

    async def abandoned() -> None:
        feed = Prefetch(source(gaps=True))
        await feed.next()
        await feed.aclose()  # a client gone: the source is closed, its generation stops

    closed.clear()
    asyncio.run(asyncio.wait_for(abandoned(), 10))
    assert closed == [True]
