"""POST /v1/messages: Anthropic's Messages API, translated onto the chat admission and capture.

Request → chat messages:

    system (a string or text blocks)      a leading system message
    user: text blocks                     a user message
    user: tool_result blocks              tool messages (tool_use_id is the tool call's id), first
    assistant: thinking / text / tool_use reasoning_content / content / tool_calls
    tools {name, description, input_schema}, tool_choice auto | any | tool | none

The answer → content blocks `thinking`, `text`, `tool_use` (its id is the tool call's id, so a
tool_result sent back names the captured call) and a stop_reason (end_turn, max_tokens,
stop_sequence, tool_use). Streaming sends message_start, ping, content_block_start / _delta /
_stop per block, message_delta and message_stop. Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}`. A key comes as `x-api-key` or a bearer token.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from clawbridge.chat.messages import Delta, RenderError
from clawbridge.serving import pipeline, wire
from clawbridge.serving.metrics import Metrics
from clawbridge.serving.pipeline import Answer, Endpoint
from clawbridge.serving.proxy import Ask, Draft, Proxy
from clawbridge.serving.streaming import sse
from clawbridge.serving.wire import APIError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

# The `anthropic-version` header: a dated version (the SDKs send their own date, 2026-10-21 for
# anthropic 2.10). The request and answer shapes here are those every version since 2023-06-01
# shares, so any date from 2023-01-01 on is accepted; anything else is refused, as Anthropic
# refuses it. The header is optional here (curl users forget it).
_VERSION = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
FIRST_VERSION = "2023-01-01"
# chat request fields → this API's names for them, so an error names the field the client sent
RENAMED = {"stop": "stop_sequences"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def _bad(message: str) -> APIError:
    return APIError(400, message)


def error_response(err: APIError) -> Response:
    request_id = f"req_{os.urandom(12).hex()}"
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message},
            "request_id": request_id}
    return Response(wire.dumps(body), status_code=err.status, media_type="application/json",
                    headers={"request-id": request_id})


def check_auth(proxy: Proxy, request: Request) -> None:
    """`x-api-key` (what the anthropic SDK sends) or `Authorization: Bearer`."""
    got = request.headers.get("x-api-key")
    if got is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        got = token.strip() if scheme.lower() == "bearer" else ""
    try:
        proxy.check_auth(request, got)
    except APIError:
        raise APIError(401, "invalid x-api-key", code="invalid_api_key") from None


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad(f"{where}: expected a string or a list of content blocks")
    return content


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    texts = []
    for k, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}.{k}: content blocks of type {b.get('type')!r} are not supported here "
                       "(only text is)")
        texts.append(b["text"])
    return "\n".join(texts)


def to_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(_blocks(system, "system"), "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: expected a non-empty list")
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: expected 'user' or 'assistant', got {role!r}")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if role == "user":
            texts = []
            for k, b in enumerate(blocks):
                kind = b.get("type")
                if kind == "tool_result":
                    content = b.get("content", "")
                    text = content if isinstance(content, str) else _text(_blocks(content, f"{where}.content.{k}.content"), f"{where}.content.{k}.content")
                    if not isinstance(b.get("tool_use_id"), str):
                        raise _bad(f"{where}.content.{k}.tool_use_id: expected a string")
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
                elif kind == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                else:
                    raise _bad(f"{where}.content.{k}: content blocks of type {kind!r} are not supported "
                               "(text and tool_result are)")
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        texts, thoughts, calls = [], [], []
        for k, b in enumerate(blocks):
            kind = b.get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "thinking" and isinstance(b.get("thinking"), str):
                thoughts.append(b["thinking"])
            elif kind == "redacted_thinking":
                continue
            elif (kind == "tool_use" and isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                  and isinstance(b.get("input", {}), dict)):
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            else:
                raise _bad(f"{where}.content.{k}: content blocks of type {kind!r} are not supported "
                           "(text, thinking and tool_use are)")
        if texts:
            reply["content"] = "\n".join(texts)
        if thoughts:
            reply["reasoning_content"] = "\n".join(thoughts)
        if calls:
            reply["tool_calls"] = calls
        out.append(reply)
    if out[-1]["role"] == "assistant":
        raise _bad("messages: a final assistant message (prefill) is not supported; end with a user message")
    return out


def to_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools.{i}: only client tools {{name, description, input_schema}} are supported, "
                       f"not {kind!r}")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def to_tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if mapped is None:
        raise _bad("tool_choice: expected {type: auto | any | tool | none}")
    return mapped


async def _admit(proxy: Proxy, request: Request, raw: bytes) -> _Call:
    version = request.headers.get("anthropic-version")
    if version is not None and not (_VERSION.match(version) and version >= FIRST_VERSION):
        raise _bad(f"anthropic-version: {version!r} is not a valid version (a date, {FIRST_VERSION} or later)")
    body = pipeline.parse_body(raw)
    if not isinstance(body.get("max_tokens"), int):
        raise _bad("max_tokens: Field required (an integer)")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("stop_sequences: expected a list of strings")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": to_messages(body),
        "tools": to_tools(body.get("tools")),
        "tool_choice": to_tool_choice(body.get("tool_choice")),
        "stream": body.get("stream", False),
        "max_tokens": body["max_tokens"],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "stop": stops or None,
    }
    for key in ("session_id", "turn_type", "session_done"):  # clawbridge's own body keys
        if key in body:
            chat[key] = body[key]
    req, keys = wire.chat_request({k: v for k, v in chat.items() if v is not None}, RENAMED)
    d = await proxy.admit(request, Ask.of(req, keys, len(raw), names=RENAMED, api={"api": "messages"}))
    return _Call(d, req.stream, "msg_" + pipeline.turn_hex(d))


def stop_reason(a: Answer, proxy: Proxy, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer."""
    fin = a.message.finish_reason
    if fin == "tool_calls":
        return "tool_use", None
    if fin == "length":
        return "max_tokens", None
    toks = a.completion.tokens
    if stops and not (toks and toks[-1] in proxy.renderer.stop_token_ids):
        text = proxy.renderer.decode(toks)
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def content_blocks(a: Answer) -> list[dict[str, Any]]:
    msg = a.message
    blocks: list[dict[str, Any]] = []
    if msg.reasoning_content:
        blocks.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
    if msg.content:
        blocks.append({"type": "text", "text": msg.content})
    for c in msg.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    return blocks


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


