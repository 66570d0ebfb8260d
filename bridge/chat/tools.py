"""OpenAI tool schemas and message contents: validation at the door, and the Hermes-style tool
block for templates without tool support."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from clawbridge.chat.messages import FUNCTION_NAME, RenderError

log = logging.getLogger(__name__)




def content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RenderError(
                    f"{where}[{k}]: content part type {kind!r} is not supported by this model "
                    "(only 'text' parts are)"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise RenderError(f"{where} must be a string, a list of content parts or null")


def tool_call_in(call: Any, where: str) -> tuple[str, str, Any]:
    """(id, name, arguments as a JSON value) of an assistant's OpenAI tool call."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise RenderError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # invalid JSON is kept as the string sent
            args = json.loads(args) if args.strip() else {}
    return str(call.get("id") or ""), fn["name"], args


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI function tools, checked; raises RenderError saying what is wrong."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise RenderError("`tools` must be a list")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise RenderError(f"{where}: only {{'type': 'function', 'function': {{...}}}} tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise RenderError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise RenderError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in seen:
            raise RenderError(f"{where}: duplicate function name {name!r}")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str | None):
            raise RenderError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, Mapping):
                raise RenderError(f"{where}.function.parameters must be a JSON Schema object")
            if params.get("type", "object") != "object":
                raise RenderError(f"{where}.function.parameters must have type 'object', got {params.get('type')!r}")
            props = params.get("properties", {})
            if not isinstance(props, Mapping) or not all(isinstance(v, Mapping) for v in props.values()):
                raise RenderError(f"{where}.function.parameters.properties must map names to schemas")
            req = params.get("required", [])
            if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
                raise RenderError(f"{where}.function.parameters.required must be a list of names")
        out.append({"type": "function", "function": dict(fn)})
    return out


def select_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
    """The tools the prompt offers: none for "none", the one named by a function choice."""
    if tool_choice in (None, "auto", "required"):
        return tools
    if tool_choice == "none":
        return []
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise RenderError("`tool_choice` must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}")
    chosen = [t for t in tools if t["function"]["name"] == fn["name"]]
    if not chosen:
        raise RenderError(f"`tool_choice` names {fn['name']!r}, which is not among `tools`")
    return chosen


def tool_system_block(tools: Sequence[Mapping[str, Any]], tool_choice: Any = None) -> str:
    """The fallback instruction for templates without tool support (Hermes/Qwen wording)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    block = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if tool_choice == "required":
        block += "\n\nYou must call at least one function."
    elif isinstance(tool_choice, Mapping):
        block += f"\n\nYou must call the function {tools[0]['function']['name']}."
    return block

