"""Messages ↔ token ids with the model's own chat template.

One renderer serves every backend, so what is trained is exactly what was sampled:

- `Renderer.render(messages, tools, tool_choice)` → prompt token ids (generation prompt included),
  via the tokenizer's chat template after normalising OpenAI message shapes. Templates without tool
  support get the Hermes-style fallback (tool schemas in the system message, `<tool_call>` JSON).
  Long sessions re-tokenise only what is new (see `PromptCache`), with the same ids as a full render.
- `Renderer.parse(completion_ids, finish_reason)` → `AssistantMessage` (content, reasoning,
  tool calls). Token ids are the truth: text is derived from them through a per-token byte table
  and never re-tokenised.
- `Renderer.stream()` → `decode.StreamDecoder`, the same parser fed chunk by chunk; `parse` is that
  decoder fed once, so streamed deltas concatenate to exactly the parsed message.

docs/renderer.md documents the fallback format; docs/measurements.md has its timings.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from clawbridge.chat.cache import Entry, PromptCache, request_signature
from clawbridge.chat.decode import StreamDecoder, token_bytes_table
from clawbridge.chat.messages import (
    END_TOKENS,
    ROLES,
    THINK_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    AssistantMessage,
    PromptTooLong,
    RenderError,
    new_tool_call_id,
)
from clawbridge.chat.prefix import snapshot
from clawbridge.chat.tools import (
    content_text,
    select_tools,
    tool_call_in,
    tool_system_block,
    validate_tools,
)

log = logging.getLogger(__name__)
LONG_TEXT = 64 * 1024  # characters from which a prompt is tokenised without holding the GIL


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
        self._longest_token = max(1, *(len(b) for b in self._table))
        backend = tokenizer.backend_tokenizer
        ids = [tokenizer.eos_token_id] + [backend.token_to_id(t) for t in END_TOKENS]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))
        self._direct: Callable[[list[dict[str, Any]], Any, bool], str] | None = None
        self.tool_role_ok = self._probe_tool_role()
        self.opens_think = self._probe_opens_think()
        self._direct = self._direct_template()
        self._cache = PromptCache(tokenizer, cache_size) if incremental else None
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
        *,
        use_cache: bool = True,
        limit: int | None = None,
    ) -> list[int]:
        """Prompt token ids, generation prompt included. A request that extends one rendered
        recently renders and tokenises only what is new (`PromptCache`); the ids are exactly
        those of a full render. `use_cache=False` neither reads nor holds the cache (its lock
        included): for a huge prompt rendered off the event loop while others render on it.
        `limit`: a prompt of at least this many tokens raises PromptTooLong (uncached renders)."""
        sig = request_signature(tools, tool_choice) if self._cache is not None and use_cache else None
        if self._cache is None or sig is None or not _is_message_list(messages):
            return self._encode(self.render_text(messages, tools, tool_choice), limit)
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
    ) -> Entry:
        """A full render, remembering where the last two messages end for the next request."""
        msgs, native_tools = self.normalise(messages, tools, tool_choice)
        text = self._template_text(msgs, native_tools)
        n, shift = len(messages), len(msgs) - len(messages)
        ends = [-1] * (n + 1)
        g = self._gen_suffix
        if g is not None and text.endswith(g):
            ends[n] = len(text) - len(g)
            if n >= 2:  # agents often rebuild their last message each time (OpenClaw does)
                head = self._template_text(msgs[: n - 1 + shift], native_tools, generation=False)
                if text.startswith(head):
                    ends[n - 1] = len(head)
        return Entry([snapshot(m) for m in messages], sig, msgs, native_tools, shift, text, ends)

    def _extend(self, base: Entry, k: int, messages: Sequence[Mapping[str, Any]]) -> Entry | None:
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
        return Entry(raw, base.sig, norm, base.tools, shift, text, ends)

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
        offered = select_tools(validate_tools(tools), tool_choice)
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
        content = content_text(m.get("content"), f"messages[{i}].content")
        out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            raise RenderError(f"messages[{i}]: only assistant messages carry tool_calls")
        parsed = [tool_call_in(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(calls)]
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

    def _encode(self, text: str, limit: int | None = None) -> list[int]:
        backend = self.tokenizer.backend_tokenizer
        if len(text) < LONG_TEXT:
            return list(backend.encode(text, add_special_tokens=False).ids)
        # `encode` holds the interpreter lock for the whole call (seconds for megabytes: every
        # other thread, the event loop included, stops); `encode_batch` releases it while the
        # tokenizer works. The count is known before the ids become Python ints.
        if limit is not None and len(text) >= limit * self._longest_token:
            # no token covers more than `_longest_token` bytes (so characters): too long for sure
            raise PromptTooLong(len(text) // self._longest_token, limit)
        enc = backend.encode_batch([text], add_special_tokens=False)[0]
        if limit is not None and len(enc) >= limit:
            raise PromptTooLong(len(enc), limit)
        return list(enc.ids)

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
        self._cache = PromptCache(self.tokenizer, self._cache.size)  # without the probes' entries

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
        self._cache = PromptCache(self.tokenizer, self._cache.size)
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
