"""POST /v1/responses: OpenAI's Responses API, translated onto the chat admission and capture.

Input items → chat messages (one assistant message gathers the reasoning, text and function calls
that follow one another, so a replayed answer matches the turn that produced it):

    instructions                          a leading system message
    {role, content} / type "message"      a message; input_text / output_text parts are its text
    reasoning                             reasoning_content of the assistant message
    function_call                         a tool call of the assistant message (call_id is its id)
    function_call_output                  a tool message

The answer → output items: `reasoning` (reasoning_text), `message` (output_text, with logprobs
when `include` asks), `function_call`. Streaming sends the documented event sequence:
response.created, response.in_progress, then per item output_item.added, content_part.added,
*.delta, *.done, content_part.done, output_item.done, and response.completed (or .incomplete).

`previous_response_id`: a response is named after the turn that answered it (`resp_<hex>` is
turn `turn-<hex>`), so a chained request is that turn's messages, its reply and the new input, in
that turn's session: the new input is the turn's next state. The previous instructions are not
carried over (as at OpenAI); the request's own are.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from clawbridge.chat.messages import Delta
from clawbridge.serving import pipeline, wire
from clawbridge.serving.metrics import Metrics
from clawbridge.serving.pipeline import Answer, Endpoint
from clawbridge.serving.proxy import Ask, Draft, Proxy
from clawbridge.serving.streaming import sse
from clawbridge.serving.wire import APIError
from clawbridge.store.records import StoredTurn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{32})$")
# chat request fields → this API's names for them, so an error names the field the client sent
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input"}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _str(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise _bad(f"Invalid type for '{key}': expected a string.", key)
    return v


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string, or input_text / output_text / refusal parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"Invalid '{where}': expected a string or a list of content parts.", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}.get(str(kind))
        if key is None or not isinstance(part.get(key), str):
            raise _bad(f"Content part type {kind!r} is not supported by this model (only text is).",
                       f"{where}[{k}]")
        texts.append(part[key])
    return "\n".join(texts)


def to_messages(items: Any) -> list[dict[str, Any]]:
    """Responses input items → chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("Invalid 'input': expected a string or a list of items.", "input")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being gathered

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"Invalid '{where}': expected an object.", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"Invalid '{where}.role': {role!r}.", f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                if turn is not None and (turn["content"] or turn.get("tool_calls")):
                    turn = None  # text after text or calls: the next answer
                assistant()["content"] = text
                continue
            turn = None
            out.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                raise _bad(f"Invalid '{where}.content': expected a list of reasoning_text parts.", f"{where}.content")
            text = "\n".join(p["text"] for p in parts if isinstance(p.get("text"), str))
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                turn = None
            if text:
                assistant()["reasoning_content"] = text
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise _bad(f"Invalid '{where}': a function_call needs string 'call_id', 'name' and 'arguments'.", where)
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"Invalid '{where}.call_id': expected a string.", f"{where}.call_id")
            turn = None
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else _text_of(output, f"{where}.output")})
        elif kind == "item_reference":
            raise _bad("Item references are not supported: send the items, or previous_response_id.", where)
        else:
            raise _bad(f"Input items of type {kind!r} are not supported (message, reasoning, "
                       "function_call and function_call_output are).", f"{where}.type")
    return out


