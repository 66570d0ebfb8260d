"""The SGLang client and `SGLangBackend`: the `local` backend on GPUs (DESIGN.md §3).

Sampling and scoring go to SGLang's native `/generate` with exact `input_ids` (never text, never
chat templates) and every sampling parameter spelled out, because SGLang otherwise applies the
model's own generation defaults. Training is delegated to a `Trainer` (the FSDP2 trainer under
torchrun). Publishing is a version switch, not a pause:

1. the trainer writes the adapter into a temporary folder, renamed atomically to `adapters/vK`;
2. `/load_lora_adapter` loads it as `policy@vK` beside the adapters already serving;
3. the router sends requests admitted from now on to `policy@vK`;
4. once every request admitted on an older version has finished, `/unload_lora_adapter` drops it.

SGLang binds a request to the adapter it was admitted with until it finishes, and the router
counts a request as in flight from admission (before its HTTP request leaves), so no request ever
names an unloaded adapter and no response mixes versions. Every HTTP call has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import aiohttp
from clawbridge.protocol import (
    BackendError,
    ContextLengthExceeded,
    Routing,
    ScoreModel,
    TransientBackendError,
    UnknownVersion,
    require_published,
)
from clawbridge.types import (
    Completion,
    Datum,
    LossSpec,
    OptimSpec,
    PolicyVersion,
    SamplingParams,
    StepMetrics,
    TokenChunk,
    TokenLogprob,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


def generate_payload(
    prompt_ids: Sequence[int], params: SamplingParams, lora: str | None, *, stream: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params_payload(params),
        "return_logprob": True,
        "logprob_start_len": -1,  # output logprobs only
        "top_logprobs_num": params.top_logprobs,
        "stream": stream,
        "rid": uuid.uuid4().hex,
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


def _top(entries: list[Any] | None) -> tuple[TokenLogprob, ...]:
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
    (FACTS.md, the proxy's hot path)."""

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


# --- versions ------------------------------------------------------------------------------------


class VersionRouter:
    """Which version new requests get, and how many admitted requests each version still has.
    A request is counted from admission to its last byte, so a version is unloaded only when
    nothing can still name it."""

    def __init__(self) -> None:
        self.current = 0
        self._inflight: dict[int, int] = {}
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def admit(self, version: int | None) -> AsyncIterator[int]:
        v = self.current if version is None else version
        if v > self.current or v < 0:
            raise BackendError(f"version {v} is not published (newest is {self.current})")
        self._inflight[v] = self._inflight.get(v, 0) + 1
        try:
            yield v
        finally:
            self._inflight[v] -= 1
            async with self._changed:
                self._changed.notify_all()

    def inflight(self, version: int) -> int:
        return self._inflight.get(version, 0)

    def advance(self, version: int) -> None:
        self.current = version

    async def drained(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._inflight.get(version, 0) == 0)


def lora_name(version: int) -> str | None:
    return None if version == 0 else PolicyVersion(version).name


# --- the backend ---------------------------------------------------------------------------------


class Trainer(Protocol):
    """What the backend needs from a trainer (the FSDP2 trainer implements it)."""

    async def train_step(self, batch: Sequence[Datum], loss: LossSpec, optim: OptimSpec) -> StepMetrics: ...
    async def save_adapter(self, path: Path) -> None: ...
    async def load_adapter(self, path: Path | None) -> None:
        """Make the trainable weights those of a PEFT adapter folder (None: the initial
        adapter) and reset the optimizer."""
        ...
    async def save_state(self, path: Path) -> None: ...
    async def load_state(self, path: Path) -> None: ...
    async def close(self) -> None: ...


