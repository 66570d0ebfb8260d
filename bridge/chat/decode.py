"""Completion token ids → assistant message deltas, chunk by chunk. Token ids are the truth: text
is derived from them through a per-token byte table and never re-tokenised; tags (`<think>`,
`<tool_call>`) split content, reasoning and tool calls, also when a tag spans chunks."""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from clawbridge.chat.messages import (
    SEGMENT_SEP,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    AssistantMessage,
    Delta,
    Mode,
    ToolCall,
    ToolCallDelta,
    new_tool_call_id,
)

log = logging.getLogger(__name__)


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
