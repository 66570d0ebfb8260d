"""The assistant message, its streaming deltas and tool calls, and the tags of the chat format
(reasoning, Hermes-style tool calls, end-of-turn tokens) that the renderer and decoder share."""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)



Mode = Literal["content", "reasoning", "tool"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# End-of-turn tokens of the families we serve; only those present in the vocabulary are used.
END_TOKENS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
    "<end_of_turn>", "</s>",
)
ROLES = {"system", "developer", "user", "assistant", "tool"}
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# Between two content (or reasoning) segments separated by a removed tag.
SEGMENT_SEP = "\n"


class RenderError(ValueError):
    """A request the renderer cannot turn into a prompt (the API edge answers HTTP 400)."""


class PromptTooLong(RenderError):
    """The prompt has at least `tokens` tokens, at least the limit asked for: it was not
    turned into ids (a list of millions of ints costs the interpreter, and nobody needs it)."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"the prompt has {tokens} tokens; the limit is {limit}")
        self.tokens, self.limit = tokens, limit


# --- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as the OpenAI API carries it
    type: Literal["function"] = "function"

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class AssistantMessage:
    content: str | None
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str

    def to_openai(self) -> dict[str, Any]:
        """The `message` of a chat completion choice."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed tool call. Calls are emitted whole (name and complete arguments) once their
    `</tool_call>` closes: malformed JSON must be able to fall back to content."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Delta:
    """One streamed event; exactly one field is set."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_call: ToolCallDelta | None = None


def merge_deltas(deltas: Sequence[Delta]) -> dict[str, Any] | None:
    """Several deltas as one OpenAI `choices[0].delta` object (None when there is nothing)."""
    merged: dict[str, Any] = {}
    for d in deltas:
        if d.content is not None:
            merged["content"] = merged.get("content", "") + d.content
        if d.reasoning_content is not None:
            merged["reasoning_content"] = merged.get("reasoning_content", "") + d.reasoning_content
        if d.tool_call is not None:
            merged.setdefault("tool_calls", []).append(d.tool_call.to_openai())
    return merged or None


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)