class SGLangBackend(Routing):
    """`Backend` on SGLang (serving) + a trainer (training). The judge talks to the PRM server's
    OpenAI endpoint (`judge_base_url`), or to the policy server's base model when there is none."""

    name = "local"

    def __init__(
        self,
        policy_url: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_name: str,
        context_length: int,
        data_dir: Path,
        trainer: Trainer | None = None,
        judge_url: str | None = None,
        timeouts: Timeouts = Timeouts(),
    ) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.client = SGLangClient(policy_url, timeouts)
        self.judge_base_url = (judge_url or policy_url).rstrip("/") + "/v1"
        self.adapters_dir = data_dir / "adapters"
        self.states_dir = data_dir / "checkpoints"
        self.trainer = trainer
        self.router = VersionRouter()
        self._tokenizer = tokenizer
        self._publish_lock = asyncio.Lock()
        self._loaded: list[int] = []  # adapter versions serving new requests (not yet superseded)
        self._unloads: set[asyncio.Task[None]] = set()

    @property
    def newest(self) -> int:
        return self.router.current

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    async def start(self) -> None:
        self.adapters_dir.mkdir(parents=True, exist_ok=True)
        if not await self.client.health():
            raise TransientBackendError(f"SGLang at {self.client.base_url} is not healthy")
        paths = await self.client.openapi_paths()
        missing = {"/generate", "/load_lora_adapter", "/unload_lora_adapter"} - paths if paths else set()
        if missing:
            raise BackendError(f"this SGLang lacks {sorted(missing)}: launch it with --enable-lora (0.5.x)")

    def _check_length(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        if len(prompt_ids) + max_tokens > self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), max_tokens, self.context_length)

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None
    ) -> list[Completion]:
        self._check_length(prompt_ids, params.max_tokens)
        async with self.router.admit(self.route(version)) as v:
            outs = await asyncio.gather(*(
                self.client.generate(generate_payload(prompt_ids, params, lora_name(v), stream=False))
                for _ in range(n)
            ))
        return [self._completion(out, v, params.top_logprobs > 0) for out in outs]

    @staticmethod
    def _completion(out: dict[str, Any], version: int, tops: bool) -> Completion:
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        ids = [int(t) for t in out.get("output_ids", [])]
        if len(entries) != len(ids):
            raise SGLangError(f"{len(ids)} output ids but {len(entries)} logprobs")
        top = tuple(_top(t) for t in meta.get("output_top_logprobs") or ()) if tops else None
        return Completion(tuple(ids), tuple(float(e[0]) for e in entries), finish_reason(meta), version, top)

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None
    ) -> AsyncIterator[TokenChunk]:
        self._check_length(prompt_ids, params.max_tokens)
        async with self.router.admit(self.route(version)) as v:
            cursor = StreamCursor()
            body = generate_payload(prompt_ids, params, lora_name(v), stream=True)
            async for out in self.client.generate_stream(body):
                ids, lps, tops = cursor.delta(out)
                meta = out["meta_info"]
                done = meta.get("finish_reason") is not None
                top = tuple(_top(t) for t in tops or ()) if params.top_logprobs else None
                if ids or done:
                    yield TokenChunk(tuple(ids), tuple(lps), v, finish_reason(meta) if done else None, top)

    async def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        model: ScoreModel = "policy",
        temperature: float = 1.0,
    ) -> list[float]:
        if not prompt_ids or not completion_ids:
            raise BackendError("score needs a non-empty prompt and completion")
        self._check_length([*prompt_ids, *completion_ids], 0)
        async with self.router.admit(None if model == "policy" else 0) as v:
            out = await self.client.generate(
                score_payload(prompt_ids, completion_ids, lora_name(v), temperature))
        return parse_score(out, len(completion_ids))

    def _need_trainer(self) -> Trainer:
        if self.trainer is None:
            raise BackendError("this SGLang backend serves only: no trainer was started")
        return self.trainer

    async def train_step(
        self, batch: Sequence[Datum], loss: LossSpec = LossSpec(), optim: OptimSpec = OptimSpec()
    ) -> StepMetrics:
        return await self._need_trainer().train_step(batch, loss, optim)

    async def publish(self) -> PolicyVersion:
        trainer = self._need_trainer()
        async with self._publish_lock:
            k = self.newest + 1
            final = self.adapters_dir / f"v{k}"
            tmp = self.adapters_dir / f".v{k}.tmp-{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            try:
                await trainer.save_adapter(tmp)
                if final.exists():  # left by a crash before the load: never served
                    shutil.rmtree(final)
                os.replace(tmp, final)  # SGLang only ever sees a complete adapter folder
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            await self.client.load_lora(PolicyVersion(k).name, str(final))
            old, self._loaded = self._loaded, [k]
            self.router.advance(k)
            log.info("published policy@v%d in %.3f s", k, time.monotonic() - started)
            for v in old:
                task = asyncio.create_task(self._unload_when_drained(v))
                self._unloads.add(task)
                task.add_done_callback(self._unloads.discard)
            return PolicyVersion(k, str(final))

    async def rollback(self, version: int) -> PolicyVersion:
        """vK's adapter folder (v0: the initial adapter) into the trainer, then the ordinary
        publish: written anew as the next version, loaded beside the serving ones, and the
        superseded adapter unloaded once its requests drain."""
        trainer = self._need_trainer()
        require_published(version, self.newest)
        folder = None if version == 0 else self.adapters_dir / f"v{version}"
        if folder is not None and not (folder / "adapter_config.json").exists():
            raise UnknownVersion(version, self.newest, f"policy@v{version}'s adapter is gone ({folder})")
        await trainer.load_adapter(folder)
        published = await self.publish()
        log.info("policy@v%d is a rollback to policy@v%d", published.version, version)
        return published

    async def _unload_when_drained(self, version: int) -> None:
        await self.router.drained(version)
        try:
            await self.client.unload_lora(PolicyVersion(version).name)
            log.info("unloaded policy@v%d (drained)", version)
        except BackendError as e:  # the adapter stays loaded; it costs memory, not correctness
            log.warning("could not unload policy@v%d: %s", version, e)

    async def drain(self) -> None:
        """Wait until every superseded adapter has been unloaded (tests, shutdown)."""
        while self._unloads:
            await asyncio.gather(*list(self._unloads), return_exceptions=True)

    async def save_state(self, name: str) -> str:
        path = self.states_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        await self._need_trainer().save_state(path)
        return str(path)

    async def load_state(self, name: str) -> None:
        await self._need_trainer().load_state(self.states_dir / name)

    async def close(self) -> None:
        for task in list(self._unloads):
            task.cancel()
        if self.trainer is not None:
            await self.trainer.close()
        await self.client.close()
