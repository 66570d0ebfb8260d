"""A backend that answers instantly with canned tokens: the benchmark's fixture, so the numbers
measure the proxy hop (validation, rendering, sessions, capture, SSE), not a model.

It implements the Backend protocol with the embedded model's tokenizer (so rendering is real) and
streams the answer token by token, one chunk per token, as an engine would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from clawbridge.local_gpu import models
from clawbridge.types import Completion, PolicyVersion, SamplingParams, StepMetrics, TokenChunk

ANSWER = "Sure! Here is a short, canned answer of about sixteen tokens for you."


class CannedBackend:
    name = "canned"
    model_name = "canned"
    context_length = 32768

    def __init__(self) -> None:
        self._tok = models.load_tokenizer(models.resolve(models.EMBEDDED))
        eos = self._tok.convert_tokens_to_ids("<|im_end|>")
        self.tokens = (*self._tok.encode(ANSWER, add_special_tokens=False), eos)
        self.logprobs = tuple(-0.5 for _ in self.tokens)

    @property
    def version(self) -> int:
        return 0

    def tokenizer(self) -> Any:
        return self._tok

    async def start(self) -> None:
        return None

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None,
        priority: str = "user",
    ) -> list[Completion]:
        return [Completion(self.tokens, self.logprobs, "stop", 0) for _ in range(n)]

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None,
        priority: str = "user",
    ) -> AsyncIterator[TokenChunk]:
        last = len(self.tokens) - 1
        for i, (t, lp) in enumerate(zip(self.tokens, self.logprobs, strict=True)):
            yield TokenChunk((t,), (lp,), 0, "stop" if i == last else None)

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], **kw: Any) -> list[float]:
        return [-0.5] * len(completion_ids)

    async def train_step(self, *a: Any, **kw: Any) -> StepMetrics:
        raise NotImplementedError("the canned backend does not train")

    async def publish(self) -> PolicyVersion:
        raise NotImplementedError

    async def save_state(self, name: str) -> str:
        raise NotImplementedError

    async def load_state(self, name: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None
