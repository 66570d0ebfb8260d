"""POST /v1/completions: a plain prompt, no chat template.

The prompt is tokenised as it is (or taken as token ids when it is a list of ints) and the
completion decoded as raw text: no reasoning or tool-call parsing, only the end-of-turn tokens
and the `stop` strings end it. Admission, sampling and capture are every wire format's (`pipeline`); the turn
records the prompt as one user message (`request_params.api = "completions"` says it was not
templated) and the text as the assistant's reply.
"""

from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from clawbridge.chat.decode import token_bytes_table
from clawbridge.chat.messages import AssistantMessage, Delta
from clawbridge.serving import pipeline, wire
from clawbridge.serving.metrics import Metrics
from clawbridge.serving.pipeline import Answer, Endpoint
from clawbridge.serving.proxy import Ask, Draft, Proxy
from clawbridge.serving.wire import APIError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for this endpoint
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: wire.StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-wire.INT64, lt=wire.INT64)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v


class TextDecoder:
    """Completion ids → raw text deltas: UTF-8 reassembled across tokens, a trailing end token
    dropped, text cut at the first stop string (a possible start of one is held back)."""

    def __init__(self, table: Sequence[bytes], stop_ids: Iterable[int], stops: Sequence[str]) -> None:
        self._table, self._stop_ids, self._stops = table, frozenset(stop_ids), tuple(s for s in stops if s)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._held_end: int | None = None
        self._buf, self._stopped = "", False
        self._text: list[str] = []
        self._finish: str | None = None

    def feed(self, token_ids: Iterable[int]) -> list[Delta]:
        data = bytearray()
        for t in token_ids:
            if self._held_end is not None:
                data += self._table[self._held_end]
                self._held_end = None
            if t in self._stop_ids:
                self._held_end = t
            elif 0 <= t < len(self._table):
                data += self._table[t]
        return self._push(self._utf8.decode(bytes(data)), final=False)

    def finish(self, finish_reason: str = "stop") -> list[Delta]:
        if self._finish is not None:
            return []
        self._held_end = None
        out = self._push(self._utf8.decode(b"", final=True), final=True)
        self._finish = finish_reason
        return out

    def message(self) -> AssistantMessage:
        return AssistantMessage("".join(self._text), None, (), self._finish or "stop")

    def _push(self, text: str, *, final: bool) -> list[Delta]:
        if self._stopped:
            return []
        buf = self._buf + text
        cut = min((i for s in self._stops if (i := buf.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._stopped, buf, self._buf = True, buf[:cut], ""
        elif final:
            self._buf = ""
        else:  # hold what may begin a stop string
            keep = max((k for s in self._stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                        if buf.endswith(s[:k])), default=0)
            buf, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep:]
        if not buf:
            return []
        self._text.append(buf)
        return [Delta(content=buf)]


@functools.lru_cache(maxsize=4)
def _bytes_table(tokenizer: Any) -> list[bytes]:
    return token_bytes_table(tokenizer)


def _decoder(proxy: Proxy, d: Draft) -> TextDecoder:
    return TextDecoder(_bytes_table(proxy.renderer.tokenizer), proxy.renderer.stop_token_ids, d.params.stop)


def _prompt_ids(proxy: Proxy, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = list(proxy.renderer.tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        vocab = len(_bytes_table(proxy.renderer.tokenizer))
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"Invalid 'prompt': token ids must be in [0, {vocab}).", param="prompt")
    else:
        raise APIError(400, "One prompt per request: a string, or a list of token ids.", param="prompt")
    if not ids:
        raise APIError(400, "Invalid 'prompt': it is empty.", param="prompt")
    return ids


def _ask(proxy: Proxy, body: CompletionRequest, keys: dict[str, Any], size: int) -> Ask:
    """A plain prompt as admission reads it: its token ids, untemplated, recorded as one user
    message; the turn records this endpoint's own parameters."""
    ids = _prompt_ids(proxy, body.prompt)
    req = wire.ChatRequest.model_construct(
        model=body.model, messages=[], n=body.n, stream=body.stream, stream_options=body.stream_options,
        stop=body.stop, max_tokens=body.max_tokens, max_completion_tokens=None,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs, tools=None, tool_choice=None,
        user=body.user,
    )
    params = {k: v for k, v in body.model_dump(exclude_none=True).items() if k not in ("model", "prompt")}
    messages = [{"role": "user", "content": proxy.renderer.decode(ids)}]
    return Ask(req, keys, messages, None, {**params, "api": "completions"}, size, prompt=ids)


async def _admit(proxy: Proxy, request: Request, raw: bytes) -> _Call:
    data = pipeline.parse_body(raw)
    keys = wire.session_keys({k: data.pop(k) for k in wire.SESSION_BODY_KEYS if k in data})
    try:
        body = CompletionRequest.model_validate(data)
    except ValidationError as e:
        raise wire.invalid(e, "request") from None
    if body.echo or body.suffix is not None or (body.best_of or body.n) != body.n:
        what = "echo" if body.echo else "suffix" if body.suffix is not None else "best_of"
        raise APIError(400, f"'{what}' is not supported.", param=what)
    d = await proxy.admit(request, await proxy.off_loop(len(raw), _ask, proxy, body, keys, len(raw)))
    d.id = f"cmpl-{os.urandom(12).hex()}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _Call(d, body.n, body.stream, body.logprobs, include_usage)


@dataclass
class _Call:
    draft: Draft
    n: int
    streaming: bool
    logprobs: int | None
    include_usage: bool

    async def answer(self, proxy: Proxy, request: Request) -> Response:
        d = self.draft
        if self.streaming:
            return await pipeline.stream(proxy, d, _Events(self, proxy), _decoder(proxy, d))
        answers = await pipeline.complete(proxy, d, request, self.n, lambda: _decoder(proxy, d))
        choices = [self.choice(proxy, i, a.message.content or "", a.completion.tokens, a.completion.logprobs,
                               a.completion.top_logprobs, _finish(a.message.finish_reason))
                   for i, a in enumerate(answers)]
        ntok = sum(len(a.completion.tokens) for a in answers)
        return Response(wire.dumps(self.body(choices, wire.usage(len(d.prompt_ids), ntok))),
                        media_type="application/json")

    def body(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        d = self.draft
        out = {"id": d.id, "object": "text_completion", "created": d.created, "model": d.model,
               "system_fingerprint": f"policy@v{d.version}", "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def choice(self, proxy: Proxy, index: int, text: str, tokens: Sequence[int], lps: Sequence[float],
               top: Any, finish: str | None, offset: int = 0) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            entries = pipeline.token_logprobs(proxy, tokens, lps, top)
            offsets, pos = [], offset
            for e in entries:
                offsets.append(pos)
                pos += len(e["token"])
            logprobs = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
                        if self.logprobs else None,
                        "text_offset": offsets}
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def _finish(reason: str) -> Literal["stop", "length"]:
    return "length" if reason == "length" else "stop"


class _Events:
    def __init__(self, call: _Call, proxy: Proxy) -> None:
        self.call, self.proxy, self.offset = call, proxy, 0

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        return b"data: " + wire.dumps(self.call.body(choices, usage)) + b"\n\n"

    def start(self) -> list[bytes]:
        return []

    def deltas(
        self, deltas: list[Delta], tokens: Sequence[int], logprobs: Sequence[float], top: Any = None
    ) -> list[bytes]:
        text = "".join(d.content or "" for d in deltas)
        if not text and not tokens:
            return []
        ch = self.call.choice(self.proxy, 0, text, tokens, logprobs, None, None, self.offset)
        self.offset += len(text)
        return [self._chunk([ch])]

    def finish(self, a: Answer) -> list[bytes]:
        out = [self._chunk([{"text": "", "index": 0, "logprobs": None,
                             "finish_reason": _finish(a.message.finish_reason)}])]
        if self.call.include_usage:
            out.append(self._chunk([], wire.usage(a.prompt_tokens, len(a.completion.tokens))))
        return [*out, wire.DONE]

    def error(self, err: APIError) -> list[bytes]:
        return [wire.error_event(err)]


def routes(proxy: Proxy, metrics: Metrics) -> list[BaseRoute]:
    run = Endpoint(proxy, metrics, _admit)
    return [Route("/v1/completions", run, methods=["POST"]),
            Route("/s/{session_id}/v1/completions", run, methods=["POST"])]
