"""The SGLang engine's native API: the wire payloads and an HTTP client (the GPU stack's
serving engine; `clawbridge.backends.sglang` adapts it to the Backend protocol).

Sampling and scoring go to SGLang's native `/generate` with exact `input_ids` (never text, never
chat templates) and every sampling parameter spelled out, because SGLang otherwise applies the
model's own generation defaults. Every HTTP call has a timeout.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from clawbridge.protocol import (
    BackendError,
    Priority,
    TransientBackendError,
)
from clawbridge.types import (
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class SGLangError(BackendError):
    """SGLang refused a request (HTTP 4xx): a bug on our side or a bad adapter, not load."""


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    generate_s: float = 600.0  # a whole non-streamed completion; streams: between chunks
    lora_s: float = 120.0  # load / unload of one adapter
    health_s: float = 10.0


# --- pure wire helpers ------------------------------------------------------------------------


def sampling_params_payload(params: SamplingParams, max_new_tokens: int | None = None) -> dict[str, Any]:
    """Every SGLang sampling parameter, explicit, so the server's generation defaults never
    apply (a model's generation_config would otherwise change temperature or top_p and break the
    on-policy ratio). `no_stop_trim` keeps the stop text: the completion includes the token that
    completed a stop string, the renderer strips it (types.Completion)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_tokens if max_new_tokens is None else max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": False,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "n": 1,
    }
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


# SGLang's request priority (honoured with `--enable-priority-scheduling`, larger values first, and
# ignored without it): a user's request outranks a background one by more than SGLang's preemption
# threshold (10), so it may also preempt a running one.
PRIORITY: dict[Priority, int] = {"user": 20, "background": 0}


def generate_payload(
    prompt_ids: Sequence[int], params: SamplingParams, lora: str | None, *, stream: bool,
    priority: Priority = "user",
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params_payload(params),
        "return_logprob": True,
        "logprob_start_len": -1,  # output logprobs only
        "top_logprobs_num": params.top_logprobs,
        "stream": stream,
        "rid": uuid.uuid4().hex,
        "priority": PRIORITY[priority],
    }
    if lora is not None:
        body["lora_path"] = lora  # SGLang picks a loaded adapter by its name
    return body


def score_payload(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], lora: str | None, temperature: float
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": [*prompt_ids, *completion_ids],
        "sampling_params": {**sampling_params_payload(SamplingParams(temperature=temperature), 0)},
        "return_logprob": True,
        # logprobs from the last prompt token on: its entry is null (nothing before it is
        # scored), the rest are exactly the completion tokens.
        "logprob_start_len": len(prompt_ids) - 1,
        "top_logprobs_num": 0,
        "stream": False,
        "rid": uuid.uuid4().hex,
        "priority": PRIORITY["background"],  # only the learner scores
    }
    if lora is not None:
        body["lora_path"] = lora
    return body


def parse_score(out: dict[str, Any], n_completion: int) -> list[float]:
    entries = out["meta_info"]["input_token_logprobs"]
    lps = [e[0] for e in entries[1:]]  # drop the leading null (the last prompt token)
    if len(lps) != n_completion or any(lp is None for lp in lps):
        raise SGLangError(f"score returned {len(lps)} logprobs for {n_completion} completion tokens")
    return [float(x) for x in lps]


def finish_reason(meta: dict[str, Any]) -> Literal["stop", "length"]:
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort":
        raise TransientBackendError(f"SGLang aborted the request: {fr.get('message', '')}")
    return "length" if kind == "length" else "stop"


def top_entries(entries: list[Any] | None) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(int(e[1]), float(e[0])) for e in entries or ())