@dataclass
class _Call:
    draft: Draft
    streaming: bool
    id: str

    async def answer(self, proxy: Proxy, request: Request) -> Response:
        if self.streaming:
            return await pipeline.stream(proxy, self.draft, _Events(self, proxy))
        [a] = await pipeline.complete(proxy, self.draft, request)
        reason, seq = stop_reason(a, proxy, self.draft.params.stop)
        body = {**self.message([], None, None), "content": content_blocks(a), "stop_reason": reason,
                "stop_sequence": seq, "usage": _usage(a.prompt_tokens, len(a.completion.tokens))}
        return Response(wire.dumps(body), media_type="application/json")

    def message(self, content: list[Any], reason: str | None, seq: str | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.draft.model,
                "content": content, "stop_reason": reason, "stop_sequence": seq,
                "usage": _usage(len(self.draft.prompt_ids), 0)}


class _Events:
    """Anthropic's stream: one content block open at a time."""

    def __init__(self, call: _Call, proxy: Proxy) -> None:
        self.call, self.proxy = call, proxy
        self.index = -1
        self.open: str | None = None  # "text" | "thinking"

    def start(self) -> list[bytes]:
        return [sse("message_start", {"type": "message_start", "message": self.call.message([], None, None)}),
                sse("ping", {"type": "ping"})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*out, sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        return sse("content_block_start",
                           {"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def deltas(self, deltas: list[Delta], tokens: Any, logprobs: Any, top: Any = None) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if d.tool_call is not None:
                tc = d.tool_call
                out += self._close()
                out.append(self._start({"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}}))
                out.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(_input(tc.arguments))}))
                out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
                continue
            kind = "thinking" if d.reasoning_content is not None else "text"
            if self.open != kind:
                out += self._close()
                out.append(self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                       else {"type": "text", "text": ""}))
                self.open = kind
            if kind == "thinking":
                out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning_content}))
            else:
                out.append(self._delta({"type": "text_delta", "text": d.content or ""}))
        return out

    def finish(self, a: Answer) -> list[bytes]:
        reason, seq = stop_reason(a, self.proxy, self.call.draft.params.stop)
        return [*self._close(),
                sse("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": seq},
                                              "usage": {"output_tokens": len(a.completion.tokens)}}),
                sse("message_stop", {"type": "message_stop"})]

    def error(self, err: APIError) -> list[bytes]:
        return [sse("error", {"type": "error", "error": {
            "type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}})]


def routes(proxy: Proxy, metrics: Metrics) -> list[BaseRoute]:
    run = Endpoint(proxy, metrics, _admit, error=error_response, auth=lambda request: check_auth(proxy, request))

    async def count_tokens(request: Request) -> Response:
        """The prompt's length in tokens, rendered as /v1/messages would render it; nothing is
        sampled or recorded."""
        try:
            check_auth(proxy, request)
            body = pipeline.parse_body(await proxy.read_body(request))
            if not isinstance(body.get("model"), str):
                raise _bad("model: Field required")
            if body["model"] != proxy.model_name:
                raise APIError(404, f"model: {body.get('model')!r} is not served here ({proxy.model_name})")
            try:
                ids = proxy.renderer.render(to_messages(body), to_tools(body.get("tools")),
                                            to_tool_choice(body.get("tool_choice")))
            except RenderError as e:
                raise _bad(str(e)) from None
        except APIError as e:
            return error_response(e)
        return Response(wire.dumps({"input_tokens": len(ids)}), media_type="application/json")

    return [Route("/v1/messages", run, methods=["POST"]),
            Route("/s/{session_id}/v1/messages", run, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
