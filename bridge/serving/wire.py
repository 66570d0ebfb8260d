"""The OpenAI wire format: request validation (pydantic), response/chunk/error builders (dicts).

Requests are validated with pydantic so every malformed field gets a precise 400. Responses are
built as plain dicts and serialised with orjson: they are produced per token on the streaming hot
path, where constructing a model per chunk would cost more than the whole relay hop.

Only OpenAI's own keys survive validation (`extra="ignore"`): clawbridge's session keys and any
other non-standard key are dropped before the request reaches the renderer or the model.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SESSION_BODY_KEYS = ("session_id", "turn_type", "session_done")
# Bounds at the door: a body nested deeper than this (tool schemas, content parts, tool_choice,
# the JSON inside tool-call arguments) is refused before anything recursive (json, deepcopy,
# the store's codec) sees it; a session id is a key, not a payload.
MAX_DEPTH = 64
MAX_SESSION_ID = 256
INT64 = 2**63


class APIError(Exception):
    """An error that leaves the API edge as `{"error": {...}}` with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- requests -----------------------------------------------------------------------------------


def json_object(raw: bytes) -> dict[str, Any]:
    """A small JSON request body (an empty one is `{}`), or a 400."""
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"The body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object.")
    return body


def invalid(e: ValidationError, what: str) -> APIError:
    """The 400 for a body that failed validation: its first error, and the field it names."""
    err = e.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return APIError(400, f"Invalid {what}: {err['msg']}", param=param)


def nesting_depth(obj: Any) -> int:
    """The depth of parsed JSON (a scalar is 0, `[]` is 1), without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > deepest:
            deepest = depth
            if deepest > MAX_DEPTH:
                return deepest
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def text_depth(text: str) -> int:
    """The bracket depth of JSON text, valid or not (strings skipped), without parsing it."""
    if text.count("{") + text.count("[") <= MAX_DEPTH:  # the usual case: one C pass each
        return 0
    depth = deepest = 0
    for b in _BRACKETS.findall(_JSON_STRING.sub("", text)):
        depth = depth + 1 if b in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def check_depth(data: dict[str, Any]) -> None:
    if nesting_depth(data) > MAX_DEPTH:
        raise APIError(400, f"The request is nested more than {MAX_DEPTH} levels deep.", code="invalid_value")
    messages = data.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        for j, c in enumerate(calls if isinstance(calls, list) else ()):
            fn = c.get("function") if isinstance(c, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str) and text_depth(args) > MAX_DEPTH:
                raise APIError(
                    400, f"Tool-call arguments are nested more than {MAX_DEPTH} levels deep.",
                    param=f"messages.{i}.tool_calls.{j}.function.arguments", code="invalid_value",
                )


class _Lenient(BaseModel):
    # strict: `stream: "yes"` or `n: "2"` is a 400, as at OpenAI, never a guess
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Lenient):
    name: str
    arguments: str = ""


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _parts_are_typed(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if "type" not in part:
                    raise ValueError("every content part needs a `type`")
        return v


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # names and schemas are checked by the renderer (validate_tools), the one authority on tools


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatRequest(_Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)  # int64, as at OpenAI
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    def dicts(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
        """(messages, tools or None, the other parameters) as plain dicts without unset fields:
        what is rendered and recorded. One dump of the whole request (a dump per message costs
        several times more on an agent's long history)."""
        d = self.model_dump(exclude_none=True)
        messages, tools = d.pop("messages"), d.pop("tools", None) or None
        del d["model"]
        return messages, tools, d


def parse_chat_request(raw: bytes) -> tuple[ChatRequest, dict[str, Any]]:
    """Validate a chat completions body; returns the request and the clawbridge session keys
    found in it."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return chat_request(data)


def chat_request(data: dict[str, Any], names: Mapping[str, str] | None = None) -> tuple[ChatRequest, dict[str, Any]]:
    """Validate a chat request given as parsed JSON (a chat body, or another wire format's
    request translated into one); returns the request and clawbridge's session keys. `names`:
    the client's names for chat fields (`max_tokens` is `max_output_tokens` in the Responses
    API), so an error names the field the client sent."""
    check_depth(data)
    ours = session_keys({k: data.pop(k) for k in SESSION_BODY_KEYS if k in data})
    try:
        return ChatRequest.model_validate(data), ours
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if param is not None and names:
            param = names.get(param, param)
        raise APIError(400, f"Invalid value for '{param}': {err['msg']}", param=param) from None


def session_id(value: Any, param: str) -> str | None:
    """A session id as sent (header, path or body): a string of printable characters, at most
    MAX_SESSION_ID long; empty means none. Anything else is a 400, never coerced into a key."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise APIError(400, f"Invalid type for '{param}': expected a string.", param=param, code="invalid_type")
    if len(value) > MAX_SESSION_ID or not value.isprintable():
        raise APIError(
            400, f"Invalid '{param}': at most {MAX_SESSION_ID} printable characters.", param=param,
            code="invalid_value",
        )
    return value or None


def session_keys(ours: dict[str, Any]) -> dict[str, Any]:
    """clawbridge's body keys, type-checked: session_id a string, turn_type a string,
    session_done a boolean (or the strings a header would carry)."""
    out: dict[str, Any] = {}
    if "session_id" in ours:
        out["session_id"] = session_id(ours["session_id"], "session_id")
    for key, types in (("turn_type", (str,)), ("session_done", (bool, str))):
        if key in ours and ours[key] is not None:
            v = ours[key]
            if not isinstance(v, types) or (isinstance(v, str) and len(v) > 16):
                raise APIError(400, f"Invalid value for '{key}'.", param=key, code="invalid_type")
            out[key] = v
    return out


# --- responses ----------------------------------------------------------------------------------


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def assistant_message(
    content: str | None, reasoning: str | None, tool_calls: list[dict[str, Any]] | None
) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    msg["refusal"] = None
    return msg


def logprobs_content(
    tokens: list[str],
    logprobs: list[float],
    top: list[list[tuple[str, float]]] | None,
) -> dict[str, Any]:
    """OpenAI's `choice.logprobs` object: one entry per sampled token."""
    content = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8", "surrogatepass")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "surrogatepass"))}
                    for t, v in (top[i] if top else ())
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_body(
    id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int],
    created: int | None = None,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": fingerprint,
    }


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def chunk_bytes(
    id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    usage: dict[str, int] | None = None,
    fingerprint: str | None = None,
) -> bytes:
    """One SSE event of a `chat.completion.chunk`. `delta=None` gives the usage-only chunk."""
    choices: list[dict[str, Any]] = []
    if delta is not None:
        choices.append(
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        )
    obj: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
    }
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(err: APIError) -> bytes:
    """An error after streaming began: the status line is gone, so it travels as an event."""
    return b"data: " + orjson.dumps(err.body()) + b"\n\n"
