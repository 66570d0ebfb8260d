"""The judge prompts: templates are data (`prompts/*.txt`, `$name` placeholders), the rendering
of a turn into them is here.

A judge sees the user's request and recent context, not only (response, next state): the same
"thanks" or "no" means different things after different requests. Real agent prompts are huge
(OpenClaw's system message is ~40 K characters), so every part is cut to a budget, keeping its
head and tail, where instructions and the latest words usually are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from importlib import resources
from string import Template
from typing import Any

from clawbridge.judges.types import Message, TurnContext

INTERNAL_CONTEXT_MARKER = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"  # rebuilt per request; noise

SYSTEM_CHARS = 1500
MESSAGE_CHARS = 1500  # each earlier message
REQUEST_CHARS = 4000
RESPONSE_CHARS = 6000
NEXT_STATE_CHARS = 3000  # each next-state message
EARLIER_MESSAGES = 4  # messages shown before the user's request
AFTER_REQUEST_MESSAGES = 8  # tool calls/results between the request and the response


@cache
def template(name: str) -> Template:
    text = resources.files("clawbridge.judges").joinpath(f"prompts/{name}.txt").read_text("utf-8")
    return Template(text)


def truncate(text: str, limit: int) -> str:
    """At most about `limit` characters: head and tail kept, the middle replaced by a marker."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


def message_text(message: Message) -> str:
    """The readable text of a chat message: string content, text parts (other parts as
    placeholders), and any tool calls it makes."""
    content: Any = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, Sequence):
        pieces = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                pieces.append(f"[{part.get('type', 'part')}]")
        text = "\n".join(pieces)
    else:
        text = ""
    calls = message.get("tool_calls") or ()
    rendered = [_tool_call(c) for c in calls if isinstance(c, dict)]
    return "\n".join(p for p in (text, *rendered) if p)


def _tool_call(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return f"-> calls tool {fn.get('name', '?')}({args})"


def _label(message: Message) -> str:
    role = str(message.get("role", "?"))
    name = message.get("name")
    return f"[{role} {name}]" if role == "tool" and name else f"[{role}]"


def _is_internal(message: Message) -> bool:
    return INTERNAL_CONTEXT_MARKER in message_text(message)


def _render(messages: Sequence[Message], limit: int) -> str:
    return "\n\n".join(f"{_label(m)} {truncate(message_text(m), limit)}" for m in messages)


def render_context(messages: Sequence[Message]) -> str:
    """The prompt the assistant answered, as the judge sees it: the system message (cut), a few
    earlier messages, the user's request, and what the assistant did since (tool round trips)."""
    visible = [m for m in messages if not _is_internal(m)]
    system = [m for m in visible if m.get("role") in ("system", "developer")]
    chat = [m for m in visible if m.get("role") not in ("system", "developer")]
    request_at = max((i for i, m in enumerate(chat) if m.get("role") == "user"), default=None)
    sections = []
    if system:
        text = "\n\n".join(message_text(m) for m in system)
        sections.append("## Instructions the assistant was given (cut)\n" + truncate(text, SYSTEM_CHARS))
    if request_at is None:
        if chat:
            sections.append("## Conversation so far\n" + _render(chat[-EARLIER_MESSAGES:], MESSAGE_CHARS))
        return "\n\n".join(sections)
    earlier = chat[max(0, request_at - EARLIER_MESSAGES) : request_at]
    if earlier:
        sections.append("## Earlier in the conversation\n" + _render(earlier, MESSAGE_CHARS))
    request = truncate(message_text(chat[request_at]), REQUEST_CHARS)
    sections.append("## The user's request\n" + request)
    after = chat[request_at + 1 :]
    if after:
        shown = after[-AFTER_REQUEST_MESSAGES:]
        cut = f" ({len(after) - len(shown)} earlier steps not shown)" if len(shown) < len(after) else ""
        sections.append(f"## What the assistant did since the request{cut}\n" + _render(shown, MESSAGE_CHARS))
    return "\n\n".join(sections)


def render_next_state(next_state: Sequence[Message]) -> str:
    visible = [m for m in next_state if not _is_internal(m)]
    if not visible:
        return "(nothing: the conversation ended after the response)"
    return _render(visible, NEXT_STATE_CHARS)


def render_response(response: Message) -> str:
    return truncate(message_text(response), RESPONSE_CHARS) or "(empty response)"


def judge_messages(kind: str, turn: TurnContext) -> list[dict[str, str]]:
    """The chat messages sent to a judge model; kind is "prm" or "hint"."""
    user = template(f"{kind}_user").substitute(
        context=render_context(turn.messages),
        response=render_response(turn.response),
        next_state=render_next_state(turn.next_state),
    )
    return [
        {"role": "system", "content": template(f"{kind}_system").template.strip()},
        {"role": "user", "content": user.strip()},
    ]
