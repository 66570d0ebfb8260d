"""POST /v1/responses with the official openai client (responses.create, streamed and not, with
tools, chained by previous_response_id) and the OpenAI Agents SDK, against a live server on the
tiny model. Every answer is checked in the store: the ids and logprobs sampled, the session, the
next state, main/side and the opt-out — the chat route's capture, through another wire format."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
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
from clawbridge.serving.responses import to_messages
from clawbridge.store import StoredTurn
from live_server import LiveServer

TOOLS: Any = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": READ_FILE}]


@pytest.fixture
def live(api_live: LiveServer) -> LiveServer:  # one server for tests/test_api_*.py (conftest)
    return api_live


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)


def turn_of(live: LiveServer, response_id: str) -> StoredTurn:
    live.settle()
    turn = live.running.store.get_turn("turn-" + response_id.removeprefix("resp_"))  # type: ignore[union-attr]
    assert turn is not None
    return turn


def last_sampled(live: LiveServer) -> Any:
    return live.backend.sampled[-1]


def test_a_response_is_openai_shaped_and_captured_exactly(live: LiveServer, client: openai.OpenAI):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Say hello.",
                                max_output_tokens=6, extra_headers={"X-Session-Id": "resp-1"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.instructions == "Be brief."
    assert r.usage is not None and 0 < r.usage.output_tokens <= 6
    turn = turn_of(live, r.id)
    assert_captured(turn, last_sampled(live))
    assert turn.session_id == "resp-1" and turn.turn_type == "main" and turn.train
    assert turn.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    assert list(turn.prompt_ids) == live.proxy.renderer.render(turn.messages)
    assert turn.request_params["api"] == "responses"
    assert (turn.response["content"] or "") == r.output_text
    assert r.usage.input_tokens == len(turn.prompt_ids)


def test_a_tool_call_is_a_function_call_item_and_its_output_the_next_state(live: LiveServer, client: openai.OpenAI):
    first = client.responses.create(model=MODEL, input="What is in a.txt?", tools=TOOLS,
                                    extra_headers={"X-Session-Id": "resp-tools"})
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "read_file" and json.loads(call.arguments) == {"path": "a.txt"}
    assert_captured(turn_of(live, first.id), last_sampled(live))
    second = client.responses.create(
        model=MODEL, tools=TOOLS, extra_headers={"X-Session-Id": "resp-tools"},
        input=[{"role": "user", "content": "What is in a.txt?"}, *[o.model_dump() for o in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "hello"}])
    assert second.output_text == AFTER_TOOL
    t1, t2 = turn_of(live, first.id), turn_of(live, second.id)
    assert t1.session_id == t2.session_id == "resp-tools"
    assert t1.next_state == [{"role": "tool", "tool_call_id": call.call_id, "content": "hello"}]
    assert t2.messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "hello"}


def test_previous_response_id_chains_one_session_with_next_states(live: LiveServer, client: openai.OpenAI):
    first = client.responses.create(model=MODEL, input="What is in a.txt?", tools=TOOLS, instructions="Use tools.")
    [call] = [o for o in first.output if o.type == "function_call"]
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, instructions="Use tools.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "hello"}])
    assert second.previous_response_id == first.id and second.output_text == AFTER_TOOL
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks!",
                                    max_output_tokens=4)
    t1, t2, t3 = turn_of(live, first.id), turn_of(live, second.id), turn_of(live, third.id)
    assert t1.session_id == t2.session_id == t3.session_id  # untagged, yet one session
    assert t1.next_state == [{"role": "tool", "tool_call_id": call.call_id, "content": "hello"}]
    assert t2.next_state == [{"role": "user", "content": "Thanks!"}]
    # the chain is rebuilt from the store: the whole conversation went to the model
    assert t2.messages[0] == {"role": "system", "content": "Use tools."}
    assert t2.messages[-2]["tool_calls"][0]["id"] == call.call_id
    # instructions are not carried over (as at OpenAI): the third request sent none
    assert t3.messages[0] == {"role": "user", "content": "What is in a.txt?"}
    assert list(t3.prompt_ids) == live.proxy.renderer.render(t3.messages, t3.tools)


def test_streaming_sends_the_documented_event_sequence(live: LiveServer, client: openai.OpenAI):
    events = list(client.responses.create(model=MODEL, input="What is in a.txt?", tools=TOOLS, stream=True,
                                          extra_headers={"X-Session-Id": "resp-stream"}))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    [call] = done.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"path": "a.txt"}
    assert_captured(turn_of(live, done.id), last_sampled(live))


def test_streamed_text_arrives_as_output_text_deltas_with_logprobs(live: LiveServer, client: openai.OpenAI):
    """Every sampled token's logprob reaches the client, in order, also for the tokens whose text
    the decoder held back and sent with a later one (an incomplete UTF-8 sequence, a possible tag
    start): the random model samples byte tokens often enough that 64 of them hold some back."""
    events = list(client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=64, stream=True,
                                          temperature=1.0, include=["message.output_text.logprobs"],
                                          extra_headers={"X-Session-Id": "resp-text"}))
    final = events[-1].response  # type: ignore[union-attr]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if final.status == "incomplete" else "response.completed"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == final.output_text
    turn = turn_of(live, final.id)
    assert_captured(turn, last_sampled(live))
    sent = [lp.logprob for e in deltas for lp in e.logprobs]
    assert sent == list(turn.logprobs)[: len(sent)] and len(sent) >= len(turn.logprobs) - 1


def test_a_token_whose_text_is_held_back_sends_its_logprob_with_the_next_delta(live: LiveServer):
    """Token by token through the real renderer's stream decoder: a token that ends inside a UTF-8
    character yields no text, so no delta; its logprob must ride on the next delta, not vanish."""
    from types import SimpleNamespace

    from clawbridge.serving.responses import _Events

    tok = live.backend.tokenizer()
    ids = tok.encode("Tea or café? ☕ Both.", add_special_tokens=False)
    lps = [-0.5 - i / 100 for i in range(len(ids))]
    dec = live.proxy.renderer.stream(())
    events = _Events(SimpleNamespace(logprobs=True), live.proxy)  # type: ignore[arg-type]  # only .logprobs is read
    raw = [b for t, lp in zip(ids, lps, strict=True) for b in events.deltas(dec.feed([t]), [t], [lp])]
    raw += events.deltas(dec.finish("stop"), [], [])
    sent = [json.loads(b.split(b"data: ", 1)[1]) for b in raw]
    deltas = [e for e in sent if e["type"] == "response.output_text.delta"]
    assert len(deltas) < len(ids)  # some tokens were held back: the case under test happened
    assert "".join(e["delta"] for e in deltas) == "Tea or café? ☕ Both."
    assert [lp["logprob"] for e in deltas for lp in e["logprobs"]] == lps


def test_side_turns_and_opt_out_are_kept_as_for_chat(live: LiveServer, client: openai.OpenAI):
    side = client.responses.create(model=MODEL, input="title this", max_output_tokens=3,
                                   extra_headers={"X-Session-Id": "resp-flags", "X-Turn-Type": "side"})
    out = client.responses.create(model=MODEL, input="private", max_output_tokens=3,
                                  extra_headers={"X-Session-Id": "resp-flags", "X-Train": "false"})
    assert turn_of(live, side.id).turn_type == "side"
    assert turn_of(live, out.id).train is False


def test_errors_are_openai_shaped(live: LiveServer, client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="nope", input="hi")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_" + "0" * 32)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type"  # type: ignore[index]


def _agent(live: LiveServer, calls: list[str]) -> Any:
    from agents import Agent, OpenAIResponsesModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine

    @function_tool
    def read_file(path: str) -> str:
        """Read a file."""
        calls.append(path)
        return "hello"

    model = OpenAIResponsesModel(MODEL, openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0))
    return Agent(name="reader", instructions="Answer with the tools.", tools=[read_file], model=model)


def test_the_agents_sdk_runs_a_tool_using_agent(live: LiveServer):
    """The OpenAI Agents SDK's own loop: the model calls the tool, the SDK runs it and sends its
    output back; each model call is a captured turn of one session, the tool output the first
    turn's next state."""
    from agents import Runner

    calls: list[str] = []
    before = len(live.backend.sampled)
    result = Runner.run_sync(_agent(live, calls), "What is in a.txt?")
    assert calls == ["a.txt"] and result.final_output == AFTER_TOOL
    assert len(live.backend.sampled) == before + 2
    ids = [r.response_id for r in result.raw_responses]
    first, second = (turn_of(live, i) for i in ids)  # type: ignore[arg-type]
    assert first.session_id == second.session_id
    assert first.next_state is not None and first.next_state[0]["role"] == "tool"
    assert first.next_state[0]["content"] == "hello"
    assert_captured(second, live.backend.sampled[-1])


