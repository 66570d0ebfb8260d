"""POST /v1/messages with the official anthropic client (messages.create and messages.stream,
with tools) against a live server on the tiny model. Every answer is checked in the store: the
ids and logprobs sampled, the session, the next state, main/side and the opt-out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from api_backend import (
    AFTER_TOOL,
    ANSWER,
    KEY,
    MODEL,
    READ_FILE,
    THINK_FIRST,
    THOUGHT,
    assert_captured,
)
from clawbridge.serving.anthropic import to_messages
from clawbridge.store import StoredTurn
from live_server import LiveServer

TOOLS: Any = [{"name": "read_file", "description": "Read a file", "input_schema": READ_FILE}]


@pytest.fixture
def live(api_live: LiveServer) -> LiveServer:  # one server for tests/test_api_*.py (conftest)
    return api_live


@pytest.fixture
def client(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0)


def turn_of(live: LiveServer, message_id: str) -> StoredTurn:
    live.settle()
    turn = live.running.store.get_turn("turn-" + message_id.removeprefix("msg_"))  # type: ignore[union-attr]
    assert turn is not None
    return turn


def test_a_message_is_anthropic_shaped_and_captured_exactly(live: LiveServer, client: anthropic.Anthropic):
    m = client.messages.create(model=MODEL, max_tokens=6, system="Be brief.",
                               messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
                               extra_headers={"X-Session-Id": "msg-1"})
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 6
    turn = turn_of(live, m.id)
    assert_captured(turn, live.backend.sampled[-1])
    assert turn.session_id == "msg-1" and turn.turn_type == "main" and turn.train
    assert turn.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    assert list(turn.prompt_ids) == live.proxy.renderer.render(turn.messages)
    assert m.usage.input_tokens == len(turn.prompt_ids) and turn.request_params["api"] == "messages"
    assert "".join(b.text for b in m.content if b.type == "text") == (turn.response["content"] or "")


def test_tool_use_and_tool_result_make_one_session_with_a_next_state(live: LiveServer, client: anthropic.Anthropic):
    msgs: list[Any] = [{"role": "user", "content": "What is in a.txt?"}]
    first = client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=msgs)  # untagged
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "read_file" and use.input == {"path": "a.txt"}
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hello"}]}]
    second = client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=msgs)
    assert [b.text for b in second.content if b.type == "text"] == [AFTER_TOOL]
    assert second.stop_reason == "end_turn"
    t1, t2 = turn_of(live, first.id), turn_of(live, second.id)
    assert t1.session_id == t2.session_id  # the untagged follow-up joined its conversation
    assert t1.next_state == [{"role": "tool", "tool_call_id": use.id, "content": "hello"}]
    assert_captured(t2, live.backend.sampled[-1])


def test_messages_stream_sends_the_event_sequence_and_a_tool_use(live: LiveServer, client: anthropic.Anthropic):
    with client.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS,
                                messages=[{"role": "user", "content": "What is in a.txt?"}],
                                extra_headers={"X-Session-Id": "msg-stream"}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert raw == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                   "message_delta", "message_stop"]
    [use] = final.content
    assert use.type == "tool_use" and use.input == {"path": "a.txt"} and final.stop_reason == "tool_use"
    turn = turn_of(live, final.id)
    assert turn.session_id == "msg-stream"
    assert_captured(turn, live.backend.sampled[-1])


def test_streamed_text_equals_the_captured_reply(live: LiveServer, client: anthropic.Anthropic):
    with client.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Tell a story."}],
                                extra_headers={"X-Session-Id": "msg-text"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    turn = turn_of(live, final.id)
    assert text == (turn.response["content"] or "") and final.usage.output_tokens == len(turn.completion_ids)
    assert_captured(turn, live.backend.sampled[-1])


def test_side_turns_and_opt_out_are_kept_as_for_chat(live: LiveServer, client: anthropic.Anthropic):
    ask: Any = [{"role": "user", "content": "title this"}]
    side = client.messages.create(model=MODEL, max_tokens=3, messages=ask,
                                  extra_headers={"X-Session-Id": "msg-flags", "X-Turn-Type": "side"})
    out = client.messages.create(model=MODEL, max_tokens=3, messages=ask,
                                 extra_headers={"X-Session-Id": "msg-flags", "X-Train": "false"})
    assert turn_of(live, side.id).turn_type == "side"
    assert turn_of(live, out.id).train is False


def test_errors_are_anthropic_shaped(live: LiveServer, client: anthropic.Anthropic):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(f"{live.url}/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "1999-01-01"},
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "anthropic-version" in r.json()["error"]["message"]


def test_a_bearer_key_works_too(live: LiveServer, tmp_path: Path):
    r = httpx.post(f"{live.url}/v1/messages", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_count_tokens_is_the_length_of_the_rendered_prompt(live: LiveServer, client: anthropic.Anthropic):
    msgs: Any = [{"role": "user", "content": "What is in a.txt?"}]
    n = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=msgs, tools=TOOLS)
    renderer = live.proxy.renderer
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": READ_FILE}}]
    want = renderer.render([{"role": "system", "content": "Be brief."}, *msgs], tools)
    assert n.input_tokens == len(want)


HI: Any = [{"role": "user", "content": "hi"}]
BAD: Any = [
    b"[]", {"model": MODEL, "messages": HI}, {"model": MODEL, "max_tokens": 4, "messages": []},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [5]}]},
    {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": 5}]}, *HI]},
    {"model": MODEL, "max_tokens": 4, "messages": [*HI, {"role": "assistant", "content": "Sure,"}]},
    {"model": MODEL, "max_tokens": 4, "system": 5, "messages": HI},
    {"model": MODEL, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": HI},
    {"model": MODEL, "max_tokens": 4, "tool_choice": {"type": "maybe"}, "messages": HI},
    {"model": MODEL, "max_tokens": 4, "stop_sequences": "x", "messages": HI},
    {"model": MODEL, "max_tokens": 0, "messages": HI}, {"model": MODEL, "max_tokens": 4, "messages": HI, "stream": "yes"},
]


@pytest.mark.parametrize("body", BAD, ids=range(len(BAD)))
def test_malformed_requests_get_an_anthropic_shaped_400_and_write_nothing(live: LiveServer, body: Any):
    before = live.proxy.counters.turns_recorded
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{live.url}/v1/messages", content=content, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert live.proxy.counters.turns_recorded == before


def test_reasoning_is_a_thinking_block_streamed_as_thinking_deltas(live: LiveServer, client: anthropic.Anthropic):
    ask: Any = [{"role": "user", "content": THINK_FIRST}]
    m = client.messages.create(model=MODEL, max_tokens=64, messages=ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHT  # type: ignore[union-attr]


def test_blocks_translate_to_chat_messages():
    body: Any = {"system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "one"}]},
                                     {"type": "text", "text": "and?"}]},
    ]}
    assert to_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "user", "content": "and?"},
    ]
