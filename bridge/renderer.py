"""Messages ↔ token ids with the model's own chat template.

One renderer serves every backend, so what is trained is exactly what was sampled:

- `Renderer.render(messages, tools, tool_choice)` → prompt token ids (generation prompt included),
  via the tokenizer's chat template after normalising OpenAI message shapes. Templates without tool
  support get the Hermes-style fallback (tool schemas in the system message, `<tool_call>` JSON).
  Long sessions re-tokenise only what is new (see `_PromptCache`), with the same ids as a full render.
- `Renderer.parse(completion_ids, finish_reason)` → `AssistantMessage` (content, reasoning,
  tool calls). Token ids are the truth: text is derived from them through a per-token byte table
  and never re-tokenised.
- `Renderer.stream()` → `StreamDecoder`, the same parser fed chunk by chunk; `parse` is that
  decoder fed once, so streamed deltas concatenate to exactly the parsed message.

docs/renderer.md documents the fallback format and the measured figures.
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import json
import logging
import re
import secrets
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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


# --- token bytes --------------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte ↔ printable-unicode map, inverted (char → byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes_table(tokenizer: Any) -> list[bytes]:
    """The exact bytes each token id stands for, so a completion decodes with O(1) work per token
    and multi-byte characters split across tokens are reassembled by an incremental UTF-8 decoder.
    Added tokens (specials, `<think>`, ...) stand for their literal content."""
    backend = tokenizer.backend_tokenizer
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values()) + 1)
    if "ByteLevel" in repr(backend.decoder):
        # str.translate + latin-1 maps GPT-2's printable alphabet back to bytes at C speed.
        to_bytes = {ord(c): b for c, b in _byte_level_alphabet().items()}
        for tok, i in vocab.items():
            try:
                table[i] = tok.translate(to_bytes).encode("latin-1")
            except UnicodeEncodeError:
                table[i] = tok.encode()
    else:  # SentencePiece style: ▁ is a space, <0xNN> is a raw byte (byte fallback)
        for tok, i in vocab.items():
            m = _SP_BYTE.match(tok)
            table[i] = bytes([int(m.group(1), 16)]) if m else tok.replace("▁", " ").encode()
    for i, added in tokenizer.added_tokens_decoder.items():
        if i < len(table):
            table[i] = added.content.encode()
    return table


# --- streaming decode ---------------------------------------------------------------------------


def _partial_suffix(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`.
    Only a pattern's first character can start such a suffix, so `find` skips the rest in C."""
    best, end = 0, len(text)
    for p in patterns:
        n = min(len(p) - 1, end)
        i = text.find(p[0], end - n)
        while i >= 0 and end - i > best:
            if p.startswith(text[i:]):
                best = end - i
                break
            i = text.find(p[0], i + 1)
    return best


def _earliest(text: str, patterns: Iterable[str], start: int = 0) -> tuple[int, str]:
    pos, hit = -1, ""
    for p in patterns:
        i = text.find(p, start)
        if i >= 0 and (pos < 0 or i < pos):
            pos, hit = i, p
    return pos, hit


def _parse_tool_json(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON string) of a Hermes/Qwen `<tool_call>` body, or None if malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


_NEXT_MODE: dict[str, Mode] = {THINK_OPEN: "reasoning", THINK_CLOSE: "content", TOOL_OPEN: "tool"}


