"""POST /v1/completions with the official openai client: a plain prompt, tokenised as it is (no
chat template), the completion as raw text; captured as chat completions are (exact ids and
logprobs, sessions, next states, main/side, opt-out)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import openai
import pytest
from api_backend import KEY, MODEL, assert_captured
from clawbridge.store import StoredTurn
from live_server import LiveServer


@pytest.fixture
def live(api_live: LiveServer) -> LiveServer:  # one server for tests/test_api_*.py (conftest)
    return api_live


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)


def turns(live: LiveServer, session_id: str) -> list[StoredTurn]:
    live.settle()
    return live.running.store.session_turns(session_id)  # type: ignore[union-attr]


def test_a_plain_prompt_is_not_templated_and_is_captured_exactly(live: LiveServer, client: openai.OpenAI):
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_headers={"X-Session-Id": "cmpl-1"})
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    [turn] = turns(live, "cmpl-1")
    tok = live.proxy.renderer.tokenizer
    assert list(turn.prompt_ids) == tok.encode(prompt, add_special_tokens=True)  # no template around it
    assert_captured(turn, live.backend.sampled[-1])
    assert turn.messages == [{"role": "user", "content": prompt}] and turn.request_params["api"] == "completions"
    assert turn.sampling.temperature == 0.5  # none asked: the server's default_temperature, recorded
    assert r.choices[0].text == turn.response["content"]
    assert r.usage is not None and r.usage.prompt_tokens == len(turn.prompt_ids)
    assert r.usage.completion_tokens == len(turn.completion_ids) <= 6


def test_token_id_prompts_and_logprobs(live: LiveServer, client: openai.OpenAI):
    ids = live.proxy.renderer.tokenizer.encode("The capital of France is", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, logprobs=2,
                                  extra_headers={"X-Session-Id": "cmpl-ids"})
    [turn] = turns(live, "cmpl-ids")
    assert list(turn.prompt_ids) == ids
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs == list(turn.logprobs)
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0


def test_streamed_text_equals_the_captured_reply(live: LiveServer, client: openai.OpenAI):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-Session-Id": "cmpl-stream"}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    [turn] = turns(live, "cmpl-stream")
    assert text == turn.response["content"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(turn.completion_ids)
    assert_captured(turn, live.backend.sampled[-1])


def test_sessions_next_states_side_and_opt_out(live: LiveServer, client: openai.OpenAI):
    h = {"X-Session-Id": "cmpl-s"}
    client.completions.create(model=MODEL, prompt="one", max_tokens=2, extra_headers=h)
    client.completions.create(model=MODEL, prompt="two", max_tokens=2, extra_headers={**h, "X-Turn-Type": "side"})
    client.completions.create(model=MODEL, prompt="three", max_tokens=2, extra_headers={**h, "X-Train": "false"})
    first, side, third = turns(live, "cmpl-s")
    assert side.turn_type == "side" and side.next_state is None
    assert first.next_state == [{"role": "user", "content": "three"}]  # the next main request's prompt
    assert third.train is False and first.train is True
    r = client.completions.create(model=MODEL, prompt="n", max_tokens=2, n=2, extra_headers={"X-Session-Id": "cmpl-n"})
    assert len(r.choices) == 2 and len(turns(live, "cmpl-n")) == 2


def test_errors_are_openai_shaped(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    for kw, param in (({"echo": True}, "echo"), ({"suffix": "x"}, "suffix")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", **kw)  # type: ignore[call-overload]
        assert e.value.body["param"] == param  # type: ignore[index]
    for kw, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [10**9]}, "prompt"), ({"prompt": ""}, "prompt"),
                      ({"prompt": "x", "stop": list("abcde")}, "stop"), ({"prompt": "x", "logprobs": 50}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, **kw)  # type: ignore[call-overload]
        assert e.value.body["param"] == param  # type: ignore[index]


LEAVING: Any = [("/v1/completions", {"model": MODEL, "prompt": "hi"}),
                ("/v1/responses", {"model": MODEL, "input": "hi"}),
                ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize(("path", "body"), LEAVING, ids=[p for p, _ in LEAVING])
def test_a_client_leaving_a_non_streaming_request_stops_generation_and_records_nothing(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch, path: str, body: Any
):
    started, cancelled = threading.Event(), threading.Event()

    async def slow_sample(*a: Any, **kw: Any) -> Any:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(live.backend, "sample", slow_sample)
    before = live.proxy.counters.turns_recorded
    with pytest.raises(httpx.TimeoutException), httpx.Client(base_url=live.url, timeout=1.0, headers={"authorization": f"Bearer {KEY}"}) as c:
        c.post(path, json=body)
    assert started.is_set() and cancelled.wait(5), "generation went on after the client left"
    assert live.proxy.counters.turns_recorded == before
