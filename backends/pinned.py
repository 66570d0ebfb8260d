"""A view of a backend that serves a chosen published version instead of always the newest.

The gate (clawbridge.learning.gate) publishes a candidate and samples it explicitly by version,
while every request the proxy admits keeps going to the version that served before; only when
the candidate passes does serving move. `version` is what the proxy reads at admission, so the
pin is all it takes: the proxy never knows a gate exists, and serving never pauses.
With no pin (`None`, the default and the state between training steps) the view is the backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from clawbridge.protocol import Backend, ScoreModel
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


class PinnedBackend:
    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.model_name = inner.model_name
        self.context_length = inner.context_length
        self.pinned: int | None = None

    def pin(self, version: int | None) -> None:
        """Serve `version` (a published one) to requests admitted from now on; None: the newest."""
        if version is not None and not 0 <= version <= self.inner.version:
            raise ValueError(f"cannot serve policy@v{version}: the newest published is v{self.inner.version}")
        self.pinned = version

    @property
    def version(self) -> int:
        """The version a request admitted now is served by."""
        return self.inner.version if self.pinned is None else self.pinned

    @property
    def newest(self) -> int:
        """The newest published version (a candidate under the gate's evaluation, perhaps)."""
        return self.inner.version

    def __getattr__(self, name: str) -> Any:  # platform extras (engine, judge_endpoint, ...)
        return getattr(self.inner, name)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.inner.tokenizer()

    async def start(self) -> None:
        await self.inner.start()

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None
    ) -> list[Completion]:
        return await self.inner.sample(prompt_ids, params, n=n, version=self.version if version is None else version)

    def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None
    ) -> AsyncIterator[TokenChunk]:
        return self.inner.sample_stream(prompt_ids, params, version=self.version if version is None else version)

    async def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
        model: ScoreModel = "policy", temperature: float = 1.0,
    ) -> list[float]:
        return await self.inner.score(prompt_ids, completion_ids, model=model, temperature=temperature)

    async def train_step(
        self, batch: Sequence[Datum], loss: LossSpec = LossSpec(), optim: OptimSpec = OptimSpec()
    ) -> StepMetrics:
        return await self.inner.train_step(batch, loss, optim)

    async def publish(self) -> PolicyVersion:
        return await self.inner.publish()

    async def rollback(self, version: int) -> PolicyVersion:
        return await self.inner.rollback(version)

    async def save_state(self, name: str) -> str:
        return await self.inner.save_state(name)

    async def load_state(self, name: str) -> None:
        await self.inner.load_state(name)

    async def close(self) -> None:
        await self.inner.close()


__all__ = ["PinnedBackend"]