class StreamDecoder:
    """Completion token ids in, OpenAI-shaped deltas out, O(new tokens) per call.

    Three layers, each holding back only what it cannot decide yet:
    1. bytes → text: an incremental UTF-8 decoder keeps incomplete trailing bytes (no U+FFFD from a
       character split across tokens); a trailing end token is held until we know it is the last.
    2. stop strings: text that might begin a stop string is held; on a match the rest is dropped.
    3. tags: `<think>…</think>` is reasoning, `<tool_call>…</tool_call>` a tool call; text that
       might begin a tag is held. Whitespace next to a removed tag or at either end is dropped
       (a content/reasoning segment is stripped), segments are joined by a newline.
    """

    def __init__(
        self,
        table: Sequence[bytes],
        stop_token_ids: Iterable[int] = (),
        stop: Sequence[str] = (),
        *,
        starts_in_reasoning: bool = False,
        id_factory: Callable[[], str] = new_tool_call_id,
    ) -> None:
        self._table = table
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = tuple(s for s in stop if s)
        self._new_id = id_factory
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._held_end: int | None = None
        self._stop_buf = ""
        self._stopped = False
        self._mode: Mode = "reasoning" if starts_in_reasoning else "content"
        self._buf = ""
        self._scan = 0  # where to resume looking for </tool_call> in a growing tool body
        self._ws = ""  # trailing whitespace of the current segment, held until text follows it
        self._segment_start = True
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._finish: str | None = None

    # public API

    def feed(self, token_ids: Iterable[int]) -> list[Delta]:
        if self._finish is not None:
            raise RuntimeError("feed() after finish()")
        data = bytearray()
        for t in token_ids:
            if self._held_end is not None:
                data += self._table[self._held_end]
                self._held_end = None
            if t in self._stop_ids:
                self._held_end = t
            else:
                data += self._table[t] if 0 <= t < len(self._table) else b""
        out: list[Delta] = []
        self._push_raw(self._utf8.decode(bytes(data)), out)
        return out

    def finish(self, finish_reason: str = "stop") -> list[Delta]:
        """Flush everything held (a trailing end token is dropped) and fix the finish reason."""
        if self._finish is not None:
            return []
        out: list[Delta] = []
        self._held_end = None
        self._push_raw(self._utf8.decode(b"", final=True), out)
        if not self._stopped:
            rest, self._stop_buf = self._stop_buf, ""
            self._push_tagged(rest, out)
        self._flush_tags(out)
        self._finish = "tool_calls" if self._calls else finish_reason
        return out

    @property
    def finish_reason(self) -> str | None:
        return self._finish

    def message(self) -> AssistantMessage:
        if self._finish is None:
            raise RuntimeError("message() before finish()")
        content = "".join(self._content)
        reasoning = "".join(self._reasoning)
        return AssistantMessage(
            content=content if content or not self._calls else None,
            reasoning_content=reasoning or None,
            tool_calls=tuple(self._calls),
            finish_reason=self._finish,
        )

    # layer 2: stop strings

    def _push_raw(self, text: str, out: list[Delta]) -> None:
        if self._stopped or not text:
            return
        if not self._stops:
            self._push_tagged(text, out)
            return
        buf = self._stop_buf + text
        pos, _ = _earliest(buf, self._stops)
        if pos >= 0:
            self._stopped, self._stop_buf = True, ""
            self._push_tagged(buf[:pos], out)
            return
        keep = _partial_suffix(buf, self._stops)
        self._stop_buf = buf[len(buf) - keep:]
        self._push_tagged(buf[: len(buf) - keep], out)

    # layer 3: tags

    def _push_tagged(self, text: str, out: list[Delta]) -> None:
        self._buf += text
        while self._buf:
            if self._mode == "tool":
                i = self._buf.find(TOOL_CLOSE, self._scan)
                if i < 0:
                    self._scan = max(0, len(self._buf) - len(TOOL_CLOSE) + 1)
                    return
                body, self._buf, self._scan = self._buf[:i], self._buf[i + len(TOOL_CLOSE):], 0
                self._mode = "content"
                self._close_tool(body, closed=True, out=out)
                continue
            if "<" not in self._buf:  # every tag starts with "<": the common case is one check
                safe, self._buf = self._buf, ""
                self._emit(safe, out, segment_end=False)
                return
            tags = (THINK_CLOSE,) if self._mode == "reasoning" else (TOOL_OPEN, THINK_OPEN)
            pos, tag = _earliest(self._buf, tags)
            if pos < 0:
                keep = _partial_suffix(self._buf, tags)
                safe, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                self._emit(safe, out, segment_end=False)
                return
            before, self._buf = self._buf[:pos], self._buf[pos + len(tag):]
            self._emit(before, out, segment_end=True)
            self._mode = _NEXT_MODE[tag]

    def _flush_tags(self, out: list[Delta]) -> None:
        rest, self._buf = self._buf, ""
        if self._mode == "tool":
            self._mode = "content"
            self._close_tool(rest, closed=False, out=out)
            self._emit("", out, segment_end=True)
        else:
            self._emit(rest, out, segment_end=True)

    def _close_tool(self, body: str, *, closed: bool, out: list[Delta]) -> None:
        parsed = _parse_tool_json(body.strip())
        if parsed is None:  # malformed: the raw block stays visible as content
            raw = TOOL_OPEN + body + (TOOL_CLOSE if closed else "")
            self._emit(raw, out, segment_end=True)
            return
        call = ToolCall(id=self._new_id(), name=parsed[0], arguments=parsed[1])
        self._calls.append(call)
        out.append(Delta(tool_call=ToolCallDelta(len(self._calls) - 1, call.id, call.name, call.arguments)))

    def _emit(self, text: str, out: list[Delta], *, segment_end: bool) -> None:
        """Release text of the current content/reasoning segment, stripping the segment."""
        if self._segment_start:
            text = text.lstrip()
        if text:
            joined = self._ws + text
            body = joined.rstrip()
            self._ws = joined[len(body):]
            if body:
                parts = self._reasoning if self._mode == "reasoning" else self._content
                if self._segment_start and parts:
                    body = SEGMENT_SEP + body
                self._segment_start = False
                parts.append(body)
                out.append(Delta(reasoning_content=body) if self._mode == "reasoning" else Delta(content=body))
        if segment_end:
            self._ws, self._segment_start = "", True