async def test_the_agents_sdk_streams_and_chains_by_response_id(live: LiveServer):
    """The same agent streamed, each call chained to the last by previous_response_id: the SDK
    reads our events into its items, and the chain is one session."""
    from agents import Runner

    calls: list[str] = []
    result = Runner.run_streamed(_agent(live, calls), "What is in a.txt?", auto_previous_response_id=True)
    kinds = [e.type async for e in result.stream_events()]
    assert "raw_response_event" in kinds and calls == ["a.txt"] and result.final_output == AFTER_TOOL
    first, second = (turn_of(live, r.response_id) for r in result.raw_responses)  # type: ignore[arg-type]
    assert second.request_params["previous_response_id"] == result.raw_responses[0].response_id
    assert first.session_id == second.session_id
    assert first.next_state is not None and first.next_state[0]["content"] == "hello"


BAD: Any = [
    b"[]", b"{", {"model": MODEL}, {"model": MODEL, "input": 5}, {"model": MODEL, "input": [5]},
    {"model": MODEL, "input": [{"role": "bot", "content": "x"}]},
    {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
    {"model": MODEL, "input": [{"type": "function_call", "name": "f"}]},
    {"model": MODEL, "input": [{"type": "reasoning", "content": 5}]},
    {"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]},
    {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": 5}]},
    {"model": MODEL, "input": "x", "tool_choice": 5}, {"model": MODEL, "input": "x", "include": "x"},
    {"model": MODEL, "input": "x", "max_output_tokens": "5"}, {"model": MODEL, "input": "x", "instructions": 5},
    {"model": MODEL, "input": "x", "stream": "yes"}, {"model": MODEL, "input": "x", "conversation": "c"},
]


@pytest.mark.parametrize("body", BAD, ids=range(len(BAD)))
def test_malformed_requests_get_an_openai_shaped_400_and_write_nothing(live: LiveServer, body: Any):
    before = live.proxy.counters.turns_recorded
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{live.url}/v1/responses", content=content, headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert live.proxy.counters.turns_recorded == before


def test_reasoning_is_a_reasoning_item_streamed_as_reasoning_text(live: LiveServer, client: openai.OpenAI):
    r = client.responses.create(model=MODEL, input=THINK_FIRST)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER  # type: ignore[union-attr,index]
    assert turn_of(live, r.id).response["reasoning_content"] == THOUGHT
    events = list(client.responses.create(model=MODEL, input=THINK_FIRST, stream=True))
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert thought == THOUGHT and [o.type for o in events[-1].response.output] == ["reasoning", "message"]  # type: ignore[union-attr]


def test_replayed_items_gather_into_the_assistant_turn_that_produced_them():
    """Reasoning, text and function calls that follow one another are one assistant message (as
    the turn recorded them); text after calls starts the next one."""
    items: Any = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "read_file", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    ]
    call = {"type": "function", "function": {"name": "read_file", "arguments": "{}"}}
    assert to_messages(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm",
         "tool_calls": [{"id": "c1", **call}, {"id": "c2", **call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "Done."},
        {"role": "developer", "content": "Be brief."},
    ]
