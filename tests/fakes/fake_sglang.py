"""A faithful fake of SGLang's native HTTP API (0.5.x), with a tiny torch model behind it.

What it reproduces, because clawbridge depends on it:
- `POST /generate` with `input_ids`, `sampling_params` (unknown keys are refused, as SGLang's
  `SamplingParams(**d)` does), `return_logprob`, `logprob_start_len`, `top_logprobs_num`,
  `lora_path`, `stream` (SSE `data: {...}` chunks, cumulative like SGLang's default, then
  `data: [DONE]`); answers carry `output_ids` and `meta_info.output_token_logprobs` as
  `[logprob, token_id, text]`, `input_token_logprobs` from `logprob_start_len` with a leading null,
  `finish_reason` as `{"type": "stop"|"length", ...}`.
- LoRA: `POST /load_lora_adapter {lora_name, lora_path}` reads a PEFT folder; a request is bound
  to the adapter named by `lora_path` *at admission* and keeps it until it finishes;
  `/unload_lora_adapter` waits for the requests using it to drain (SGLang's LoRA registry does);
  a request naming an adapter that is not loaded gets HTTP 400.
- `/health`, `/health_generate` (503 while starting), `/get_model_info`, `/openapi.json`.

It also keeps a log of which adapter served every token of every request (`served`), which real
SGLang does not expose: tests use it to prove no response mixes versions.

Run as a process (`python tests/fakes/fake_sglang.py --port N [--no-model] [--crash-after S]
[--hang-after S] [--exit-after S] [--startup-s S]`) for the supervisor's tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n",
    "sampling_seed", "json_schema", "regex", "ebnf", "stop_regex", "custom_params", "logit_bias",
}
GENERATE_KEYS = {
    "input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "stream", "lora_path", "rid", "return_text_in_logprobs",
    "priority",  # GenerateReqInput.priority: Optional[int], scheduled with --enable-priority-scheduling
}


@dataclass
class Adapter:
    name: str
    path: str
    key: str  # the PEFT adapter name inside the model
    inflight: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)


class FakeSGLang:
    """The server state: a PEFT-wrapped tiny model, the loaded adapters, the request log."""

    def __init__(self, model: Any | None = None, tokenizer: Any | None = None, *, eos_id: int = 2,
                 token_delay_s: float = 0.0, max_lora_rank: int = 64) -> None:
        self.model = model  # a PeftModel (or None: health-only fake for supervisor tests)
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.token_delay_s = token_delay_s
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, Adapter] = {}
        self.requests: list[dict[str, Any]] = []  # every /generate body, as received
        self.served: dict[str, list[str]] = {}  # rid -> adapter name used for each forward
        self.events: list[tuple[float, str, str]] = []  # (time, "load"|"unload", name)
        self.ready_at = 0.0
        self._lock = threading.Lock()  # one forward at a time: adapters are switched per forward
        self._n = 0

    # --- model ----------------------------------------------------------------------------------

    def _forward(self, ids: list[int], adapter: Adapter | None) -> Any:
        import torch

        with self._lock, torch.no_grad():
            x = torch.tensor([ids])
            if adapter is None:
                with self.model.disable_adapter():
                    return self.model(input_ids=x).logits[0].float()
            self.model.set_adapter(adapter.key)
            return self.model(input_ids=x).logits[0].float()

    # --- handlers -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if time.monotonic() >= self.ready_at else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "tiny-random", "tokenizer_path": "tiny-random",
                                  "is_generation": True, "weight_version": "default"})

    async def openapi(self, request: web.Request) -> web.Response:
        paths = ["/generate", "/health", "/health_generate", "/get_model_info",
                 "/load_lora_adapter", "/unload_lora_adapter", "/flush_cache"]
        return web.json_response({"openapi": "3.1.0", "paths": {p: {} for p in paths}})

    async def load_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _fail("lora_name and lora_path are required")
        if name in self.adapters:
            return _fail(f"LoRA adapter {name} is already loaded")
        config_file = Path(path) / "adapter_config.json"
        if not config_file.exists():
            return _fail(f"no adapter_config.json in {path}")
        rank = json.loads(config_file.read_text()).get("r", 0)
        if rank > self.max_lora_rank:
            return _fail(f"LoRA rank {rank} exceeds --max-lora-rank {self.max_lora_rank}")
        self._n += 1
        key = f"a{self._n}"
        if self.model is not None:
            try:
                await asyncio.to_thread(self._load_peft, path, key)
            except Exception as e:
                return _fail(f"failed to load {path}: {e}")
        self.adapters[name] = Adapter(name, path, key)
        self.events.append((time.monotonic(), "load", name))
        return web.json_response({"success": True, "error_message": "",
                                  "loaded_adapters": {n: a.path for n, a in self.adapters.items()}})

    def _load_peft(self, path: str, key: str) -> None:
        with self._lock:
            self.model.load_adapter(path, adapter_name=key)

    async def unload_lora(self, request: web.Request) -> web.Response:
        name = (await request.json()).get("lora_name")
        adapter = self.adapters.get(name)
        if adapter is None:
            return _fail(f"LoRA adapter {name} is not loaded")
        del self.adapters[name]  # no new request can pick it from now on
        if adapter.inflight:
            await adapter.drained.wait()
        if self.model is not None:
            await asyncio.to_thread(self._delete_peft, adapter.key)
        self.events.append((time.monotonic(), "unload", name))
        return web.json_response({"success": True, "error_message": "",
                                  "loaded_adapters": {n: a.path for n, a in self.adapters.items()}})

    def _delete_peft(self, key: str) -> None:
        with self._lock:
            self.model.delete_adapter(key)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        unknown = set(body) - GENERATE_KEYS
        sp = body.get("sampling_params") or {}
        unknown |= set(sp) - SAMPLING_KEYS
        if unknown:
            return _error(f"unexpected keyword argument(s) {sorted(unknown)}")
        if not isinstance(body.get("priority", 0), int):
            return _error("priority must be an integer")
        if "input_ids" not in body:
            return _error("this fake serves input_ids only")
        lora = body.get("lora_path")
        adapter = None
        if lora is not None:
            adapter = self.adapters.get(lora)
            if adapter is None:
                return _error(f"The following requested LoRA adapters are not loaded: {lora}")
            adapter.inflight += 1  # bound at admission, like SGLang's LoRA registry
            adapter.drained.clear()
        try:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                async for out in self._run(body, adapter):
                    await resp.write(b"data: " + json.dumps(out).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            last: dict[str, Any] = {}
            async for out in self._run(body, adapter):
                last = out
            return web.json_response(last)
        finally:
            if adapter is not None:
                adapter.inflight -= 1
                if adapter.inflight == 0:
                    adapter.drained.set()

    async def _run(self, body: dict[str, Any], adapter: Adapter | None):  # type: ignore[no-untyped-def]
        import torch
        from clawbridge.local_gpu.sampling import draw_token
        from clawbridge.types import SamplingParams

        sp = body.get("sampling_params") or {}
        ids = list(body["input_ids"])
        rid = body.get("rid") or f"r{len(self.requests)}"
        name = adapter.name if adapter else "base"
        self.served[rid] = []
        params = SamplingParams(
            max_tokens=int(sp.get("max_new_tokens", 128)), temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)), top_k=int(sp.get("top_k", -1)),
            top_logprobs=int(body.get("top_logprobs_num", 0)),
        )
        gen = torch.Generator().manual_seed(int(sp.get("sampling_seed", 0)) + len(self.requests))
        stop_ids = set(sp.get("stop_token_ids") or ())
        stops = sp.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(ids), "cached_tokens": 0,
                                "finish_reason": None, "completion_tokens": 0}
        want_lp = bool(body.get("return_logprob"))
        if want_lp:
            start = int(body.get("logprob_start_len", -1))
            start = len(ids) - 1 if start < 0 else start
            logits = await asyncio.to_thread(self._forward, ids, adapter)
            self.served[rid].append(name)
            temp = params.temperature if params.temperature > 0 else 1.0
            logp = torch.log_softmax(logits / temp, dim=-1)
            meta["input_token_logprobs"] = [[None, ids[start], None]] + [
                [float(logp[i - 1, ids[i]]), ids[i], None] for i in range(start + 1, len(ids))
            ]
            meta["output_token_logprobs"] = []
            if params.top_logprobs:
                meta["output_top_logprobs"] = []
        out_ids: list[int] = []
        if params.max_tokens == 0:
            meta["finish_reason"] = {"type": "length", "length": 0}
            yield {"text": "", "output_ids": [], "meta_info": meta}
            return
        while True:
            logits = await asyncio.to_thread(self._forward, ids + out_ids, adapter)
            self.served[rid].append(name)
            u = float(torch.rand((), generator=gen))
            d = draw_token(logits[-1], params, u)
            out_ids.append(d.token)
            meta["completion_tokens"] = len(out_ids)
            if want_lp:
                meta["output_token_logprobs"].append([d.logprob, d.token, None])
                if params.top_logprobs:
                    meta["output_top_logprobs"].append([[t.logprob, t.token_id, None] for t in d.top or ()])
            text = self.tokenizer.decode(out_ids) if self.tokenizer is not None else ""
            if d.token in stop_ids or (d.token == self.eos_id and not sp.get("ignore_eos")):
                meta["finish_reason"] = {"type": "stop", "matched": d.token}
            elif any(s and s in text for s in stops):
                meta["finish_reason"] = {"type": "stop", "matched": next(s for s in stops if s in text)}
            elif len(out_ids) >= params.max_tokens:
                meta["finish_reason"] = {"type": "length", "length": params.max_tokens}
            chunk = {"text": text, "output_ids": list(out_ids), "meta_info": json.loads(json.dumps(meta))}
            if body.get("stream") or meta["finish_reason"] is not None:
                yield chunk
            if meta["finish_reason"] is not None:
                return
            await asyncio.sleep(self.token_delay_s)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/load_lora_adapter", self.load_lora)
        app.router.add_post("/unload_lora_adapter", self.unload_lora)
        return app


def _fail(message: str) -> web.Response:
    return web.json_response({"success": False, "error_message": message}, status=400)


def _error(message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "Bad Request",
                              "code": 400}, status=400)


def tiny_peft_model(seed: int = 0, rank: int = 8) -> Any:
    """The tiny random Llama wrapped by PEFT with an inert placeholder adapter, so real adapters
    can be loaded and deleted by name."""
    from clawbridge.local_gpu import models
    from peft import LoraConfig, get_peft_model

    base = models.load_model(models.resolve(models.TINY), seed=seed)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(base, config, adapter_name="placeholder")


async def serve(fake: FakeSGLang, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


# --- process mode (supervisor tests) ---------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--startup-s", type=float, default=0.0, help="answer 503 on health this long")
    ap.add_argument("--crash-after", type=float, default=None, help="exit 1 after S seconds up")
    ap.add_argument("--exit-after", type=float, default=None, help="exit 0 after S seconds up")
    ap.add_argument("--hang-after", type=float, default=None, help="stop answering after S seconds")
    ap.add_argument("--crash-times", type=int, default=None,
                    help="crash/exit/hang only on the first N starts (counted in --counter)")
    ap.add_argument("--counter", default=None)
    ap.add_argument("--ignore-sigterm", action="store_true")
    args, _ = ap.parse_known_args()

    if args.ignore_sigterm:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    crash = args.crash_after
    if args.counter:
        counter = Path(args.counter)
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        if args.crash_times is not None and n >= args.crash_times:
            crash = None
            args.exit_after = args.hang_after = None
    print(f"fake sglang pid {os.getpid()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
          f"argv={sys.argv[1:]}", flush=True)

    async def run() -> None:
        fake = FakeSGLang(None if args.no_model else tiny_peft_model())
        fake.ready_at = time.monotonic() + args.startup_s
        await serve(fake, args.host, args.port)
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            up = time.monotonic() - t0
            if crash is not None and up > crash:
                print("fake sglang: crashing", flush=True)
                os._exit(1)
            if args.exit_after is not None and up > args.exit_after:
                print("fake sglang: exiting", flush=True)
                os._exit(0)
            if args.hang_after is not None and up > args.hang_after:
                print("fake sglang: hanging", flush=True)
                time.sleep(3600)  # blocks the event loop: the port accepts, nothing answers

    asyncio.run(run())


if __name__ == "__main__":
    main()
