"""`SGLangBackend`: the `local` backend on GPUs, SGLang serving (`clawbridge.local_gpu.sglang`)
plus a trainer (the FSDP2 trainer under torchrun). Publishing is a version switch, not a pause:

1. the trainer writes the adapter into a temporary folder, renamed atomically to `adapters/vK`;
2. `/load_lora_adapter` loads it as `policy@vK` beside the adapters already serving;
3. the router sends requests admitted from now on to `policy@vK`;
4. once every request admitted on an older version has finished, `/unload_lora_adapter` drops it.

SGLang binds a request to the adapter it was admitted with until it finishes, and the router
counts a request as in flight from admission (before its HTTP request leaves), so no request ever
names an unloaded adapter and no response mixes versions.

Any published version is served and scored by number (several users' adapters,
`protocol.Lineages`, or a version the gate holds serving): one unloaded is loaded again from its
folder for the request that names it, and stays loaded while it is among the `KEEP_ADAPTERS`
loaded so used most recently. `switch` is the trainer's: `load_state` (weights and optimizer)
or `load_adapter` (a published version's folder, a fresh optimizer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from clawbridge.local_gpu.sglang import (
    SGLangClient,
    SGLangError,
    StreamCursor,
    Timeouts,
    finish_reason,
    generate_payload,
    parse_score,
    score_payload,
    top_entries,
)
from clawbridge.protocol import (
    BackendError,
    ContextLengthExceeded,
    Priority,
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
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
KEEP_ADAPTERS = 4  # older versions loaded again on request, kept loaded (the most recently used)


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
        self._resident: set[int] = set()  # adapter versions loaded in SGLang
        self._kept: list[int] = []  # older versions loaded again on request, the one used last at the end
        self._lora_lock = asyncio.Lock()  # loading an older version again vs unloading one
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

    @contextlib.asynccontextmanager
    async def _admitted(self, version: int | None) -> AsyncIterator[int]:
        """`router.admit`, with the version's adapter loaded again if it was unloaded."""
        async with self.router.admit(version) as v:
            if v and v not in self._resident:
                await self._load_again(v)
            elif v in self._kept:
                self._kept.remove(v)
                self._kept.append(v)
            yield v

    async def _load_again(self, version: int) -> None:
        async with self._lora_lock:
            if version in self._resident:
                return
            folder = self.adapters_dir / f"v{version}"
            if not (folder / "adapter_config.json").exists():
                raise UnknownVersion(version, self.newest, f"policy@v{version}'s adapter is gone ({folder})")
            await self.client.load_lora(PolicyVersion(version).name, str(folder))
            self._resident.add(version)
            log.info("loaded policy@v%d again (a request names it)", version)
            self._kept.append(version)
            for old in self._kept[:-KEEP_ADAPTERS]:
                self._kept.remove(old)
                self._unload_later(old)

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None,
        priority: Priority = "user",
    ) -> list[Completion]:
        self._check_length(prompt_ids, params.max_tokens)
        async with self._admitted(self.route(version)) as v:
            outs = await asyncio.gather(*(
                self.client.generate(generate_payload(prompt_ids, params, lora_name(v), stream=False, priority=priority))
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
        top = tuple(top_entries(t) for t in meta.get("output_top_logprobs") or ()) if tops else None
        return Completion(tuple(ids), tuple(float(e[0]) for e in entries), finish_reason(meta), version, top)

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None,
        priority: Priority = "user",
    ) -> AsyncIterator[TokenChunk]:
        self._check_length(prompt_ids, params.max_tokens)
        async with self._admitted(self.route(version)) as v:
            cursor = StreamCursor()
            body = generate_payload(prompt_ids, params, lora_name(v), stream=True, priority=priority)
            async for out in self.client.generate_stream(body):
                ids, lps, tops = cursor.delta(out)
                meta = out["meta_info"]
                done = meta.get("finish_reason") is not None
                top = tuple(top_entries(t) for t in tops or ()) if params.top_logprobs else None
                if ids or done:
                    yield TokenChunk(tuple(ids), tuple(lps), v, finish_reason(meta) if done else None, top)

    async def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        model: ScoreModel = "policy",
        temperature: float = 1.0,
        version: int | None = None,
    ) -> list[float]:
        """On published `version`'s adapter (None: the newest), or the base model's."""
        if not prompt_ids or not completion_ids:
            raise BackendError("score needs a non-empty prompt and completion")
        self._check_length([*prompt_ids, *completion_ids], 0)
        async with self._admitted(version if model == "policy" else 0) as v:
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
            self._resident.add(k)
            old, self._loaded = self._loaded, [k]
            self.router.advance(k)
            log.info("published policy@v%d in %.3f s", k, time.monotonic() - started)
            for v in old:
                self._unload_later(v)
            return PolicyVersion(k, str(final))

    def _unload_later(self, version: int) -> None:
        task = asyncio.create_task(self._unload_when_drained(version))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

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
        while True:
            await self.router.drained(version)
            async with self._lora_lock:
                if self.router.inflight(version):
                    continue  # admitted again meanwhile: wait for those too
                if version in self._kept or version not in self._resident:
                    return  # loaded again and kept since, or unloaded already
                self._resident.discard(version)  # a request admitted from now on loads it again
                try:
                    await self.client.unload_lora(PolicyVersion(version).name)
                    log.info("unloaded policy@v%d (drained)", version)
                except BackendError as e:  # the adapter stays loaded; it costs memory, not correctness
                    self._resident.add(version)
                    log.warning("could not unload policy@v%d: %s", version, e)
                return

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

    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Train another lineage (`protocol.Lineages`): the trainer loads its checkpoint `state`
        (`save_state`'s name or path: weights and optimizer), or published `version`'s adapter
        folder (at `path`, else `adapters/vK`; v0: the initial adapter) with a fresh optimizer.
        What serves, and the versions' numbering, stay as they are."""
        trainer = self._need_trainer()
        if state is not None:
            await trainer.load_state(self.states_dir / state)  # an absolute path stays itself
            return
        require_published(version, self.newest)
        folder = None if version == 0 else Path(path) if path else self.adapters_dir / f"v{version}"
        if folder is not None and not (folder / "adapter_config.json").exists():
            raise UnknownVersion(version, self.newest, f"policy@v{version}'s adapter is gone ({folder})")
        await trainer.load_adapter(folder)

    async def close(self) -> None:
        for task in list(self._unloads):
            task.cancel()
        if self.trainer is not None:
            await self.trainer.close()
        await self.client.close()
