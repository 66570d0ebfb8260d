"""The same canned answer served directly over the OpenAI API by a minimal aiohttp server: the
baseline every other path is compared with (and the upstream of the relay and of LiteLLM)."""

from __future__ import annotations

import argparse
import json
import time

from aiohttp import web

WORDS = ["Sure", "!", " Here", " is", " a", " short", ",", " canned", " answer", " of", " about",
         " sixteen", " tokens", " for", " you", "."]


def completion(model: str, prompt_tokens: int) -> bytes:
    return json.dumps({
        "id": "chatcmpl-canned", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(WORDS)},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(WORDS),
                  "total_tokens": prompt_tokens + len(WORDS)},
    }).encode()


def chunk(model: str, delta: dict, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({
        "id": "chatcmpl-canned", "object": "chat.completion.chunk", "created": int(time.time()),
        "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }).encode() + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model = body.get("model", "canned")
    if not body.get("stream"):
        return web.Response(body=completion(model, 10), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk(model, {"role": "assistant", "content": ""}))
    for w in WORDS:
        await resp.write(chunk(model, {"content": w}))
    await resp.write(chunk(model, {}, "stop"))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "canned", "object": "model", "owned_by": "bench"}]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
