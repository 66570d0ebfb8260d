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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from clawbridge.chat.prefix import Recent, snapshot

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


# --- incremental prompts ------------------------------------------------------------------------


@dataclass
class _Entry:
    """One rendered request, kept so the next request of its conversation renders only what is
    new. Text ends are per message count: `ends[j]` is the length of the text of the first `j`
    request messages without the generation prompt (-1 where not known)."""

    raw: list[Any]  # a snapshot of the request's messages (compared, never changed)
    sig: bytes  # tools and tool_choice, serialised: equal bytes render equally
    norm: list[dict[str, Any]]  # the normalised messages the template saw
    tools: list[dict[str, Any]] | None  # the template's `tools`
    shift: int  # 1 when normalisation inserted a system message (the fallback tool block)
    text: str  # the prompt text, generation prompt included
    ends: list[int]
    ids: tuple[int, ...] = ()
    cuts: array = field(default_factory=lambda: array("l"))  # char offsets just after a splitting added token ...
    cut_ids: array = field(default_factory=lambda: array("l"))  # ... and the number of ids up to there


class _PromptCache:
    """The last few rendered requests, found by their messages: a new request reuses the entry
    that shares its longest message prefix (compared by value, exactly; a hash never decides).

    Two levels of reuse:
    - text: for prefix-stable templates (probed at construction), the template renders only the
      new messages, in a small context (the first message and the last shared one), and the
      shared prefix's text is taken from the entry. Three small renders instead of one whose cost
      grows with the conversation.
    - tokens: added tokens (`<|im_start|>`, `<|im_end|>`, ...) are split out before BPE runs, so
      the ids of the text up to just after one of them never depend on what follows. The new
      text reuses the entry's ids up to the last such boundary inside their common text prefix
      and tokenises the rest.
    """

    def __init__(self, tokenizer: Any, size: int) -> None:
        self._tok = tokenizer.backend_tokenizer
        self.size = size
        self.entries: Recent[_Entry] = Recent(size)
        # Tokens whose flags let them eat neighbouring whitespace are not safe boundaries.
        self._split_ids = frozenset(
            i for i, t in tokenizer.added_tokens_decoder.items() if not (t.lstrip or t.rstrip)
        )
        self.hits = 0  # token ids reused
        self.text_hits = 0  # text rendered incrementally
        self.lock = threading.RLock()  # the proxy may render from a thread pool

    def encode(self, entry: _Entry, base: _Entry | None) -> None:
        """Fill `entry.ids` (and its boundaries), reusing `base`'s ids where the texts agree."""
        text = entry.text
        start, cuts, cut_ids = 0, array("l"), array("l")
        prefix_ids: tuple[int, ...] = ()
        if base is not None:
            common = _common_prefix_len(base.text, text)
            j = bisect.bisect_right(base.cuts, common) - 1
            if j >= 0:
                start = base.cuts[j]
                prefix_ids = base.ids[: base.cut_ids[j]]
                cuts, cut_ids = base.cuts[: j + 1], base.cut_ids[: j + 1]
                self.hits += 1
        enc = self._tok.encode(text[start:], add_special_tokens=False)
        new = enc.ids
        n0 = len(prefix_ids)
        split = self._split_ids
        offsets = enc.offsets  # built on each access: once
        for k, tid in enumerate(new):
            if tid in split:
                cuts.append(start + offsets[k][1])
                cut_ids.append(n0 + k + 1)
        entry.ids = prefix_ids + tuple(new)
        entry.cuts, entry.cut_ids = cuts, cut_ids


def _signature(tools: Any, tool_choice: Any) -> bytes | None:
    """Tools and tool_choice as bytes, or None when they are not plain JSON (then: no cache)."""
    try:
        return orjson.dumps([tools, tool_choice])
    except TypeError:
        return None


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


def _is_message_list(messages: Any) -> bool:
    return isinstance(messages, list | tuple) and bool(messages)


