"""Tool calls through the proxy with the official openai client, streaming and not.

A random tiny model never decides to call a tool, so the completion tokens here are scripted: a
`ScriptedBackend` wraps the real local backend, emits the tokens of a Hermes-style tool call and
takes their logprobs from the real backend's `score` (so the captured turn stays exact). All
else — rendering, parsing, streaming, sessions, the store — is the real thing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest
from clawbridge.config import Settings
from clawbridge.server import build_backend
from clawbridge.types import Completion, SamplingParams, TokenChunk
from live_server import LiveServer

MODEL = "tiny-random"
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt", "lines": 3}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                   "required": ["path"]}}}]


class ScriptedBackend:
    def __init__(self, real: Any) -> None:
        self.real = real
        self.name, self.model_name, self.context_length = real.name, real.model_name, real.context_length

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    @property
    def version(self) -> int:
        return int(self.real.version)

    def _tokens(self) -> list[int]:
        tok = self.real.tokenizer()
        return [*tok.encode(CALL, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1,
                     version: int | None = None, priority: str = "user") -> list[Completion]:
        ids = self._tokens()
        lps = await self.real.score(prompt_ids, ids, temperature=params.temperature)
        return [Completion(tuple(ids), tuple(lps), "stop", self.version) for _ in range(n)]

    async def sample_stream(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                            version: int | None = None, priority: str = "user") -> AsyncIterator[TokenChunk]:
        [c] = await self.sample(prompt_ids, params)
        for i, (t, lp) in enumerate(zip(c.tokens, c.logprobs, strict=True)):
            yield TokenChunk((t,), (lp,), c.version, "stop" if i == len(c.tokens) - 1 else None)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    settings = Settings(model=MODEL, port=0, data_dir=tmp_path_factory.mktemp("tools"), train=False)
    server = LiveServer(settings, ScriptedBackend(build_backend(settings))).start()
    yield server
    server.stop()


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_tool_call_is_parsed_into_openai_tool_calls(live: LiveServer, client: openai.OpenAI):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "read a.txt"}],
                                       tools=TOOLS, tool_choice="auto", extra_headers={"X-Session-Id": "tool-1"})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    [call] = ch.message.tool_calls or []
    assert call.type == "function" and call.function.name == "read_file" and call.id
    assert json.loads(call.function.arguments) == {"path": "a.txt", "lines": 3}
    [turn] = live.running.store.session_turns("tool-1")  # type: ignore[union-attr]
    assert turn.finish_reason == "tool_calls" and turn.response["tool_calls"][0]["id"] == call.id
    assert list(turn.prompt_ids) == live.proxy.renderer.render(turn.messages, turn.tools)


def test_streamed_tool_call_arrives_as_an_indexed_delta(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "read a.txt"}], tools=TOOLS, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0]
    assert deltas[0].function.name == "read_file" and deltas[0].id
    assert json.loads(deltas[0].function.arguments) == {"path": "a.txt", "lines": 3}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_replayed_tool_call_with_rewritten_id_continues_the_untagged_session(live: LiveServer, client: openai.OpenAI):
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "untagged tool session"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    rewritten = call.id.replace("_", "")
    compact_args = json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": rewritten, "type": "function", "function": {"name": "read_file", "arguments": compact_args}}]},
        {"role": "tool", "tool_call_id": rewritten, "content": "line one"},
    ]
    client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    proxy = live.proxy
    assert proxy.sessions.counts["matched"] >= 1
    live.settle()
    store = live.running.store  # type: ignore[union-attr]
    with store.engine.connect() as conn:
        import sqlalchemy as sa
        from clawbridge.store import schema as t

        sid = conn.execute(sa.select(t.turns.c.session_id).order_by(t.turns.c.created_at.desc())).first()[0]
    first, _ = store.session_turns(sid)
    assert first.next_state == [{"role": "tool", "tool_call_id": rewritten, "content": "line one"}]
