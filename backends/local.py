"""The `local` backend: the in-process torch engine (`clawbridge.local_gpu.engine`) on CPU, or on
one GPU when `device="cuda"`. An adapter from the Backend protocol to the engine, nothing more:
it checks the context length at the edge and maps settings onto engine arguments.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from clawbridge.local_gpu import adapters, models, precision
from clawbridge.local_gpu.engine import Engine
from clawbridge.protocol import BackendError, ContextLengthExceeded, Priority, Routing, ScoreModel
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
    import torch
    from clawbridge.config import Settings
    from transformers import PreTrainedTokenizerBase


CPU_SUGGESTED_MAX_TOKENS = 128


class LocalBackend(Routing):
    name = "local"
    distills_topk = True  # the engine runs the base model inside its own loss (protocol.DistillsTopK)

    def __init__(
        self,
        model: str = models.EMBEDDED,
        data_dir: Path = Path(".clawbridge"),
        *,
        cache_dir: Path | None = None,
        served_model_name: str | None = None,
        lora_rank: int = 32,
        lora_alpha: int = 32,
        seed: int = 0,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        engine_dtype: precision.EngineDtype = "fp32",
        max_batch: int = 16,
        train_token_budget: int = 2048,
        threads: int | None = None,
        static_cache: bool = False,
        prefix_cache_mb: int = 2048,
        merge_adapters: bool = True,
        user_first: bool = True,
        adapter_memory_mb: float = 1024,
        background_share: float = 0.25,
    ) -> None:
        spec = models.resolve(model, cache_dir)
        self._registered: dict[str, asyncio.Future[None]] = {}  # versions registered as adapters (`adapter_for`)
        self.model_name = served_model_name or spec.name
        self.context_length = spec.context_length
        # what /v1/models suggests agents ask for: on CPU each token is a decode step of a
        # ~13 K-token context (OpenClaw's), so a long default budget makes every turn slow
        self.suggested_max_tokens = CPU_SUGGESTED_MAX_TOKENS if device == "cpu" else None
        # `dtype` (a GPU caller's) wins, then `engine_dtype`, `auto` asking the CPU. Here it
        # defaults to fp32 (logprobs reproducible to ~1e-6); the setting, to auto
        chosen = dtype or precision.resolve(engine_dtype, device)
        self.dtype = precision.name(chosen)  # what the banner, /v1/models and status show
        self.engine = Engine(
            spec,
            data_dir=Path(data_dir),
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            device=device,
            dtype=chosen,
            seed=seed,
            max_batch=max_batch,
            train_token_budget=train_token_budget,
            threads=threads,
            static_cache=static_cache,
            prefix_cache_mb=prefix_cache_mb,
            merge_adapters=merge_adapters,
            user_first=user_first,
            adapter_memory_mb=adapter_memory_mb,
            background_share=background_share,
        )

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: object) -> LocalBackend:
        kwargs: dict[str, object] = dict(
            model=settings.model,
            data_dir=settings.data_dir,
            cache_dir=settings.cache_dir,
            served_model_name=settings.serving.served_model_name,
            lora_rank=settings.training.lora_rank,
            lora_alpha=settings.training.lora_alpha,
            seed=settings.seed,
            prefix_cache_mb=settings.engine.prefix_cache_mb,
            engine_dtype=settings.engine.engine_dtype,
            max_batch=settings.engine.engine_max_batch,
            merge_adapters=settings.engine.engine_merge_adapters,
            user_first=settings.engine.engine_user_first,
            adapter_memory_mb=settings.engine.adapter_memory_mb,
            background_share=settings.engine.engine_background_share,
        )
        kwargs.update(overrides)
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def newest(self) -> int:
        return self.engine.version

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    async def start(self) -> None:
        await asyncio.to_thread(self.engine.start)

    def _check_length(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if len(prompt_ids) + params.max_tokens > self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), params.max_tokens, self.context_length)

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
        """`adapter`: a key registered with `engine.register_adapter` instead of a version."""
        self._check_length(prompt_ids, params)
        routed = None if adapter is not None else self.route(version)
        return await self.engine.sample(prompt_ids, params, n=n, version=routed, priority=priority, adapter=adapter)

    async def sample_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        version: int | None = None,
        priority: Priority = "user",
        adapter: str | None = None,
    ) -> AsyncIterator[TokenChunk]:
        self._check_length(prompt_ids, params)
        routed = None if adapter is not None else self.route(version)
        async for chunk in self.engine.sample_stream(prompt_ids, params, version=routed, priority=priority,
                                                     adapter=adapter):
            yield chunk

    async def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        model: ScoreModel = "policy",
        temperature: float = 1.0,
        version: int | None = None,
    ) -> list[float]:
        if len(prompt_ids) + len(completion_ids) > self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), len(completion_ids), self.context_length)
        return await self.engine.score(
            prompt_ids, completion_ids, model=model, temperature=temperature, version=version
        )

    async def train_step(
        self,
        batch: Sequence[Datum],
        loss: LossSpec = LossSpec(),
        optim: OptimSpec = OptimSpec(),
    ) -> StepMetrics:
        return await self.engine.train_step(batch, loss, optim)

    async def publish(self) -> PolicyVersion:
        return await self.engine.publish()

    async def rollback(self, version: int) -> PolicyVersion:
        return await self.engine.rollback(version)

    async def blend(self, version: int, alpha: float) -> PolicyVersion:
        return await self.engine.blend(version, alpha)

    async def save_state(self, name: str) -> str:
        return await self.engine.save_state(name)

    async def load_state(self, name: str) -> None:
        await self.engine.load_state(name)

    async def restore(self, version: int, path: str | None) -> None:
        """Serve and train on from `version`'s published weights (fresh optimizer)."""
        await self.engine.restore(version, path)

    async def adapter_for(self, version: int, path: str | None = None) -> str:
        """The key of the registered adapter that serves published `version` (`protocol.ServesAdapters`),
        registered from its folder on first need: rows on many users' versions then decode in one
        batch through the stack's per-row gather (docs/engine.md#many-adapters-one-base-model-registered-adapters),
        resident under `adapter_memory_mb`, the least recently used evicted and read back."""
        key = f"policy@v{version}"
        registering = self._registered.get(key)
        if registering is None:  # once: a second request waits for the first one's registration
            folder = Path(path) if path else adapters.folder(self.engine.data_dir / "adapters", version)
            registering = self._registered[key] = asyncio.ensure_future(
                self.engine.register_adapter(key, folder, version=version))
        try:
            await asyncio.shield(registering)
        except Exception:
            if self._registered.get(key) is registering:  # the next request tries again
                del self._registered[key]
            raise
        return key

    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Train on from another user's lineage (`protocol.Lineages`)."""
        await self.engine.switch(state, version, path)

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.close)


def from_settings(settings: Settings) -> LocalBackend:
    return LocalBackend.from_settings(settings)


__all__ = ["BackendError", "LocalBackend", "from_settings"]
