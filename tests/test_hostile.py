"""The door against hostile and careless clients (issue 14): a live server on loopback (tiny
random model, real SQLite store) gets malformed, oversized, deeply nested and badly typed
requests. Every answer is an OpenAI-shaped error below 500 or a 200 whose turn is in the store;
nothing hangs; one huge request does not stall the others."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import stat
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from clawbridge.config import Settings
from clawbridge.server import build_backend, open_store
from clawbridge.serving.proxy import ProxyHooks
from live_server import LiveServer

MODEL = "tiny-random"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("hostile") / "data"
    settings = Settings(model=MODEL, port=0, data_dir=data, train=False, default_max_tokens=4,
                        body_timeout_s=1.0)
    server = LiveServer(settings, build_backend(settings), hooks=ProxyHooks()).start()
    # as `clawbridge up` does (serve(freeze_gc=True)): the model's objects are never scanned by
    # the garbage collector, whose full passes would otherwise stall the loop 20-100 ms
    gc.collect()
    gc.freeze()
    yield server
    server.stop()
    gc.unfreeze()


@pytest.fixture
def http(live: LiveServer):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


def stored_turns(live: LiveServer) -> int:
    store = live.running.store  # type: ignore[union-attr]
    return int(store.stats().turns)


def nested(depth: int) -> str:
    """A placeholder for JSON nested `depth` levels deep (the clients' encoders refuse to build
    it): `encode` splices the text in."""
    return f"@@deep{depth}@@"


def deep_text(depth: int) -> str:
    opens = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    closes = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return opens + "1" + closes


def encode(obj: Any) -> bytes:
    import json
    import re

    text = json.dumps(obj)
    return re.sub(r'"@@deep(\d+)@@"', lambda m: deep_text(int(m.group(1))), text).encode()


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict[str, Any]:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    assert r.status_code >= 400, (r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err


def body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **kw}


# --- the corpus: each a 400 with an OpenAI-shaped body, nothing stored ------------------------

DEEP = 600
HOSTILE: dict[str, dict[str, Any]] = {
    "seed 2**64-1 with n=2": body(seed=2**64 - 1, n=2),
    "seed below int64": body(seed=-(2**63) - 1),
    "tool parameters nested 600 deep": body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": nested(DEEP)}}}}]),
    "content part extra key nested 600 deep": body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "extra": nested(DEEP)}]}]),
    "tool-call arguments nested 600 deep": body(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": "[" * DEEP + "]" * DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]),
    "tool-call arguments 980 open brackets, never closed": body(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": '{"a":' * 980}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]),
    "tool_choice nested 980 deep": body(tool_choice=nested(980)),
    "max_tokens 10**12": body(max_tokens=10**12),
    "max_completion_tokens 10**12": body(max_completion_tokens=10**12),
    "stream as a string": body(stream="yes"),
    "n as a string": body(n="2"),
    "logprobs as an int": body(logprobs=1),
    "session_id as an object": body(session_id={"$ne": None}),
    "session_id as a list": body(session_id=["a", "b"]),
    "session_id as an int": body(session_id=12345),
    "session_id of 1 MB": body(session_id="s" * 1_000_000),
    "session_id with control characters": body(session_id="a\nb"),
    "session_done as an object": body(session_done={"x": 1}),
    "turn_type as a list": body(turn_type=["main"]),
    "temperature as a string": body(temperature="0.5"),
    "messages empty": body(messages=[]),
    "messages not a list": body(messages="hello"),
    "messages a number (found by the fuzz)": body(messages=1.5),
    "no model": {"messages": HELLO},
    "unknown role": body(messages=[{"role": "narrator", "content": "x"}]),
    "content part without a type": body(messages=[{"role": "user", "content": [{"text": "x"}]}]),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_body_is_a_400_and_stores_nothing(live: LiveServer, http: httpx.Client, name: str):
    before = stored_turns(live)
    r = http.post("/v1/chat/completions", content=encode(HOSTILE[name]),
                  headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert stored_turns(live) == before


def test_an_impossible_max_tokens_is_refused_as_openai_refuses_it(http: httpx.Client):
    err = assert_openai_error(http.post("/v1/chat/completions", json=body(max_tokens=10**12)), 400)
    assert err["param"] == "max_tokens" and "too large" in err["message"]


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b"{" * 5000, b"[" * 100000])
def test_unparseable_bodies_are_400(http: httpx.Client, raw: bytes):
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize(
    "headers",
    [{"X-Session-Id": "s" * 5000}, {"X-Session-Id": "a\tb"}, {"X-Turn-Type": "sidewise"}],
)
def test_bad_session_headers_are_400(http: httpx.Client, headers: dict[str, str]):
    assert_openai_error(http.post("/v1/chat/completions", json=body(), headers=headers), 400)


def test_a_trailing_slash_is_a_404_not_a_redirect(http: httpx.Client):
    r = http.post("/v1/chat/completions/", json=body())
    assert_openai_error(r, 404)


@pytest.mark.parametrize("method,path", [("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                                         ("POST", "/v2/anything"), ("GET", "/s/x/v1/nothing")])
def test_wrong_routes_and_methods_are_openai_shaped(http: httpx.Client, method: str, path: str):
    assert_openai_error(http.request(method, path))


def test_a_valid_request_is_answered_and_stored(live: LiveServer, http: httpx.Client):
    before = stored_turns(live)
    r = http.post("/v1/chat/completions", json=body(seed=2**63 - 1, n=2, session_id="fine-1"))
    assert r.status_code == 200, r.text
    assert stored_turns(live) == before + 2


def test_a_half_sent_body_times_out_with_408(live: LiveServer):
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        got = s.recv(4096)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert time.monotonic() - t0 < 5


def test_a_non_streaming_request_stops_generating_when_its_client_leaves(live: LiveServer, monkeypatch):
    started, cancelled = threading.Event(), threading.Event()

    async def slow_sample(*a: Any, **kw: Any) -> Any:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(live.backend, "sample", slow_sample)
    before = stored_turns(live)
    with pytest.raises(httpx.TimeoutException), httpx.Client(base_url=live.url, timeout=1.0) as c:
        c.post("/v1/chat/completions", json=body())
    assert started.is_set()
    assert cancelled.wait(5), "generation went on after the client left"
    assert stored_turns(live) == before


def test_an_idle_pooled_connection_serves_the_next_request(live: LiveServer):
    # the openai SDK with retries off: a pooled connection idle for 6 s (uvicorn's default
    # keep-alive is 5 s) must still carry the next request
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        assert r.choices
        time.sleep(6)


def healthz_delay_under_7mb_requests(live: LiveServer) -> float:
    """Huge requests are parsed and tokenised off the event loop (and one longer than the
    context is refused without tokenising it all): /healthz answers meanwhile, delayed by less
    than 50 ms at p99 over the same probes without them. The bodies are encoded before the
    clock starts (the client shares this process's interpreter)."""
    import orjson

    text = ("lorem ipsum dolor sit amet " * 300_000)[: 7 * 1024 * 1024]
    raw = orjson.dumps(body(messages=[{"role": "user", "content": text}]))
    results: list[tuple[int, float]] = []

    def big() -> None:
        with httpx.Client(base_url=live.url, timeout=120) as c:
            for content in (raw,) * 5:
                t0 = time.monotonic()
                r = c.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
                results.append((r.status_code, time.monotonic() - t0))

    def probe(c: httpx.Client, until: Any) -> list[float]:
        delays: list[float] = []
        while until(delays):
            t0 = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            delays.append(time.perf_counter() - t0)
            time.sleep(0.002)
        return delays

    with httpx.Client(base_url=live.url, timeout=30) as c:
        c.get("/healthz")
        worker = threading.Thread(target=big)
        t0 = time.monotonic()
        worker.start()
        during = probe(c, lambda _: worker.is_alive())
        worker.join()
        # the same probes without the huge requests: what this (shared, busy) machine costs anyway
        quiet = probe(c, lambda d: len(d) < max(len(during), 50) or time.monotonic() - t0 < 1)
    assert [status for status, _ in results] == [400] * 5, results  # longer than the context
    p99, base = (statistics.quantiles(d, n=100)[98] for d in (during, quiet))
    print(f"7 MB requests took {[round(s, 2) for _, s in results]} s; /healthz p99 {p99 * 1000:.1f} ms "
          f"over {len(during)} probes (without them {base * 1000:.1f} ms): delayed by {(p99 - base) * 1000:.1f} ms")
    return p99 - base


def test_a_7mb_prompt_does_not_stall_healthz(live: LiveServer):
    # Today's code tokenised on the loop: seconds. The bound here leaves room for a busy CI
    # machine (two cores shared with other jobs); the 50 ms target is checked by the slow test.
    assert healthz_delay_under_7mb_requests(live) < 0.250


@pytest.mark.slow
def test_a_7mb_prompt_delays_healthz_by_less_than_50ms_p99(live: LiveServer):
    delays = sorted(healthz_delay_under_7mb_requests(live) for _ in range(3))
    assert delays[1] < 0.050, delays  # the median of three runs: one noisy neighbour is not a stall


# --- the settings and the data on disk ----------------------------------------------------------


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_key_is_no_key_and_refuses_a_public_address(key: str, monkeypatch):
    with pytest.raises(ValueError, match="api-key"):
        Settings(host="0.0.0.0", api_key=key)
    monkeypatch.setenv("CLAWBRIDGE_API_KEY", key)
    with pytest.raises(ValueError, match="api-key"):
        Settings.load(host="0.0.0.0")
    assert Settings.load().serving.api_key is None  # on loopback: no key, not a key ""


def test_the_data_directory_and_database_are_private(tmp_path: Path):
    old = os.umask(0o022)
    try:
        settings = Settings(data_dir=tmp_path / "fresh" / "data")
        store = open_store(settings)
        store.close()
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "fresh" / "data").stat().st_mode)
    assert mode == 0o700, oct(mode)
    for f in (tmp_path / "fresh" / "data").iterdir():
        if f.name.startswith("clawbridge.db"):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f, oct(f.stat().st_mode))