def to_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("Invalid 'tools': expected a list.", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"Tools of type {kind!r} are not supported: only function tools are.", f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def to_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("Invalid 'tool_choice': 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.",
               "tool_choice")


def _previous(turn: StoredTurn) -> list[dict[str, Any]]:
    """The conversation a chained request continues: the turn's messages (without its
    instructions, which are not carried over) and its reply."""
    msgs = list(turn.messages)
    if turn.request_params.get("instructions") and msgs:
        msgs = msgs[1:]
    reply = {k: v for k, v in turn.response.items() if k != "refusal"}
    return [*msgs, reply]


async def _admit(proxy: Proxy, request: Request, raw: bytes) -> _Call:
    body = pipeline.parse_body(raw)
    model = _str(body, "model")
    instructions = body.get("instructions")
    if isinstance(instructions, list):  # input items as instructions
        instructions = "\n".join(m["content"] for m in to_messages(instructions) if m.get("content"))
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("Invalid type for 'instructions': expected a string.", "instructions")
    prev_id = _str(body, "previous_response_id")
    if body.get("conversation") is not None:
        raise _bad("Conversations are not supported: use previous_response_id.", "conversation")
    history: list[dict[str, Any]] = []
    session: str | None = None
    if prev_id is not None:
        m = _RESPONSE_ID.match(prev_id)
        prev = await proxy.store.run(proxy.store.get_turn, f"turn-{m.group(1)}") if m else None
        if prev is not None and proxy.keys.named(request, body.get("user")) not in (None, prev.user):
            prev = None  # another user's response is answered as one that does not exist
        if prev is None:
            raise APIError(400, f"Previous response with id '{prev_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        history, session = _previous(prev), prev.session_id
    if body.get("input") is None and prev_id is None:
        raise _bad("Missing required parameter: 'input'.", "input")
    messages = history + to_messages(body.get("input") if body.get("input") is not None else [])
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise _bad("Invalid 'include': expected a list of strings.", "include")
    logprobs = LOGPROBS_INCLUDE in include
    chat: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "tools": to_tools(body.get("tools")),
        "tool_choice": to_tool_choice(body.get("tool_choice")),
        "stream": body.get("stream", False),
        "max_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "logprobs": logprobs,
        "top_logprobs": body.get("top_logprobs") if logprobs else None,
    }
    for key in ("session_id", "turn_type", "session_done"):  # clawbridge's own body keys
        if key in body:
            chat[key] = body[key]
    if session is not None and "session_id" not in chat:
        chat["session_id"] = session  # the chain is one session (a header still wins)
    req, keys = wire.chat_request({k: v for k, v in chat.items() if v is not None}, RENAMED)
    api = {"api": "responses", **({"instructions": True} if instructions else {}),
           **({"previous_response_id": prev_id} if prev_id else {})}
    d = await proxy.admit(request, Ask.of(req, keys, len(raw), names=RENAMED, api=api))
    call = _Call(d, req.stream, logprobs, instructions, prev_id, body)
    call.id = "resp_" + pipeline.turn_hex(d)
    return call


@dataclass
class _Call:
    draft: Draft
    streaming: bool
    logprobs: bool
    instructions: str | None
    previous_response_id: str | None
    body: dict[str, Any]
    id: str = ""
    created_at: int = field(default_factory=lambda: int(time.time()))

    async def answer(self, proxy: Proxy, request: Request) -> Response:
        if self.streaming:
            return await pipeline.stream(proxy, self.draft, _Events(self, proxy))
        [a] = await pipeline.complete(proxy, self.draft, request)
        items = output_items(a, self.logprobs, proxy)
        return Response(wire.dumps(self.response(items, a)), media_type="application/json")

    def response(self, output: list[dict[str, Any]], a: Answer | None) -> dict[str, Any]:
        """The `response` object; `a` None: still in progress."""
        d, b = self.draft, self.body
        status, incomplete = "in_progress", None
        if a is not None:
            status = "incomplete" if a.message.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        choice = b.get("tool_choice") or "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": b.get("max_output_tokens"),
            "model": d.model,
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": True,
            "temperature": d.params.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": choice,
            "tools": b.get("tools") or [],
            "top_p": d.params.top_p,
            "truncation": "disabled",
            "usage": None if a is None else usage(a),
            "user": None,
            "metadata": b.get("metadata") or {},
        }


