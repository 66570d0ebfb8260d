"""POST /v1/chat/completions: OpenAI's chat completions, the proxy's native wire format.

The request is validated on its own schema (`wire.ChatRequest`) and admitted as it is; the answer
is a `chat.completion` (n choices, each naming the turn it is stored as) or a stream of
`chat.completion.chunk` events (the role first, then one per delta, the finish, the usage when
`stream_options.include_usage` asks, and `[DONE]`). `X-Turn-Id` names the stored turn(s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clawbridge.chat.messages import Delta
from clawbridge.serving import pipeline, wire
from clawbridge.serving.metrics import Metrics
from clawbridge.serving.pipeline import Answer, Endpoint
from clawbridge.serving.proxy import Ask, Draft, Proxy
from clawbridge.serving.wire import APIError
from clawbridge.store.records import new_turn_id
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

PATH = "/v1/chat/completions"


async def _admit(proxy: Proxy, request: Request, raw: bytes) -> ChatCall:
    req, keys = await proxy.off_loop(len(raw), wire.parse_chat_request, raw)
    d = await proxy.admit(request, Ask.of(req, keys, len(raw)))
    return ChatCall(d, req)


@dataclass
class ChatCall:
    draft: Draft
    req: wire.ChatRequest

    async def answer(self, proxy: Proxy, request: Request) -> Response:
        d, req = self.draft, self.req
        if req.stream:
            d.turn_ids = [new_turn_id()]  # named before the first byte: the header tells the client its turn
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await pipeline.stream(proxy, d, ChatEvents(proxy, d, include_usage),
                                         headers={"X-Turn-Id": d.turn_ids[0]})
        d.turn_ids = [new_turn_id() for _ in range(req.n)]  # so every choice can name its turn
        answers = await pipeline.complete(proxy, d, request, req.n)
        choices = [
            {
                "index": i,
                "message": pipeline.reply_of(a.message),
                "logprobs": proxy.logprobs(a.completion.tokens, a.completion.logprobs, a.completion.top_logprobs)
                if d.logprobs else None,
                "finish_reason": a.message.finish_reason,
                "turn_id": d.turn_ids[i],  # for feedback, or an outcome when n > 1 (a group)
            }
            for i, a in enumerate(answers)
        ]
        ntok = sum(len(a.completion.tokens) for a in answers)
        body = wire.completion_body(d.id, d.model, choices, wire.usage(len(d.prompt_ids), ntok), d.created,
                                    fingerprint=f"policy@v{d.version}")
        return Response(wire.dumps(body), media_type="application/json", headers={"X-Turn-Id": ",".join(d.turn_ids)})


def _delta(d: Delta) -> dict[str, Any]:
    if d.tool_call is not None:
        return {"tool_calls": [d.tool_call.to_openai()]}
    if d.reasoning_content is not None:
        return {"reasoning_content": d.reasoning_content}
    return {"content": d.content}


class ChatEvents:
    """`chat.completion.chunk` events. A token's logprob rides on the first delta that shows its
    text; those of tokens that showed none leave with the finish."""

    def __init__(self, proxy: Proxy, d: Draft, include_usage: bool) -> None:
        self.proxy, self.d, self.include_usage = proxy, d, include_usage
        self.fingerprint = f"policy@v{d.version}"
        # tokens sampled but not yet sent with a delta, with their logprobs and alternatives
        self.pending: list[tuple[int, float, Any]] = []

    def _event(self, delta: dict[str, Any] | None, **kw: Any) -> bytes:
        d = self.d
        return wire.chunk_bytes(d.id, d.model, d.created, delta, fingerprint=self.fingerprint, **kw)

    def _logprobs(self) -> dict[str, Any] | None:
        taken, self.pending = self.pending, []
        if not self.d.logprobs or not taken:
            return None
        tokens, lps, tops = zip(*taken, strict=True)
        return self.proxy.logprobs(tokens, lps, tops if any(t is not None for t in tops) else None)

    def start(self) -> list[bytes]:
        return [self._event({"role": "assistant", "content": ""})]

    def deltas(
        self, deltas: list[Delta], tokens: Sequence[int], logprobs: Sequence[float], top: Sequence[Any] | None = None
    ) -> list[bytes]:
        self.pending += zip(tokens, logprobs, top or [None] * len(tokens), strict=True)
        return [self._event(_delta(delta), logprobs=self._logprobs() if i == 0 else None)
                for i, delta in enumerate(deltas)]

    def finish(self, a: Answer) -> list[bytes]:
        out = [self._event({}, finish_reason=a.message.finish_reason, logprobs=self._logprobs())]
        if self.include_usage:
            out.append(self._event(None, usage=wire.usage(a.prompt_tokens, len(a.completion.tokens))))
        return [*out, wire.DONE]

    def error(self, err: APIError) -> list[bytes]:
        return [wire.error_event(err)]


def endpoint(proxy: Proxy, metrics: Metrics) -> Endpoint:
    return Endpoint(proxy, metrics, _admit)


def routes(run: Endpoint) -> list[BaseRoute]:
    return [Route(PATH, run, methods=["POST"]), Route(f"/s/{{session_id}}{PATH}", run, methods=["POST"])]