@dataclass
class StreamCursor:
    """Turns SGLang stream chunks into deltas whether the server streams cumulatively (the
    default) or incrementally (`--incremental-streaming-output`): `completion_tokens` in
    meta_info is always the running total, so the chunk's length tells which it is."""

    seen: int = 0

    def delta(self, out: dict[str, Any]) -> tuple[list[int], list[float], list[Any] | None]:
        meta = out["meta_info"]
        total = int(meta.get("completion_tokens", len(out.get("output_ids", []))))
        ids = list(out.get("output_ids", []))
        lps = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs")
        if len(ids) == total and total >= self.seen:  # cumulative
            start = self.seen
        else:  # incremental: the chunk holds only the new tokens
            start = 0
        new_ids = ids[start:]
        new_lps = lps[len(lps) - len(new_ids):] if len(lps) >= len(new_ids) else lps
        new_tops = tops[len(tops) - len(new_ids):] if tops else None
        self.seen = total
        if len(new_lps) != len(new_ids):
            raise SGLangError(f"stream chunk has {len(new_ids)} tokens but {len(new_lps)} logprobs")
        return new_ids, [float(e[0]) for e in new_lps], new_tops


# --- HTTP client --------------------------------------------------------------------------------


class SGLangClient:
    """One SGLang server's native API. aiohttp, not httpx: this is the per-token hot path
    of the proxy: httpx as an upstream client costs far more CPU a request and degrades with its
    pool size."""

    def __init__(self, base_url: str, timeouts: Timeouts = Timeouts()) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect_s),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        http = await self._http()
        try:
            async with http.post(
                self.base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                text = await r.text()
                _raise_for(r.status, path, text)
                return json.loads(text) if text else {}
        except (TimeoutError, aiohttp.ClientError) as e:
            raise TransientBackendError(f"SGLang {path} at {self.base_url}: {e!r}") from e

    async def health(self) -> bool:
        http = await self._http()
        try:
            async with http.get(
                self.base_url + "/health_generate",
                timeout=aiohttp.ClientTimeout(total=self.timeouts.health_s),
            ) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def openapi_paths(self) -> set[str]:
        """The endpoints this SGLang version serves (read once at start-up: endpoints come and
        go between releases, e.g. /get_weight_version is gone in 0.5.23)."""
        http = await self._http()
        async with http.get(self.base_url + "/openapi.json",
                            timeout=aiohttp.ClientTimeout(total=self.timeouts.health_s)) as r:
            if r.status != 200:
                return set()
            return set((await r.json()).get("paths", {}))

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        out = await self._post("/generate", {**body, "stream": False}, self.timeouts.generate_s)
        if isinstance(out, list):  # a batch answer; we always send one prompt
            out = out[0]
        return out

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        http = await self._http()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.timeouts.generate_s)
        try:
            async with http.post(self.base_url + "/generate", json={**body, "stream": True},
                                 timeout=timeout) as r:
                if r.status != 200:
                    _raise_for(r.status, "/generate", await r.text())
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    out = json.loads(data)
                    if "error" in out:
                        raise SGLangError(f"SGLang stream error: {out['error']}")
                    yield out
        except (TimeoutError, aiohttp.ClientError) as e:
            raise TransientBackendError(f"SGLang stream at {self.base_url}: {e!r}") from e

    async def load_lora(self, name: str, path: str) -> None:
        out = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path},
                               self.timeouts.lora_s)
        if out.get("success") is False:
            raise SGLangError(f"loading adapter {name}: {out.get('error_message')}")

    async def unload_lora(self, name: str) -> None:
        out = await self._post("/unload_lora_adapter", {"lora_name": name}, self.timeouts.lora_s)
        if out.get("success") is False:
            raise SGLangError(f"unloading adapter {name}: {out.get('error_message')}")


def _raise_for(status: int, path: str, text: str) -> None:
    if status < 400:
        return
    try:
        detail = json.loads(text)
        message = detail.get("message") or detail.get("error_message") or detail.get("error") or text
    except ValueError:
        message = text
    if status in (408, 425, 429) or status >= 500:
        raise TransientBackendError(f"SGLang {path}: HTTP {status}: {message}")
    raise SGLangError(f"SGLang {path}: HTTP {status}: {message}")