# --- incremental prompt tokenisation ------------------------------------------------------------


@dataclass
class _Entry:
    text: str
    ids: array  # token ids of `text`
    cuts: array  # char offsets just after a splitting added token ...
    cut_ids: array  # ... and the number of ids up to that offset
    keys: list[int] = field(default_factory=list)


class _PromptCache:
    """Re-tokenise only the new tail of a growing conversation.

    Added tokens (`<|im_start|>`, `<|im_end|>`, ...) are split out before BPE runs, so the ids of
    the text up to just after one of them never depend on what follows. A new prompt reuses the
    ids of a cached prompt up to the last such boundary inside their longest common text prefix
    and tokenises the rest. Entries are found by hashes of message prefixes (the longest shared
    prefix of messages wins, so sessions sharing a system prompt do not collide); correctness
    rests on the text comparison, never on the hash.
    """

    def __init__(self, tokenizer: Any, size: int) -> None:
        self._tok = tokenizer.backend_tokenizer
        self._size = size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._keys: dict[int, int] = {}
        self._next = 0
        # Tokens whose flags let them eat neighbouring whitespace are not safe boundaries.
        self._split_ids = frozenset(
            i for i, t in tokenizer.added_tokens_decoder.items() if not (t.lstrip or t.rstrip)
        )
        self.hits = 0
        self._lock = threading.Lock()  # the proxy may render from a thread pool

    def encode(self, text: str, keys: Sequence[int]) -> list[int]:
        with self._lock:
            return self._encode(text, keys)

    def _encode(self, text: str, keys: Sequence[int]) -> list[int]:
        base = self._lookup(keys)
        start, prefix_ids, cuts, cut_ids = 0, array("l"), array("l"), array("l")
        if base is not None:
            common = _common_prefix_len(base.text, text)
            j = bisect.bisect_right(base.cuts, common) - 1
            if j >= 0:
                start = base.cuts[j]
                prefix_ids = base.ids[: base.cut_ids[j]]
                cuts, cut_ids = base.cuts[: j + 1], base.cut_ids[: j + 1]
                self.hits += 1
        enc = self._tok.encode(text[start:], add_special_tokens=False)
        ids = prefix_ids + array("l", enc.ids)
        n0 = len(prefix_ids)
        for k, (tid, (_, end)) in enumerate(zip(enc.ids, enc.offsets, strict=True)):
            if tid in self._split_ids:
                cuts.append(start + end)
                cut_ids.append(n0 + k + 1)
        self._store(_Entry(text, ids, cuts, cut_ids), keys)
        return ids.tolist()

    def _lookup(self, keys: Sequence[int]) -> _Entry | None:
        for key in reversed(keys):
            slot = self._keys.get(key)
            if slot is not None and slot in self._entries:
                self._entries.move_to_end(slot)
                return self._entries[slot]
        return None

    def _store(self, entry: _Entry, keys: Sequence[int]) -> None:
        slot, self._next = self._next, self._next + 1
        entry.keys = list(keys)
        self._entries[slot] = entry
        for key in keys:
            self._keys[key] = slot
        while len(self._entries) > self._size:
            _, old = self._entries.popitem(last=False)
            for key in old.keys:
                if self._keys.get(key) not in self._entries:
                    self._keys.pop(key, None)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _prefix_keys(messages: Sequence[Mapping[str, Any]], tools: Any) -> list[int]:
    """A chained hash per message prefix. Python's string hash runs in C; the long contents
    (a 40 K-character system prompt) are hashed as they are, only small extra fields as JSON."""
    key = hash(json.dumps(tools, sort_keys=True)) if tools else 0
    keys = []
    for m in messages:
        rest = {k: v for k, v in m.items() if k not in ("role", "content")}
        key = hash((key, m.get("role"), m.get("content"), json.dumps(rest, sort_keys=True) if rest else None))
        keys.append(key)
    return keys


