"""The torch engine: one HF causal LM + PEFT LoRA, owned by one scheduler thread.

Every verb (sample, score, train_step, publish, save/load) runs on that thread, so the model is
never mutated mid-forward. Sampling is continuously batched: new requests are prefilled and
merged into the running batch between decode steps (`kvbatch.KVBatch`); other jobs run one per
iteration between decode steps. A prompt that shares a prefix with a recent one on the same
version prefills only the rest (`kvbatch.PrefixCache`, `prefix_cache_mb`). Results reach asyncio callers through thread-safe futures and
per-request queues.

Versions. The trainable adapter is PEFT's "default" and is never served. Version 0 is the base
(PEFT's "__base__" row name); `publish()` copies the trainable weights into a serving slot (a
reusable PEFT adapter, `adapters.Slots`) that serves from the next scheduler iteration, and a
writer thread persists the same weights to `data_dir/adapters/vK/` (PEFT format); `publish()`
returns once they are on disk (`durable=False`: once the version serves). Each decode row names
its own adapter (PEFT mixed-batch LoRA, `adapter_names`), so a request admitted on vK finishes on
vK while newer requests run on vK+1 in the same batch. A slot is freed once no request uses its
version and a newer version exists; an older version asked for by number is reloaded from its
folder.

`rollback(K)` copies vK's folder (or, for v0, the initial adapter kept from start-up) into the
trainable adapter, drops the optimizer, and publishes it as the next version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import math
import queue
import secrets
import shutil
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from clawbridge.local_gpu import adapters, models
from clawbridge.local_gpu.kvbatch import CACHE, KVBatch, PrefixCache, SlotBatch, cache_of
from clawbridge.local_gpu.packing import pack, packed_micro_batches
from clawbridge.local_gpu.sampling import Draw, draw_token, draw_tokens, needs_uniform
from clawbridge.loss import batch_tokens, ppo_token_losses, token_logprobs
from clawbridge.protocol import BackendError, UnknownVersion, require_published
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

log = logging.getLogger(__name__)

BASE = "__base__"  # PEFT's row name for "no adapter"
TRAIN = "default"  # the trainable adapter; saved without a sub-folder under this name
STALE = "\0stale"  # no adapter's name: the LoRA layers must be pointed again before a forward
# Scoring a longer sequence runs in forwards of this many tokens on one cache, so that one
# layer's attention stays bounded and a closing engine abandons it soon. Chunks cost time on CPU
# (tiny model, 8 K tokens: 1.8 s whole, 2.5 s in chunks of 4 K, 3.3 s of 2 K; same logprobs).
SCORE_CHUNK = 4096


class EngineClosing(BackendError):
    """The engine is closing: the forward in progress (a prefill, a score, a training step) is
    abandoned between two decoder layers, so that stopping never waits for a long prompt."""


@dataclass(eq=False)
class _Seq:
    """One completion being generated."""

    prompt: tuple[int, ...]
    params: SamplingParams
    requested_version: int | None
    emit: Callable[[TokenChunk | BaseException], None]
    generator: torch.Generator
    stop_ids: frozenset[int]
    version: int = -1
    tokens: list[int] = field(default_factory=list)
    text_checked: int = 0
    cancelled: bool = False


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: concurrent.futures.Future[Any]


class Engine:
    def __init__(
        self,
        spec: models.ModelSpec,
        *,
        data_dir: Path,
        lora_rank: int = 32,
        lora_alpha: int = 32,
        target_modules: str | list[str] = "all-linear",
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        seed: int = 0,
        max_batch: int = 16,
        train_token_budget: int = 2048,
        threads: int | None = None,
        static_cache: bool = False,
        cuda_graphs: bool = False,
        prefix_cache_mb: int = 2048,
    ) -> None:
        self.spec = spec
        self.static_cache = static_cache or cuda_graphs
        self.cuda_graphs = cuda_graphs
        self.threads = threads
        self.data_dir = Path(data_dir)
        self.lora_rank, self.lora_alpha, self.target_modules = lora_rank, lora_alpha, target_modules
        self.device, self.dtype, self.seed = device, dtype or torch.float32, seed
        self.max_batch, self.train_token_budget = max_batch, train_token_budget
        self.context_length = spec.context_length
        self.tokenizer = models.load_tokenizer(spec)
        self.stop_ids = self._default_stop_ids()
        self._model: Any = None
        self._lora_layers: list[Any] = []
        self._trainable_active: list[Any] = []  # each layer's active adapter as PEFT set it up
        self._pointed: str | None = None  # the adapter the layers point at (None: trainable)
        self._optimizer: torch.optim.AdamW | None = None
        self._initial: dict[str, torch.Tensor] = {}  # the trainable adapter at start (v0's)
        self._newest = 0
        self._steps = 0
        self._refs: dict[int, int] = {}
        self._slots: adapters.Slots | None = None
        self._served: dict[int, str] = {}  # published version -> the slot serving it (in memory)
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # versions still being persisted
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="clawbridge-persist"
        )
        self._adapter_config = ""
        self._inbox: queue.Queue[_Seq | _Job | None] = queue.Queue()
        self._waiting: deque[_Seq] = deque()
        self._jobs: deque[_Job] = deque()
        self._active: list[_Seq] = []
        self._batch = self._new_batch()
        self._prefixes = PrefixCache(max(0, prefix_cache_mb) << 20)
        self._thread: threading.Thread | None = None
        self._closed = False

    def _new_batch(self) -> KVBatch | SlotBatch:
        if not self.static_cache:
            return KVBatch()
        return SlotBatch(
            self.max_batch,
            self.context_length,
            bucketed=self.cuda_graphs,
            capture=self.cuda_graphs and str(self.device).startswith("cuda"),
        )

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Load the model and start the scheduler thread (blocking: seconds)."""
        if self._thread is not None:
            return
        from peft import LoraConfig, get_peft_model

        if self.threads:  # process-wide; on a shared, busy CPU one thread beats contended two
            torch.set_num_threads(self.threads)
        base = models.load_model(self.spec, dtype=self.dtype, device=self.device, seed=self.seed)
        config = LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            target_modules=self.target_modules,
            lora_dropout=0.0,
        )
        with torch.random.fork_rng(devices=[]):  # LoRA A init must not depend on global state
            torch.manual_seed(self.seed)
            self._model = get_peft_model(base, config, adapter_name=TRAIN)
        self._model.eval()  # no dropout anywhere; PEFT mixed-batch rows require eval mode
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._lora_layers = [m for m in self._model.modules() if isinstance(m, BaseTunerLayer)]
        self._trainable_active = [layer._active_adapter for layer in self._lora_layers]
        self._initial = self._trainable_state()
        self._slots = adapters.Slots(self._model, TRAIN, self._lora_layers, self._trainable_active)
        self._slots.ensure_spare()  # the first publish fills it without creating LoRA layers
        self._adapter_config = adapters.config_json(self._model, TRAIN)
        self._thread = threading.Thread(target=self._run, name="clawbridge-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is None or self._closed:
            return
        self._closed = True  # read between decoder layers by a long forward (`_abandonable`)
        self._inbox.put(None)
        self._thread.join(timeout=60)

    @property
    def version(self) -> int:
        return self._newest

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def active_requests(self) -> int:
        """Requests admitted or waiting (read from another thread: a snapshot)."""
        return len(self._active) + len(self._waiting) + self._inbox.qsize()

    @property
    def prefix_cache(self) -> PrefixCache:
        """The cached prompts' KV (read from another thread: a snapshot)."""
        return self._prefixes

    @property
    def loaded_versions(self) -> set[int]:
        """Published versions whose adapter is in memory."""
        return set(self._served)

    # --- async API ---------------------------------------------------------------------------

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None
    ) -> AsyncIterator[TokenChunk]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        seq = self._new_seq(prompt_ids, params, version, loop, chunks)
        self._put(seq)
        try:
            while True:
                item = await chunks.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            seq.cancelled = True  # a consumer that stops early frees its batch row

    async def sample(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        n: int = 1,
        version: int | None = None,
    ) -> list[Completion]:
        def nth(i: int) -> SamplingParams:
            if params.seed is None or i == 0:
                return params
            return dataclasses.replace(params, seed=params.seed + i)

        return list(
            await asyncio.gather(
                *(
                    collect(self.sample_stream(prompt_ids, nth(i), version=version))
                    for i in range(n)
                )
            )
        )

    async def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        model: Literal["policy", "base"] = "policy",
        temperature: float = 1.0,
    ) -> list[float]:
        return await self._call(
            self._score, tuple(prompt_ids), tuple(completion_ids), model, temperature
        )

    async def train_step(
        self, batch: Sequence[Datum], loss: LossSpec = LossSpec(), optim: OptimSpec = OptimSpec()
    ) -> StepMetrics:
        return await self._call(self._abandonably, self._train_step, tuple(batch), loss, optim)

    async def publish(self, *, durable: bool = True) -> PolicyVersion:
        """Serve the trained weights as the next version. It serves from memory at once; with
        `durable` (what a caller that records the version needs) this returns once its weights
        are on disk, without `durable` as soon as it serves."""
        published, persisted = await self._call(self._publish)
        if durable:
            await asyncio.wrap_future(persisted)
        return published

    async def rollback(self, version: int) -> PolicyVersion:
        published, persisted = await self._call(self._rollback, version)
        await asyncio.wrap_future(persisted)
        return published

    async def save_state(self, name: str) -> str:
        return await self._call(self._save_state, name)

    async def load_state(self, name: str) -> None:
        await self._call(self._load_state, name)

    async def restore(self, version: int, path: str | None) -> None:
        await self._call(self._restore, version, path)

    async def logits(self, token_ids: Sequence[int], *, version: int | None = None) -> torch.Tensor:
        """The logits at every position of `token_ids` on a version (default: the newest),
        computed as serving computes them: that version's adapter, unmerged, in the model's
        dtype. float32, on the CPU. For tools that check a copy of a version (export)."""
        return await self._call(self._logits, tuple(int(t) for t in token_ids), version)

    async def trainable_state(self) -> dict[str, torch.Tensor]:
        """A copy of the trainable LoRA weights (PEFT state-dict keys); for tests and tools."""
        return await self._call(self._trainable_state)

    # --- plumbing between the event loop and the scheduler thread ---------------------------

    def _put(self, item: _Seq | _Job) -> None:
        if self._thread is None:
            raise BackendError("the engine is not started: call start() first")
        if self._closed:
            raise BackendError("the engine is closed")
        self._inbox.put(item)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put(_Job(fn, args, future))
        return await asyncio.wrap_future(future)

    def _new_seq(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        version: int | None,
        loop: asyncio.AbstractEventLoop,
        chunks: asyncio.Queue[TokenChunk | BaseException],
    ) -> _Seq:
        if not prompt_ids:
            raise ValueError("the prompt needs at least one token")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq: _Seq

        def emit(item: TokenChunk | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone: nobody is listening
                seq.cancelled = True

        seq = _Seq(
            prompt=tuple(int(t) for t in prompt_ids),
            params=params,
            requested_version=version,
            emit=emit,
            generator=torch.Generator().manual_seed(seed),
            stop_ids=self.stop_ids | frozenset(params.stop_token_ids),
        )
        return seq

    def _default_stop_ids(self) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)
        return frozenset(i for i in ids if isinstance(i, int))

    # --- the scheduler thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not (self._waiting or self._jobs or self._active)
            try:
                item = self._inbox.get(block=idle)
                while True:
                    if item is None:
                        self._shutdown()
                        return
                    if isinstance(item, _Job):
                        self._jobs.append(item)
                    else:
                        self._waiting.append(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if self._jobs:
                self._run_job(self._jobs.popleft())
            self._admit()
            if self._active:
                self._decode_step()

    @contextlib.contextmanager
    def _abandonable(self) -> Iterator[None]:
        """While a long forward runs (a prefill, a score, a training step), every decoder layer
        and each of its parts (attention, MLP) first checks that the engine is not closing. Only
        then: hooks would slow every decode step, and a decode step is short anyway."""
        def check(_module: torch.nn.Module, _args: Any) -> None:
            if self._closed:
                raise EngineClosing("the engine is closing")

        handles = [m.register_forward_pre_hook(check) for layer in self._decoder_layers
                   for m in (layer, *layer.children())]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _abandonably(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._abandonable():
            return fn(*args)

    @functools.cached_property
    def _decoder_layers(self) -> list[torch.nn.Module]:
        """The model's decoder layers (the largest ModuleList of the base model)."""
        lists = [list(m) for m in self._model.modules() if isinstance(m, torch.nn.ModuleList)]
        return max(lists, key=len, default=[])

    def _forward(self, names: Sequence[str] | None, **inputs: Any) -> Any:
        """One forward with each row on its adapter (`names`; None: the trainable adapter).

        Rows on several adapters take PEFT's mixed-batch path. When every row shares one (the
        usual case: everyone on the newest version), the LoRA layers are pointed at it for this
        forward instead: the mixed-batch path (per-layer gathers and scatters, hooks on every
        module) measured twice the cost of a plain forward of SmolLM2 on CPU."""
        if names is None:
            self._point_at(None)
            return self._model(**inputs)
        unique = set(names)
        if len(unique) > 1:
            return self._model(**inputs, adapter_names=list(names))
        self._point_at(unique.pop())
        return self._model(**inputs)

    def _point_at(self, name: str | None) -> None:
        """Point every LoRA layer at adapter `name` (None: the trainable one as PEFT set it up),
        only when it changes: the assignment goes through nn.Module.__setattr__ on each of the
        hundreds of LoRA layers, which measured a few percent of a decode step. PEFT's own
        set_adapter would also flip requires_grad, which must stay on the trainable adapter."""
        if name == self._pointed:
            return
        for layer, trainable in zip(self._lora_layers, self._trainable_active, strict=True):
            layer._active_adapter = trainable if name is None else [] if name == BASE else [name]
        self._pointed = name

    def _run_job(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn(*job.args))
        except (UnknownVersion, OSError, EngineClosing) as exc:  # the caller's, the disk's, a stop: no traceback
            if isinstance(exc, OSError):
                log.error("engine job %s failed: %s", getattr(job.fn, "__name__", job.fn), exc)
            job.future.set_exception(exc)
        except BaseException as exc:
            log.exception("engine job %s failed", getattr(job.fn, "__name__", job.fn))
            job.future.set_exception(exc)

    def _shutdown(self) -> None:
        error = BackendError("the engine was closed")
        for seq in [*self._active, *self._waiting]:
            seq.emit(error)
        for job in self._jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
        self._active, self._batch = [], self._new_batch()
        self._writer.shutdown(wait=True)  # versions being persisted reach the disk
        while True:  # ... and their publishers hear so
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Job) and item.fn == self._persisted:
                self._run_job(item)
            elif isinstance(item, _Job) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)
            elif isinstance(item, _Seq):
                item.emit(error)

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_batch:
            seq = self._waiting.popleft()
            if seq.cancelled:
                continue
            try:
                seq.version = self._acquire(seq.requested_version)
            except BaseException as exc:
                seq.emit(exc)
                continue
            try:
                with torch.inference_mode(), self._abandonable():
                    out = self._prefill(seq)
                    # kept before the first token goes out: a caller that has it sees the entry
                    self._prefixes.store(seq.version, seq.prompt, cache_of(out))
                    token = self._take(seq, out.logits[0, -1])
                    if token is not None:
                        self._batch.add(cache_of(out), len(seq.prompt), token)
            except BaseException as exc:
                self._release(seq.version)
                seq.emit(exc)
                continue
            if token is None:
                self._release(seq.version)
            else:
                self._active.append(seq)

    def _prefill(self, seq: _Seq) -> Any:
        """The forward over `seq`'s prompt, alone (no padding), with its cache; the prompt's
        longest prefix cached on the same version is reused and only the rest is computed."""
        cached = self._prefixes.lookup(seq.version, seq.prompt) if self._prefixes.budget else None
        start = 0 if cached is None else cached.get_seq_length()
        inputs: dict[str, Any] = {
            "input_ids": torch.tensor([seq.prompt[start:]], device=self.device),
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if cached is not None:
            log.debug("prefix cache: %d of %d prompt tokens reused", start, len(seq.prompt))
            inputs[CACHE] = cached
            inputs["position_ids"] = torch.arange(start, len(seq.prompt), device=self.device).view(
                1, -1
            )
        return self._forward([self._row(seq.version)], **inputs)

    def _decode_step(self) -> None:
        try:
            with torch.inference_mode():
                names = [self._row(s.version) for s in self._active]
                if isinstance(self._batch, SlotBatch):
                    unique = set(names)
                    logits = self._batch.step(
                        lambda inputs: self._forward(names, **inputs, use_cache=True).logits[:, -1],
                        unique.pop() if len(unique) == 1 else None,
                    )
                else:
                    logits = self._forward(
                        names, **self._batch.step_inputs(), use_cache=True
                    ).logits[:, -1]
                nexts = self._take_all(logits)
        except BaseException as exc:
            log.exception("decode step failed; failing %d requests", len(self._active))
            for seq in self._active:
                seq.emit(exc)
                self._release(seq.version)
            self._active, self._batch = [], self._new_batch()
            return
        self._batch.advance([t if t is not None else 0 for t in nexts])
        keep = [i for i, t in enumerate(nexts) if t is not None]
        for i, t in enumerate(nexts):
            if t is None:
                self._release(self._active[i].version)
        self._active = [self._active[i] for i in keep]
        with torch.inference_mode():
            self._batch.keep(keep)

    def _take(self, seq: _Seq, logits: torch.Tensor) -> int | None:
        """Draw the next token, stream it; the token to feed next, or None once finished."""
        if seq.cancelled:
            return None
        return self._accept(seq, draw_token(logits, seq.params, self._uniform(seq)))

    def _take_all(self, logits: torch.Tensor) -> list[int | None]:
        """`_take` for every active row of a decode step, drawn together (`draw_tokens`)."""
        live = [i for i, seq in enumerate(self._active) if not seq.cancelled]
        if not live:
            return [None] * len(self._active)
        rows = (
            logits
            if len(live) == len(self._active)
            else logits[torch.tensor(live, device=logits.device)]
        )
        seqs = [self._active[i] for i in live]
        draws = draw_tokens(rows, [s.params for s in seqs], [self._uniform(s) for s in seqs])
        nexts: list[int | None] = [None] * len(self._active)
        for i, seq, draw in zip(live, seqs, draws, strict=True):
            nexts[i] = self._accept(seq, draw)
        return nexts

    @staticmethod
    def _uniform(seq: _Seq) -> float:
        return (
            float(torch.rand((), generator=seq.generator, dtype=torch.float64))
            if needs_uniform(seq.params)
            else 0.0
        )

    def _accept(self, seq: _Seq, draw: Draw) -> int | None:
        seq.tokens.append(draw.token)
        finish = self._finish_reason(seq, draw.token)
        seq.emit(
            TokenChunk(
                tokens=(draw.token,),
                logprobs=(draw.logprob,),
                version=seq.version,
                finish_reason=finish,
                top_logprobs=(draw.top,) if draw.top is not None else None,
            )
        )
        return None if finish is not None else draw.token

    def _finish_reason(self, seq: _Seq, token: int) -> Literal["stop", "length"] | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop:
            # decode the whole completion (merges and multi-byte characters settle late) but
            # search only the text that could contain a new match
            text = self.tokenizer.decode(seq.tokens, skip_special_tokens=False)
            longest = max(len(s) for s in seq.params.stop)
            window = text[max(0, seq.text_checked - longest + 1) :]
            seq.text_checked = len(text)
            if any(s and s in window for s in seq.params.stop):
                return "stop"
        if len(seq.tokens) >= seq.params.max_tokens:
            return "length"
        if len(seq.prompt) + len(seq.tokens) >= self.context_length:
            return "length"
        return None

    # --- versions ------------------------------------------------------------------------------

    def _row(self, version: int) -> str:
        """The adapter name a row on `version` runs with (acquired: its slot is in memory)."""
        return BASE if version == 0 else self._served[version]

    def _acquire(self, requested: int | None) -> int:
        version = self._newest if requested is None else requested
        if version < 0 or version > self._newest:
            raise BackendError(f"unknown policy version {version}; the newest is {self._newest}")
        if version and version not in self._served:
            self._serve(version, self._weights_of(version, BackendError))
        self._refs[version] = self._refs.get(version, 0) + 1
        return version

    def _weights_of(
        self, version: int, error: Callable[[str], Exception]
    ) -> dict[str, torch.Tensor]:
        """A published version's weights: still in memory while being persisted, else its folder."""
        if version in self._pending:
            return self._pending[version]
        path = self._adapter_dir(version)
        if not (path / adapters.WEIGHTS).exists():
            raise error(
                f"policy@v{version} is no longer available ({path / adapters.WEIGHTS} is missing)"
            )
        return adapters.read(path, str(self.device))

    def _serve(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Put `version`'s weights in a slot, in the model's dtype. PEFT would upcast a loaded
        adapter to fp32 (its default for training), and then every LoRA layer casts its input up
        and its output back on every token: on a bf16 GPU model that was ~500 extra kernels per
        token. Sampling and `score` of a version both run this copy, so their logprobs agree."""
        assert self._slots is not None
        self._served[version] = self._slots.fill(weights)
        self._restale()

    def _ensure_spare(self) -> None:
        assert self._slots is not None
        self._slots.ensure_spare()
        self._restale()

    def _restale(self) -> None:
        assert self._slots is not None
        if self._slots.changed:  # PEFT re-points layers when adapters come and go
            self._pointed = STALE
            self._slots.changed = False
            if isinstance(self._batch, SlotBatch):
                self._batch.invalidate()  # captured steps read the layers that were replaced

    def _release(self, version: int) -> None:
        self._refs[version] -= 1
        self._collect()

    def _collect(self) -> None:
        """Free the slots of versions nobody uses any more (the newest always stays)."""
        assert self._slots is not None
        for version in sorted(self._served):
            if version != self._newest and self._refs.get(version, 0) <= 0:
                self._slots.free(self._served.pop(version))
                self._refs.pop(version, None)
        self._restale()
        # cached prompts are keys computed through a version's weights: only its requests reuse
        # them, so a version nobody is served on any more takes its entries along
        live = {self._newest, *self._served, *(v for v, n in self._refs.items() if n > 0)}
        self._prefixes.keep_versions(live)

    def _adapter_dir(self, version: int) -> Path:
        return adapters.folder(self.data_dir / "adapters", version)

    def _publish(self) -> tuple[PolicyVersion, concurrent.futures.Future[None]]:
        """Serve the trainable weights as the next version now; persist them in the background.

        The number is reserved on disk first, so it is never reused: published weights are never
        written over, and a version that served but was never persisted (a crash before the
        rename) keeps its number too. The caller records the version only once the returned
        future says its weights are on disk (`LocalBackend.publish`)."""
        root = self.data_dir / "adapters"
        version = self._newest + 1
        while adapters.taken(root, version):
            version += 1
        adapters.reserve(root, version)
        with torch.no_grad():
            weights = {k: p.detach().clone() for k, p in self._train_params().items()}
        self._serve(version, weights)
        self._pending[version] = weights
        previous, self._newest = self._newest, version
        self._collect()
        # the next publish must find a slot ready: make one after this iteration's admissions
        # and decode step (the new version's first tokens), if freeing none left one spare
        self._jobs.append(_Job(self._ensure_spare, (), concurrent.futures.Future()))
        written = self._writer.submit(adapters.write, root, version, weights, self._adapter_config)
        persisted: concurrent.futures.Future[None] = concurrent.futures.Future()
        written.add_done_callback(
            lambda f: self._inbox.put(_Job(self._persisted, (version, previous, f), persisted))
        )
        log.info("policy@v%d serves; persisting it to %s", version, self._adapter_dir(version))
        return PolicyVersion(version, str(self._adapter_dir(version))), persisted

    def _persisted(
        self, version: int, previous: int, written: concurrent.futures.Future[Path]
    ) -> None:
        """On the scheduler thread once `version`'s write ended; its error is the publish's."""
        self._pending.pop(version, None)
        error = written.exception()
        if error is None:
            return
        # Nothing may rely on weights that are not on disk: new requests go back to the previous
        # version; the number stays taken (its reservation), rows already on it finish on it.
        log.error(
            "persisting policy@v%d failed (%s); serving policy@v%d again", version, error, previous
        )
        if self._newest == version:
            self._newest = previous
            self._collect()
        raise error

    def _train_params(self) -> dict[str, torch.nn.Parameter]:
        assert self._slots is not None
        return self._slots.trainable_params()

    def _rollback(self, version: int) -> tuple[PolicyVersion, concurrent.futures.Future[None]]:
        require_published(version, self._newest)
        if version == 0:
            weights = self._initial
        else:
            weights = self._weights_of(
                version, lambda why: UnknownVersion(version, self._newest, why)
            )
        self._set_trainable(weights)  # Adam's moments belonged to the weights rolled away from
        published, persisted = self._publish()
        log.info("policy@v%d is a rollback to policy@v%d", published.version, version)
        return published, persisted

    # --- scoring and training ----------------------------------------------------------------

    def _score(
        self,
        prompt: tuple[int, ...],
        completion: tuple[int, ...],
        model: Literal["policy", "base"],
        temperature: float,
    ) -> list[float]:
        if not prompt or not completion:
            raise ValueError("score needs a non-empty prompt and completion")
        name = BASE if model == "base" else self._row(self._newest)
        ids, keep = prompt + completion, len(completion) + 1
        with torch.inference_mode(), self._abandonable():
            parts, cache = [], None
            for at in range(0, len(ids), SCORE_CHUNK):  # one chunk unless the sequence is long
                end = min(at + SCORE_CHUNK, len(ids))
                want = end - max(at, len(ids) - keep)  # this chunk's positions among the last `keep`
                inputs: dict[str, Any] = {"input_ids": torch.tensor([ids[at:end]], device=self.device),
                                          "logits_to_keep": max(want, 1)}
                if len(ids) > SCORE_CHUNK:
                    inputs.update({"use_cache": True, CACHE: cache},
                                  position_ids=torch.arange(at, end, device=self.device).view(1, -1))
                out = self._forward([name], **inputs)
                cache = cache_of(out)
                if want > 0:
                    parts.append(out.logits[0, -want:])
            logits = torch.cat(parts)[:-1]
            targets = torch.tensor(completion, device=self.device)
            lp = token_logprobs(logits, targets, temperature if temperature > 0 else 1.0)
        return [float(x) for x in lp.tolist()]

    def _logits(self, ids: tuple[int, ...], requested: int | None) -> torch.Tensor:
        if not ids:
            raise ValueError("logits needs at least one token")
        version = self._acquire(requested)
        try:
            with torch.inference_mode():
                x = torch.tensor([ids], device=self.device)
                return self._forward([self._row(version)], input_ids=x).logits[0].float().cpu()
        finally:
            self._release(version)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self._model.parameters() if p.requires_grad]

    def _get_optimizer(self) -> torch.optim.AdamW:
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self._params(), lr=1e-4)
        return self._optimizer

    def _batch_logprobs(self, group: list[Datum], name: str | None = None) -> torch.Tensor:
        """New logprobs of every completion token of `group`, concatenated, each datum at its
        own temperature, under adapter `name` (None: the trainable one). The group is packed
        into one row without padding (`packing.py`); only completion positions' logits are
        materialised."""
        packed = pack(group)
        device = self.device
        logits = self._forward(
            None if name is None else [name],
            input_ids=torch.tensor([packed.ids], device=device),
            position_ids=torch.tensor([packed.positions], device=device),
            logits_to_keep=torch.tensor(packed.keep, device=device),
            use_cache=False,  # with a cache transformers would not read the packed positions
        ).logits[0]
        targets = torch.tensor(packed.targets, device=device)
        parts, at = [], 0
        for d in group:
            n = len(d.completion_ids)
            temperature = d.temperature if d.temperature > 0 else 1.0
            parts.append(token_logprobs(logits[at : at + n], targets[at : at + n], temperature))
            at += n
        return torch.cat(parts)

    def _train_step(
        self, batch: tuple[Datum, ...], loss: LossSpec, optim: OptimSpec
    ) -> StepMetrics:
        if not batch:
            raise ValueError("train_step needs at least one Datum")
        started = time.perf_counter()
        total = batch_tokens(batch)
        optimizer = self._get_optimizer()
        for param_group in optimizer.param_groups:
            param_group.update(
                lr=optim.learning_rate,
                betas=(optim.beta1, optim.beta2),
                eps=optim.eps,
                weight_decay=optim.weight_decay,
            )
        optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped = kl = 0.0
        for group in packed_micro_batches(batch, self.train_token_budget):
            base = None
            if loss.kl_coef:
                with torch.no_grad():
                    base = self._batch_logprobs(group, BASE)
            new = self._batch_logprobs(group)
            old = torch.tensor(
                [x for d in group for x in d.logprobs], device=new.device, dtype=new.dtype
            )
            adv = torch.tensor(
                [x for d in group for x in d.advantages], device=new.device, dtype=new.dtype
            )
            terms = ppo_token_losses(new, old, adv, torch.ones_like(new), loss, base)
            part = terms.loss.sum() / total  # token-mean over the WHOLE batch
            part.backward()
            loss_sum += float(part.detach())
            clipped += float(terms.clipped.sum())
            kl += float(terms.approx_kl.sum())
        max_norm = optim.grad_clip_norm if optim.grad_clip_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params(), max_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return StepMetrics(
            loss=loss_sum,
            clip_fraction=clipped / total,
            approx_kl=kl / total,
            grad_norm=grad_norm,
            tokens=total,
            samples=len(batch),
            seconds=time.perf_counter() - started,
        )

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self._model, adapter_name=TRAIN)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    # --- checkpoints ---------------------------------------------------------------------------

    def _checkpoint_dir(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() else self.data_dir / "checkpoints" / name

    def _save_state(self, name: str) -> str:
        path = self._checkpoint_dir(name)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._model.save_pretrained(str(tmp / "adapter"), selected_adapters=[TRAIN])
        optimizer = self._optimizer.state_dict() if self._optimizer is not None else None
        torch.save({"optimizer": optimizer}, tmp / "optimizer.pt")
        meta = {
            "version": self._newest,
            "steps": self._steps,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "model": self.spec.name,
        }
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        return str(path)

    def _set_trainable(self, weights: dict[str, torch.Tensor]) -> None:
        """The trainable adapter's weights, and a fresh optimizer for them."""
        from peft import set_peft_model_state_dict

        with torch.no_grad():
            set_peft_model_state_dict(self._model, weights, adapter_name=TRAIN)
        self._optimizer = None

    def _restore(self, version: int, path: str | None) -> None:
        """After a restart: train on from the weights published as `version` (at `path`), with a
        fresh optimizer, and serve them as the newest version."""
        if version == 0:
            self._set_trainable(self._initial)
        else:
            folder = Path(path) if path else self._adapter_dir(version)
            file = folder / adapters.WEIGHTS
            if not file.exists():
                raise UnknownVersion(
                    version,
                    self._newest,
                    f"policy@v{version}'s weights are gone ({file} is missing)",
                )
            self._set_trainable(adapters.read(folder, str(self.device)))
        self._prefixes.clear()  # a version number read back from disk: cache nothing across
        self._newest = version
        self._release(self._acquire(None))  # loads the newest version's adapter if missing

    def _load_state(self, name: str) -> None:
        from safetensors.torch import load_file

        path = self._checkpoint_dir(name)
        if not (path / "state.json").exists():
            raise BackendError(f"no checkpoint at {path}")
        meta = json.loads((path / "state.json").read_text())
        self._set_trainable(
            load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(self.device))
        )
        saved = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
        if saved["optimizer"] is not None:
            self._get_optimizer().load_state_dict(saved["optimizer"])
        self._steps = int(meta["steps"])
        self._prefixes.clear()
        self._newest = int(meta["version"])
        self._release(self._acquire(None))  # loads the newest version's adapter if missing


async def collect(stream: AsyncIterator[TokenChunk]) -> Completion:
    """Gather a streamed completion into one record."""
    tokens: list[int] = []
    logprobs: list[float] = []
    tops: list[Any] = []
    version, finish = 0, None
    async for chunk in stream:
        tokens += chunk.tokens
        logprobs += chunk.logprobs
        if chunk.top_logprobs is not None:
            tops += chunk.top_logprobs
        version, finish = chunk.version, chunk.finish_reason
    if finish is None:
        raise BackendError("the completion stream ended without a finish reason")
    return Completion(
        tokens=tuple(tokens),
        logprobs=tuple(logprobs),
        finish_reason=finish,
        version=version,
        top_logprobs=tuple(tops) if tops else None,
    )


__all__ = ["BASE", "TRAIN", "Engine", "collect"]