def usage(a: Answer) -> dict[str, Any]:
    n = len(a.completion.tokens)
    return {
        "input_tokens": a.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": a.prompt_tokens + n,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _message_item(id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    content = [_text_part(text, logprobs)] if status != "in_progress" else []
    return {"id": id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(a: Answer, logprobs: bool, proxy: Proxy) -> list[dict[str, Any]]:
    msg, c = a.message, a.completion
    items: list[dict[str, Any]] = []
    if msg.reasoning_content:
        items.append(_reasoning_item(_item_id("rs"), msg.reasoning_content, "completed"))
    if msg.content:
        lps = pipeline.token_logprobs(proxy, c.tokens, c.logprobs, c.top_logprobs) if logprobs else None
        items.append(_message_item(_item_id("msg"), msg.content, lps, "completed"))
    for call in msg.tool_calls:
        items.append(_call_item(_item_id("fc"), call.id, call.name, call.arguments, "completed"))
    return items


class _Events:
    """The Responses streaming events, one output item open at a time."""

    def __init__(self, call: _Call, proxy: Proxy) -> None:
        self.call, self.proxy = call, proxy
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished items, in order
        self.open: dict[str, Any] | None = None  # {"kind", "id", "text", "logprobs"}
        # tokens sampled but not yet sent with a delta: the decoder may hold a token's text back
        # (an incomplete UTF-8 sequence, a possible tag start) and send it with a later token's
        self.pending: list[tuple[int, float]] = []

    def _ev(self, type: str, **fields: Any) -> bytes:
        obj = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(type, obj)

    def start(self) -> list[bytes]:
        r = self.call.response([], None)
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def _close(self) -> list[bytes]:
        o, self.open = self.open, None
        if o is None:
            return []
        idx = len(self.items)
        base = {"item_id": o["id"], "output_index": idx, "content_index": 0}
        if o["kind"] == "message":
            part = _text_part(o["text"], o["logprobs"])
            item = _message_item(o["id"], o["text"], o["logprobs"], "completed")
            out = [self._ev("response.output_text.done", **base, text=o["text"], logprobs=o["logprobs"] or []),
                   self._ev("response.content_part.done", **base, part=part)]
        else:
            part = {"type": "reasoning_text", "text": o["text"]}
            item = _reasoning_item(o["id"], o["text"], "completed")
            out = [self._ev("response.reasoning_text.done", **base, text=o["text"]),
                   self._ev("response.content_part.done", **base, part=part)]
        self.items.append(item)
        return [*out, self._ev("response.output_item.done", output_index=idx, item=item)]

    def _open(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["kind"] == kind:
            return []
        out = self._close()
        idx = len(self.items)
        self.open = {"kind": kind, "id": _item_id("msg" if kind == "message" else "rs"), "text": "",
                     "logprobs": [] if self.call.logprobs and kind == "message" else None}
        oid = self.open["id"]
        if kind == "message":
            item, part = _message_item(oid, "", None, "in_progress"), _text_part("", [] if self.call.logprobs else None)
        else:
            item, part = _reasoning_item(oid, "", "in_progress"), {"type": "reasoning_text", "text": ""}
        return [*out, self._ev("response.output_item.added", output_index=idx, item=item),
                self._ev("response.content_part.added", item_id=oid, output_index=idx, content_index=0, part=part)]

    def deltas(self, deltas: list[Delta], tokens: Any, logprobs: Any, top: Any = None) -> list[bytes]:
        out: list[bytes] = []
        self.pending += zip(tokens, logprobs, strict=True)
        for d in deltas:
            # a delta carries every token sampled since the last one; only message text shows them
            taken, self.pending = self.pending, []
            if d.tool_call is not None:
                out += self._close()
                tc, idx, fid = d.tool_call, len(self.items), _item_id("fc")
                out += [
                    self._ev("response.output_item.added", output_index=idx,
                             item=_call_item(fid, tc.id, tc.name, "", "in_progress")),
                    self._ev("response.function_call_arguments.delta", item_id=fid, output_index=idx,
                             delta=tc.arguments),
                    self._ev("response.function_call_arguments.done", item_id=fid, output_index=idx,
                             name=tc.name, arguments=tc.arguments),
                ]
                item = _call_item(fid, tc.id, tc.name, tc.arguments, "completed")
                self.items.append(item)
                out.append(self._ev("response.output_item.done", output_index=idx, item=item))
                continue
            kind, text = ("reasoning", d.reasoning_content) if d.reasoning_content is not None else ("message", d.content or "")
            out += self._open(kind)
            o = self.open
            assert o is not None
            o["text"] += text
            base = {"item_id": o["id"], "output_index": len(self.items), "content_index": 0}
            if kind == "message":
                lps: list[dict[str, Any]] = []
                if o["logprobs"] is not None and taken:
                    toks, vals = zip(*taken, strict=True)
                    lps = pipeline.token_logprobs(self.proxy, toks, vals, None)
                    o["logprobs"] += lps
                out.append(self._ev("response.output_text.delta", **base, delta=text, logprobs=lps))
            else:
                out.append(self._ev("response.reasoning_text.delta", **base, delta=text))
        return out

    def finish(self, a: Answer) -> list[bytes]:
        out = self._close()
        r = self.call.response(self.items, a)
        done = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        return [*out, self._ev(done, response=r)]

    def error(self, err: APIError) -> list[bytes]:
        r = {**self.call.response(self.items, None), "status": "failed",
             "error": {"code": err.code or "server_error", "message": err.message}}
        return [self._ev("error", code=err.code, message=err.message, param=err.param),
                self._ev("response.failed", response=r)]


def routes(proxy: Proxy, metrics: Metrics) -> list[BaseRoute]:
    run = Endpoint(proxy, metrics, _admit)
    return [Route("/v1/responses", run, methods=["POST"]),
            Route("/s/{session_id}/v1/responses", run, methods=["POST"])]