# --- the renderer -------------------------------------------------------------------------------


def _template_variables(template: str) -> set[str]:
    try:
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return set(meta.find_undeclared_variables(env.parse(template)))
    except Exception:  # unparseable here: fall back to a word search
        return set(re.findall(r"\b\w+\b", template))


class Renderer:
    """Prompts and parses for one tokenizer. Build one per served model and reuse it: the token
    byte table, the template probes and the prompt cache are per instance."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        cache_size: int = 32,
        incremental: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Extra template variables, e.g. {"enable_thinking": False} for Qwen3.
        self.template_kwargs = dict(template_kwargs or {})
        self.chat_template: str = chat_template or tokenizer.chat_template
        if not self.chat_template:
            raise RenderError("the tokenizer has no chat template")
        variables = _template_variables(self.chat_template)
        self.supports_tools = "tools" in variables
        self._passes_reasoning = "reasoning_content" in self.chat_template
        self._table = token_bytes_table(tokenizer)
        backend = tokenizer.backend_tokenizer
        ids = [tokenizer.eos_token_id] + [backend.token_to_id(t) for t in END_TOKENS]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))
        self.tool_role_ok = self._probe_tool_role()
        self.opens_think = self._probe_opens_think()
        self._cache = _PromptCache(tokenizer, cache_size) if incremental else None
        if self._cache is not None and not self._probe_incremental():
            log.warning("incremental prompt rendering disabled: it differs from a full render here")
            self._cache = None

    # prompts

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> list[int]:
        """Prompt token ids, generation prompt included."""
        msgs, native_tools = self.normalise(messages, tools, tool_choice)
        text = self._template_text(msgs, native_tools)
        if self._cache is None:
            return self._encode(text)
        return self._cache.encode(text, _prefix_keys(msgs, native_tools))

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> str:
        msgs, native_tools = self.normalise(messages, tools, tool_choice)
        return self._template_text(msgs, native_tools)

    def normalise(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """OpenAI messages → what this template accepts; returns (messages, tools for the template)."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise RenderError("`messages` must be a non-empty list")
        offered = _select_tools(validate_tools(tools), tool_choice)
        native = self.supports_tools
        out = [self._message(i, m, native) for i, m in enumerate(messages)]
        if native:
            return out, (offered or None)
        if offered:
            block = tool_system_block(offered, tool_choice)
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + block).lstrip()}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, None

    def _message(self, i: int, m: Mapping[str, Any], native: bool) -> dict[str, Any]:
        if not isinstance(m, Mapping):
            raise RenderError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise RenderError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        content = _content_text(m.get("content"), f"messages[{i}].content")
        out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            raise RenderError(f"messages[{i}]: only assistant messages carry tool_calls")
        parsed = [_tool_call_in(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(calls)]
        if role == "tool":
            if isinstance(m.get("tool_call_id"), str):
                out["tool_call_id"] = m["tool_call_id"]
            if not native and not self.tool_role_ok:
                out = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        if native:
            if parsed:
                out["tool_calls"] = [
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                    for cid, name, args in parsed
                ]
            if self._passes_reasoning and isinstance(m.get("reasoning_content"), str):
                out["reasoning_content"] = m["reasoning_content"]
        elif parsed:
            blocks = "\n".join(
                TOOL_OPEN + "\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                + "\n" + TOOL_CLOSE
                for _, name, args in parsed
            )
            out["content"] = (content + "\n" + blocks) if content else blocks
        return out

    def _template_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.chat_template,
                add_generation_prompt=True, tokenize=False, **self.template_kwargs,
            )
        except Exception as e:  # jinja raise_exception / TemplateError: the request is at fault
            raise RenderError(f"the chat template rejected the messages: {e}") from e
        return str(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)

    def _probe_tool_role(self) -> bool:
        try:
            text = self._template_text(
                [{"role": "user", "content": "u"}, {"role": "tool", "content": "PROBE-7f3a"}], None
            )
        except RenderError:
            return False
        return "PROBE-7f3a" in text and "tool" in text.replace("PROBE-7f3a", "")

    def _probe_opens_think(self) -> bool:
        """Whether the generation prompt itself opens a reasoning block (Qwen3 thinking models):
        then a completion starts as reasoning."""
        for probe in ([{"role": "user", "content": "x"}],
                      [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]):
            try:
                return self._template_text(probe, None).rstrip().endswith(THINK_OPEN)
            except RenderError:
                continue
        return False

    def _probe_incremental(self) -> bool:
        """Render a conversation and its extension both ways once; any difference disables the
        cache (a template or tokenizer where the tail changes earlier ids)."""
        assert self._cache is not None
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": "Be brief. 😀 中文 é"},
            {"role": "user", "content": "Hello there  \n"},
        ]
        extended = [*convo, {"role": "assistant", "content": " Hi! ¿Qué tal? "},
                    {"role": "user", "content": "Fine\n\nthanks"}]
        for msgs in (convo, extended, [*convo[:1], {"role": "user", "content": "other"}]):
            try:
                text = self._template_text(msgs, None)
            except RenderError:
                return False
            if self._cache.encode(text, _prefix_keys(msgs, None)) != self._encode(text):
                return False
        self._cache = _PromptCache(self.tokenizer, self._cache._size)
        return True

    # completions

    def stream(self, stop: Sequence[str] = (), *, id_factory: Callable[[], str] = new_tool_call_id) -> StreamDecoder:
        return StreamDecoder(self._table, self.stop_token_ids, stop,
                             starts_in_reasoning=self.opens_think, id_factory=id_factory)

    def parse(
        self,
        completion_ids: Sequence[int],
        finish_reason: str = "stop",
        stop: Sequence[str] = (),
        *,
        id_factory: Callable[[], str] = new_tool_call_id,
    ) -> AssistantMessage:
        decoder = self.stream(stop, id_factory=id_factory)
        decoder.feed(completion_ids)
        decoder.finish(finish_reason)
        return decoder.message()

    def decode(self, ids: Sequence[int]) -> str:
        """Raw text of ids (end tokens included), from the same byte table as parsing."""
        return b"".join(self._table[i] for i in ids).decode("utf-8", "replace")


# --- messages and tools ---------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
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


def _tool_call_in(call: Any, where: str) -> tuple[str, str, Any]:
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


def _select_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
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
