"""The torch engine: one HF causal LM + PEFT LoRA, owned by one scheduler thread.

Every verb (sample, score, train_step, publish, save/load) runs on that thread, so the model is
never mutated mid-forward. Sampling is continuously batched: new requests are prefilled together
(one forward for those admitted at once, `prefill.Prefill`) and merged into the running batch
between decode steps (`kvbatch.KVBatch`, or `slotbatch.SlotBatch` with `static_cache`); other
jobs run one per iteration between decode steps. A user's request goes first (`user_first`): it
is admitted ahead of background ones (the learner's sampling), the background rows are paused
while it runs, and no job starts meanwhile (a train step waits between micro-batches). A prompt that shares a prefix with a recent one
on the same version prefills only the rest (`prefixcache.PrefixCache`, `prefix_cache_mb`). Results reach asyncio callers through thread-safe
futures and per-request queues.

Versions. The trainable adapter is PEFT's "default" and is never served. Version 0 is the base
(PEFT's "__base__" row name); `publish()` copies the trainable weights into a serving slot (a
reusable PEFT adapter, `adapters.Slots`) that serves from the next scheduler iteration, and a
writer thread persists the same weights to `data_dir/adapters/vK/` (PEFT format); `publish()`
returns once they are on disk (`durable=False`: once the version serves). Each decode row names
its own adapter (PEFT mixed-batch LoRA, `adapter_names`), so a request admitted on vK finishes on
vK while newer requests run on vK+1 in the same batch. A slot is freed once no request uses its
version and a newer version exists; an older version asked for by number is reloaded from its
folder.

Adapters. Besides its own lineage the engine serves registered LoRA adapters by key
(`register_adapter`; a request names one with `adapter=`): rows on different adapters decode in
one batch, each adding its own adapter's delta (`multilora`), and the adapters live in slots
within `adapter_memory_mb`, the least recently used evicted to disk and read back on demand
(`registry`).

`rollback(K)` copies vK's folder (or, for v0, the initial adapter kept from start-up) into the
trainable adapter, drops the optimizer, and publishes it as the next version.

This file holds the engine's lifecycle and its async verbs; the scheduler thread's work lives
beside it, one part per file, each mixed into `Engine`: `scheduling` (the loop, jobs, shutdown),
`forwarding` (which adapter a forward runs on; abandoning a long forward on close), `decoding`
(admission, prefill, decode steps, drawing tokens), `adapterrows` (a row's version or registered
adapter), `versions` (slots, publish, rollback), `training` (score, the train step, checkpoints).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import secrets
import threading
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from clawbridge.local_gpu import adapters, models, precision
from clawbridge.local_gpu.adapterrows import AdapterRows
from clawbridge.local_gpu.adapters import TRAIN
from clawbridge.local_gpu.decoding import Decoding, _Job, _Seq
from clawbridge.local_gpu.forwarding import Forwarding
from clawbridge.local_gpu.kvbatch import KVBatch
from clawbridge.local_gpu.multilora import AdapterStack
from clawbridge.local_gpu.prefixcache import PrefixCache
from clawbridge.local_gpu.registry import AdapterRegistry, RegistryStats
from clawbridge.local_gpu.scheduling import Scheduling
from clawbridge.local_gpu.slotbatch import SlotBatch
from clawbridge.local_gpu.training import Training
from clawbridge.local_gpu.versions import VersionSlots
from clawbridge.protocol import BackendError, Priority
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


class Engine(Scheduling, Forwarding, Decoding, AdapterRows, VersionSlots, Training):
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
        merge_adapters: bool = True,
        user_first: bool = True,
        adapter_memory_mb: float = 1024,
        background_share: float = 0.25,
    ) -> None:
        self.spec = spec
        self.user_first = user_first  # a user's request ahead of background work (scheduling.py)
        if not 0.0 <= background_share < 1.0:
            raise ValueError(f"background_share {background_share:g}: a share of the engine's time, in [0, 1)")
        self.background_share = background_share  # ... which still gets this share of a busy engine
        # (scheduling.py: the learner's share)
        self._credit, self._clock, self._turn, self._gap = 0.0, None, False, None
        self.merge_adapters = merge_adapters
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
        self._query_dtype = torch.float32
        self._lora_layers: list[Any] = []
        self._trainable_active: list[Any] = []  # each layer's active adapter as PEFT set it up
        self._pointed: str | None = None  # the adapter the layers point at (None: trainable)
        self._merged: precision.MergedAdapters | None = None  # served adapters folded into bf16 weights
        self._optimizer: torch.optim.AdamW | None = None
        self._initial: dict[str, torch.Tensor] = {}  # the trainable adapter at start (v0's)
        self._newest = 0
        self._steps = 0
        self._refs: dict[int, int] = {}
        self._slots: adapters.Slots | None = None
        self._served: dict[int, str] = {}  # published version -> the slot serving it (in memory)
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # versions still being persisted
        self._folders: dict[int, Path] = {}  # versions restored from another process's folder
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
        self.adapter_memory_mb = adapter_memory_mb
        self._stack: AdapterStack | None = None  # registered adapters' weights, in slots
        self._registry: AdapterRegistry | None = None
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
        # loaded in fp32 and cast down here, so that the output head keeps the exact weights
        base = models.load_model(self.spec, device=self.device, seed=self.seed)
        precision.prepare(base, self.dtype, self.device)  # a CPU: bf16 matmuls, the rest fp32
        config = LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            target_modules=self.target_modules,
            lora_dropout=0.0,
        )
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(self.seed)  # LoRA A init must not depend on global state
            # PEFT 0.21 itself reads transformers' deprecated `is_gradient_checkpointing` (our
            # code uses neither): the one library warning a new user would otherwise see
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            self._model = get_peft_model(base, config, adapter_name=TRAIN)
        self._model.eval()  # no dropout anywhere; PEFT mixed-batch rows require eval mode
        # the residual stream's dtype, which attention's queries have: fp32 on a CPU (only the
        # matmuls are bf16), the compute dtype where the model is cast whole
        self._query_dtype = self._model.get_input_embeddings().weight.dtype
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._lora_layers = [m for m in self._model.modules() if isinstance(m, BaseTunerLayer)]
        self._trainable_active = [layer._active_adapter for layer in self._lora_layers]
        if self.merge_adapters and precision.MergedAdapters.possible(self._lora_layers):
            self._merged = precision.MergedAdapters(self._lora_layers)
        self._initial = self._trainable_state()
        # on a CPU the activations stay fp32 whatever the dtype, and the served adapters with them
        upcast = str(self.device).startswith("cpu")
        self._slots = adapters.Slots(self._model, TRAIN, self._lora_layers, self._trainable_active, upcast=upcast)
        self._slots.ensure_spare()  # the first publish fills it without creating LoRA layers
        self._adapter_config = adapters.config_json(self._model, TRAIN)
        self._stack, self._registry = self._new_registry()
        self._thread = threading.Thread(target=self._run, name="clawbridge-engine", daemon=True)
        self._thread.start()

    def _new_registry(self) -> tuple[AdapterStack, AdapterRegistry]:
        """Slots for as many adapters of the engine's rank as `adapter_memory_mb` holds, in the
        residual stream's dtype (fp32 on a CPU, as the serving slots)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = {n: m for n, m in self._model.named_modules() if isinstance(m, BaseTunerLayer)}
        probe = AdapterStack(layers, rank=self.lora_rank, slots=0, dtype=self._query_dtype, device=self.device)
        budget = int(max(0.0, self.adapter_memory_mb) * 2**20)
        stack = AdapterStack(layers, rank=self.lora_rank, slots=budget // probe.slot_bytes,
                             dtype=self._query_dtype, device=self.device)
        cache = self.data_dir / "adapter-cache"
        return stack, AdapterRegistry(stack, cache, default_alpha=self.lora_alpha, budget_bytes=budget)

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

    def adapter_stats(self) -> RegistryStats:
        """The registered adapters: how many, resident, in use, memory, loads and evictions (a
        snapshot, read from another thread)."""
        if self._registry is None:
            raise BackendError("the engine is not started: call start() first")
        return self._registry.stats()

    @property
    def loaded_versions(self) -> set[int]:
        """Published versions whose adapter is in memory."""
        return set(self._served)

    # --- async API ---------------------------------------------------------------------------

    async def sample_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        version: int | None = None,
        priority: Priority = "user",
        adapter: str | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Stream a completion on `version` of the engine's own lineage (None: the newest), or on
        the registered adapter `adapter` (its chunks report the version it was registered with)."""
        if adapter is not None and version is not None:
            raise ValueError("a request names a version or an adapter, not both")
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        seq = self._new_seq(prompt_ids, params, version, priority, loop, chunks)
        seq.adapter = adapter
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
        priority: Priority = "user",
        adapter: str | None = None,
    ) -> list[Completion]:
        def nth(i: int) -> SamplingParams:
            if params.seed is None or i == 0:
                return params
            return dataclasses.replace(params, seed=params.seed + i)

        return list(
            await asyncio.gather(
                *(
                    collect(self.sample_stream(prompt_ids, nth(i), version=version, priority=priority, adapter=adapter))
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
        version: int | None = None,
    ) -> list[float]:
        """`version`: the published version whose weights "policy" means (None: the newest)."""
        return await self._call(
            self._score, tuple(prompt_ids), tuple(completion_ids), model, temperature,
            None if model == "base" else version,
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

    async def blend(self, version: int, alpha: float) -> PolicyVersion:
        published, persisted = await self._call(self._blend, version, alpha)
        await asyncio.wrap_future(persisted)
        return published

    async def register_adapter(
        self,
        key: str,
        source: Mapping[str, torch.Tensor] | Path,
        *,
        version: int = 0,
        alpha: float | None = None,
    ) -> None:
        """Serve `source` (LoRA weights keyed as PEFT saves them, or a PEFT adapter folder or
        safetensors file) to requests that name `key`. Its scale is alpha / rank (alpha: the
        argument, a folder's adapter_config.json, else the engine's `lora_alpha`). Registering a
        key again replaces it (`AdapterInUse` while a request runs on it)."""
        await self._call(self._register_adapter, key, source, version, alpha)

    async def evict_adapter(self, key: str) -> bool:
        """Free `key`'s memory now (it comes back from disk on its next request); False when it
        was not resident, `AdapterInUse` while a request runs on it."""
        return bool(await self._call(self._evict_adapter, key))

    async def remove_adapter(self, key: str) -> None:
        """Forget `key` (`AdapterInUse` while a request runs on it)."""
        await self._call(self._remove_adapter, key)

    async def save_state(self, name: str) -> str:
        return await self._call(self._save_state, name)

    async def load_state(self, name: str) -> None:
        await self._call(self._load_state, name)

    async def restore(self, version: int, path: str | None) -> None:
        await self._call(self._restore, version, path)

    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Train on from another lineage (`protocol.Lineages`): from the checkpoint `state`, or from
        published `version`'s weights (at `path`; 0: a fresh adapter) with a fresh optimizer.
        What is published and served, and the numbering of versions, stay as they are."""
        await self._call(self._switch, state, version, path)

    async def logits(self, token_ids: Sequence[int], *, version: int | None = None) -> torch.Tensor:
        """The logits at every position of `token_ids` on a version (default: the newest),
        computed as serving computes them: that version's adapter (merged into the bf16 weights
        where the engine merges, `merge_adapters`), in the model's dtype. float32, on the CPU.
        For tools that check a copy of a version (export)."""
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
        priority: Priority,
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
            priority=priority,
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


__all__ = ["Engine", "collect"]