# --- property-based fuzz of request bodies (slow: 2,000 cases through the live server) ----------

FUZZ_CASES = 2000


def _fuzz_strategies() -> Any:
    from hypothesis import strategies as st

    scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) \
        | st.text(max_size=12)
    junk = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                        max_leaves=8)
    deep = st.integers(1, 700).map(nested)
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"]) | junk},
                                 optional={"text": st.text(max_size=20) | junk, "image_url": junk, "extra": junk | deep})
    call = st.fixed_dictionaries({"id": st.text(max_size=8) | junk, "type": st.just("function") | junk,
                                  "function": st.fixed_dictionaries(
                                      {"name": st.text(max_size=8) | junk},
                                      optional={"arguments": st.text(max_size=30) | st.integers(1, 1200).map(
                                          lambda k: "[" * k) | junk})})
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "narrator"]) | junk},
        optional={"content": st.text(max_size=40) | st.lists(part, max_size=3) | junk,
                  "tool_calls": st.lists(call, max_size=2) | junk, "tool_call_id": st.text(max_size=8) | junk,
                  "name": st.text(max_size=8) | junk, "reasoning_content": st.text(max_size=10) | junk})
    tool = st.fixed_dictionaries({"type": st.just("function") | junk, "function": st.fixed_dictionaries(
        {"name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True) | junk},
        optional={"parameters": st.just({"type": "object", "properties": {"x": {"type": "string"}}}) | junk | deep,
                  "description": st.text(max_size=10) | junk})})
    small = st.integers(1, 6)
    body = st.fixed_dictionaries(
        {"model": st.just(MODEL) | st.just(MODEL) | junk,
         "messages": st.lists(message, min_size=1, max_size=4) | junk},
        optional={
            "max_tokens": small | st.integers(-3, 10**13) | junk,
            "max_completion_tokens": small | junk,
            "n": st.integers(-1, 20) | junk,
            "seed": st.integers(-(2**65), 2**65) | junk,
            "stream": st.booleans() | junk,
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | junk}) | junk,
            "temperature": st.floats(-1, 3, allow_nan=False) | junk,
            "top_p": st.floats(-1, 2, allow_nan=False) | junk,
            "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6) | junk,
            "logprobs": st.booleans() | junk,
            "top_logprobs": st.integers(-2, 30) | junk,
            "tools": st.lists(tool, max_size=2) | junk,
            "tool_choice": st.sampled_from(["none", "auto", "required"]) | junk | deep,
            "session_id": st.text(max_size=300) | junk,
            "turn_type": st.sampled_from(["main", "side"]) | junk,
            "session_done": st.booleans() | junk,
            "user": st.text(max_size=10) | junk,
        },
    )
    headers = st.fixed_dictionaries({}, optional={
        # what an HTTP client can send at all (no leading or trailing blanks in a header value)
        "X-Session-Id": st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300)
        .filter(lambda v: v == v.strip()),
        "X-Turn-Type": st.sampled_from(["main", "side", "other", ""]),
        "X-Train": st.sampled_from(["true", "false", "maybe"]),
    })
    return body, headers


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzzed_bodies_get_openai_errors_or_stored_answers(live: LiveServer):
    """Hypothesis-generated bodies (valid, malformed, mistyped, deeply nested): never a 5xx, every
    error OpenAI-shaped, every 200 stored (one turn per choice) before its answer is complete."""
    import json

    from hypothesis import HealthCheck, given, settings

    body_st, headers_st = _fuzz_strategies()
    seen = {"cases": 0, "ok": 0, "errors": 0}
    client = httpx.Client(base_url=live.url, timeout=60)

    @settings(max_examples=FUZZ_CASES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=body_st, headers=headers_st)
    def one(body: dict[str, Any], headers: dict[str, str]) -> None:
        seen["cases"] += 1
        raw = encode(body) if "@@deep" in json.dumps(body) else json.dumps(body).encode()
        before = stored_turns(live)
        r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json", **headers})
        assert r.status_code < 500, (r.status_code, r.text[:300], body)
        if r.status_code != 200:
            seen["errors"] += 1
            assert_openai_error(r)
            assert stored_turns(live) == before, body
            return
        seen["ok"] += 1
        if r.headers["content-type"].startswith("text/event-stream"):
            assert b"data: [DONE]" in r.content or b'"error"' in r.content, r.content[-300:]
            choices = 1 if b"data: [DONE]" in r.content else 0
        else:
            choices = len(r.json()["choices"])
        assert stored_turns(live) == before + choices, ("answered but not stored", body)

    try:
        one()
    finally:
        client.close()
    print(f"fuzz: {seen}")
    assert seen["cases"] >= FUZZ_CASES and live.proxy.counters.record_failures == 0