def _probe_sessions() -> list[list[list[dict[str, Any]]]]:
    """Conversations growing request by request, in the shapes agents send: a rebuilt last
    message (OpenClaw's internal context), plain growth without a system message, tool calls
    with consecutive results, reasoning, and a branch back into the history."""
    sys_ = {"role": "system", "content": "Be brief. 😀 中文 é"}
    u = [{"role": "user", "content": f"question {i} ¿?  \n"} for i in range(4)]
    a = [{"role": "assistant", "content": f" answer {i} "} for i in range(4)]
    ctx = [{"role": "user", "content": [{"type": "text", "text": f"internal context {i}"}]} for i in range(4)]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "probe_tool", "arguments": '{"x": "1"}'}},
        {"id": "c2", "type": "function", "function": {"name": "probe_tool", "arguments": '{"x": "2"}'}},
    ]}
    r1, r2 = ({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"} for i in (1, 2))
    think = {"role": "assistant", "content": "done", "reasoning_content": "let me think"}
    return [
        [[sys_, u[0], ctx[0]], [sys_, u[0], a[0], u[1], ctx[1]], [sys_, u[0], a[0], u[1], a[1], u[2], ctx[2]]],
        # a request sent twice (a client's retry), then continued
        [[sys_, u[0], ctx[0]], [sys_, u[0], ctx[0]], [sys_, u[0], a[0], u[1], ctx[1]]],
        [[u[0]], [u[0], a[0], u[1]], [u[0], a[0], u[1], a[1], u[2]], [u[0], a[0], u[3]]],
        [[sys_, u[0]], [sys_, u[0], call, r1, r2], [sys_, u[0], call, r1, r2, a[1], u[1]],
         [sys_, u[0], call, r1, r2, a[1], u[1], think, u[2]]],
        [[sys_, u[0], think, u[1]], [sys_, u[0], think, u[1], think, u[2]]],
        # an earlier turn that renders differently once a new user message arrives (Qwen3 drops
        # reasoning before the last user query) must be caught here: the small context of an
        # incremental render does not contain it
        [[sys_, u[0], think, r1], [sys_, u[0], think, r1, u[1], ctx[1]]],
        [[sys_, u[0], think], [sys_, u[0], think, u[1]]],
    ]


_PROBE_SESSIONS = _probe_sessions()
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}}}}


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
        self._direct: Callable[[list[dict[str, Any]], Any, bool], str] | None = None
        self.tool_role_ok = self._probe_tool_role()
        self.opens_think = self._probe_opens_think()
        self._direct = self._direct_template()
        self._cache = _PromptCache(tokenizer, cache_size) if incremental else None
        # The text the generation prompt adds; set only where the template is prefix-stable, which
        # turns the text-level incremental render on (see `_probe_incremental`).
        self._gen_suffix: str | None = None
        if self._cache is not None:
            self._probe_incremental()

    # prompts

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> list[int]:
        """Prompt token ids, generation prompt included. A request that extends one rendered
        recently renders and tokenises only what is new (`_PromptCache`); the ids are exactly
        those of a full render."""
        sig = _signature(tools, tool_choice) if self._cache is not None else None
        if self._cache is None or sig is None or not _is_message_list(messages):
            return self._encode(self.render_text(messages, tools, tool_choice))
        cache = self._cache
        with cache.lock:
            found = cache.entries.find(messages, lambda e: e.sig == sig)
            base = found.item if found is not None else None
            entry = None
            if found is not None and self._gen_suffix is not None:
                entry = self._extend(found.item, found.shared, messages)
                if entry is not None:
                    cache.text_hits += 1
            if entry is None:
                entry = self._render_entry(messages, tools, tool_choice, sig)
            # A new conversation still shares its opening (a system prompt, the template's
            # default one) with the last one rendered: its ids are reused up to a boundary.
            cache.encode(entry, base or cache.entries.newest())
            cache.entries.put(entry.raw, entry, found)
            return list(entry.ids)

    def _render_entry(
        self, messages: Sequence[Mapping[str, Any]], tools: Any, tool_choice: Any, sig: bytes
    ) -> _Entry:
        """A full render, remembering where the last two messages end for the next request."""
        msgs, native_tools = self.normalise(messages, tools, tool_choice)
        text = self._template_text(msgs, native_tools)
        n, shift = len(messages), len(msgs) - len(messages)
        ends = [-1] * (n + 1)
        g = self._gen_suffix
        if g is not None and text.endswith(g):
            ends[n] = len(text) - len(g)
            if n >= 2:  # agents often rebuild their last message each time (FACTS.md, OpenClaw)
                head = self._template_text(msgs[: n - 1 + shift], native_tools, generation=False)
                if text.startswith(head):
                    ends[n - 1] = len(head)
        return _Entry([snapshot(m) for m in messages], sig, msgs, native_tools, shift, text, ends)

    def _extend(self, base: _Entry, k: int, messages: Sequence[Mapping[str, Any]]) -> _Entry | None:
        """Render `messages`, which share `k` messages with `base`, from the largest known text
        boundary j <= k: the template sees the first message, message j-1 and the new messages;
        the difference of two renders of that small context is the new text. Returns None where
        that context shows a dependency on what follows (then the caller renders in full)."""
        j = k
        while j > 0 and base.ends[j] < 0:
            j -= 1
        if j == 0:
            return None
        n, shift, g = len(messages), base.shift, self._gen_suffix
        assert g is not None
        native = self.supports_tools
        new = [self._message(i, messages[i], native) for i in range(j, n)]
        norm = base.norm[: j + shift] + new
        last = j + shift - 1
        ctx = [norm[0]] if last == 0 else [norm[0], norm[last]]
        before = self._template_text(ctx, base.tools, generation=False)
        head = self._template_text(ctx + new[:-1], base.tools, generation=False) if new[:-1] else before
        full = self._template_text(ctx + new, base.tools)
        if not (full.startswith(head) and head.startswith(before) and full.endswith(g)):
            return None
        prefix = base.text[: base.ends[j]]
        text = prefix + full[len(before):]
        ends = base.ends[: j + 1] + [-1] * (n - j)
        if j < n:  # a repeated request (nothing new) keeps the base's boundaries as they are
            ends[n - 1] = len(prefix) + len(head) - len(before)
        ends[n] = len(text) - len(g)
        raw = [*base.raw[:j], *(snapshot(m) for m in messages[j:])]
        return _Entry(raw, base.sig, norm, base.tools, shift, text, ends)

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

    def _template_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool = True
    ) -> str:
        if self._direct is not None and not any("reasoning_content" in m for m in messages):
            try:
                return self._direct(messages, tools, generation)
            except Exception as e:
                raise RenderError(f"the chat template rejected the messages: {e}") from e
        return self._apply_template(messages, tools, generation)

    def _apply_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.chat_template,
                add_generation_prompt=generation, tokenize=False, **self.template_kwargs,
            )
        except Exception as e:  # jinja raise_exception / TemplateError: the request is at fault
            raise RenderError(f"the chat template rejected the messages: {e}") from e
        return str(text)

    def _direct_template(self) -> Callable[[list[dict[str, Any]], Any, bool], str] | None:
        """The chat template, compiled once and called as `apply_chat_template` calls it.

        `apply_chat_template` spends a third to half of a small render preparing its inputs
        (copying every message and tool into plain data, dropping None values, aliasing reasoning
        fields). What `normalise` gives is plain data already, with no None values, so the
        template is called directly, with the same variables (the special tokens, then the
        template kwargs). Messages with reasoning still go through `apply_chat_template` (it
        adds aliases for them). Used only where it renders every probe request exactly as
        `apply_chat_template` does; a transformers without the compiler keeps the slow path."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.chat_template)
        except Exception:
            return None
        # `Template.render` merges the environment's globals (a ChainMap) into a fresh dict on
        # every call; merged once here, each render's context is this dict plus the messages.
        variables = {**compiled.globals, **self.tokenizer.special_tokens_map, **self.template_kwargs}
        concat, body = compiled.environment.concat, compiled.root_render_func

        def render(messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
            ctx = compiled.new_context(
                {**variables, "messages": messages, "tools": tools, "documents": None,
                 "add_generation_prompt": generation},
                shared=True,
            )
            return str(concat(body(ctx)))

        for session in _PROBE_SESSIONS:
            for msgs in session:
                for tools in ([_PROBE_TOOL], None):
                    try:
                        norm, native = self.normalise(msgs, tools)
                        if any("reasoning_content" in m for m in norm):
                            continue
                        wants = [self._apply_template(norm, native, g) for g in (True, False)]
                    except RenderError:
                        continue
                    try:
                        if [render(norm, native, g) for g in (True, False)] != wants:
                            return None
                    except Exception:
                        return None
        return render

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

    def _probe_incremental(self) -> None:
        """Decide what the prompt cache may reuse here, by rendering probe sessions both ways.

        Text reuse needs a prefix-stable template: the generation prompt is a constant suffix,
        and a message renders the same whatever follows it. Templates that look ahead (a Qwen3
        template drops earlier reasoning once a new user query arrives) fail the probe and keep
        full renders; token reuse is then probed alone (a tokenizer whose tail changes earlier
        ids disables it)."""
        assert self._cache is not None
        self._gen_suffix = self._probe_generation_suffix()
        if self._gen_suffix is not None and not self._probe_sessions():
            log.info("text-level incremental rendering disabled: the chat template is not prefix-stable")
            self._gen_suffix = None
        if self._gen_suffix is None and not self._probe_sessions():
            log.warning("incremental prompt rendering disabled: it differs from a full render here")
            self._cache = None
            return
        self._cache = _PromptCache(self.tokenizer, self._cache.size)  # without the probes' entries

    def _probe_generation_suffix(self) -> str | None:
        suffix = None
        for session in _PROBE_SESSIONS:
            for msgs in session:
                try:
                    norm, tools = self.normalise(msgs, [_PROBE_TOOL])
                    on = self._template_text(norm, tools)
                    off = self._template_text(norm, tools, generation=False)
                except RenderError:
                    continue
                if not on.startswith(off) or suffix not in (None, on[len(off):]):
                    return None
                suffix = on[len(off):]
        return suffix or None

    def _probe_sessions(self) -> bool:
        """Every probe request through a fresh cache gives the ids of a full render."""
        assert self._cache is not None
        self._cache = _PromptCache(self.tokenizer, self._cache.size)
        for tools in ([_PROBE_TOOL], None):
            for session in _PROBE_SESSIONS:
                for msgs in session:
                    try:
                        expected = self._encode(self.render_text(msgs, tools))
                    except RenderError:
                        continue
                    if self.render(msgs, tools) != expected:
                        return False
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
