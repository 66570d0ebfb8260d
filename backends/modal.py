"""The Modal backend: the local torch engine on a Modal GPU (`clawbridge.backends.modal_app`).

Every verb is one `.remote.aio` call on the deployed `Engine` class, whose methods are the
Backend protocol itself running `LocalBackend` in the container, so the semantics are the local
backend's by construction. The tokenizer lives here (the renderer needs it locally): Modal serves
the models of the registry (`smollm2-135m-instruct`, `tiny-random`) or an HF folder present on both
sides. Cost is metered in GPU seconds of call time; Modal also bills cold starts and the idle
`scaledown_window`, which the meter cannot see (docs/backends.md). Several users' adapters
(`protocol.Lineages`) are the local engine's: `switch` loads another lineage's checkpoint or
published adapter from the Volume, and any version on it is sampled and scored by number.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.backends.costs import CostMeter, Usage
from clawbridge.backends.remote import PermanentBackendError, RetryPolicy, call
from clawbridge.protocol import Priority, Routing, ScoreModel
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
    from clawbridge.config import Settings
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
NO_CREDENTIALS = (
    "Modal refused the credentials ({error}). Run `modal token new`, or set MODAL_TOKEN_ID and "
    "MODAL_TOKEN_SECRET, then deploy the engine with `clawbridge modal deploy --gpu H100`."
)


class ModalBackend(Routing):
    name = "modal"

    def __init__(
        self,
        *,
        engine: Any,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        context_length: int,
        retry: RetryPolicy = RetryPolicy(),
        meter: CostMeter | None = None,
    ) -> None:
        self.engine = engine  # a Modal `Obj` of the Engine class (or the offline fake)
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self.retry = retry
        self.meter = meter or CostMeter.for_platform("modal")
        self._version = 0

    @classmethod
    def from_settings(cls, settings: Settings, client: Any = None, tokenizer: PreTrainedTokenizerBase | None = None) -> ModalBackend:
        """`client`: an Engine object (the offline fake in tests). By default the deployed class
        is looked up lazily: `modal.Cls.from_name` contacts nothing until the first call."""
        from clawbridge.local_gpu import models

        spec = models.resolve(settings.model, settings.cache_dir)
        if client is None:
            import modal
            from clawbridge.backends.modal_app import APP_NAME, CLASS_NAME, GPU

            engine_cls = modal.Cls.from_name(settings.cloud.modal_app or APP_NAME, CLASS_NAME)
            if settings.cloud.modal_gpu != GPU:
                engine_cls = engine_cls.with_options(gpu=settings.cloud.modal_gpu)
            client = engine_cls(model=settings.model, lora_rank=settings.training.lora_rank,
                                lora_alpha=settings.training.lora_alpha, seed=settings.seed)
        return cls(
            engine=client, tokenizer=tokenizer or models.load_tokenizer(spec),
            model_name=settings.serving.served_model_name or spec.name, context_length=spec.context_length,
            retry=RetryPolicy(attempts=settings.cloud.cloud_attempts, timeout_s=settings.cloud.cloud_timeout_s),
            meter=CostMeter.for_platform("modal", settings.budget_usd, Path(settings.data_dir) / "costs.json"),
        )

    async def _remote(self, method: str, *args: Any, activity: str = "serve", retry: bool = True) -> Any:
        started = time.monotonic()
        try:
            result = await call(f"modal {method}", lambda: getattr(self.engine, method).remote.aio(*args),
                                self.retry, retry=retry)
        except PermanentBackendError as e:
            if type(e.__cause__).__name__ == "AuthError":
                raise PermanentBackendError(NO_CREDENTIALS.format(error=e.__cause__)) from e
            raise
        finally:
            self.meter.record(activity, Usage(gpu_seconds=time.monotonic() - started))  # type: ignore[arg-type]
        return result

    @property
    def newest(self) -> int:
        return self._version

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    async def start(self) -> None:
        info = await self._remote("info")
        self._version = int(info["version"])
        self.context_length = int(info["context_length"])
        log.info("modal: engine for %s ready at policy@v%d", info["model_name"], self._version)

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None,
        priority: Priority = "user",
    ) -> list[Completion]:
        """`priority` goes with the call: the container's engine serves the user first."""
        from clawbridge.backends.tinkerlike import check_context

        check_context(len(prompt_ids), params.max_tokens, self.context_length)
        return list(await self._remote("sample", list(prompt_ids), params, n, self.route(version), priority))

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None,
        priority: Priority = "user",
    ) -> AsyncIterator[TokenChunk]:
        # One chunk per call: a token stream across Modal would cost a round trip per chunk.
        (c,) = await self.sample(prompt_ids, params, n=1, version=version, priority=priority)
        yield c.as_chunk()

    async def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
        model: ScoreModel = "policy", temperature: float = 1.0, version: int | None = None,
    ) -> list[float]:
        return list(await self._remote("score", list(prompt_ids), list(completion_ids), model, temperature, version,
                                       activity="score"))

    async def train_step(
        self, batch: Sequence[Datum], loss: LossSpec = LossSpec(), optim: OptimSpec = OptimSpec()
    ) -> StepMetrics:
        self.meter.check_training()
        # Not retried: a step that failed after running would be applied twice.
        metrics: StepMetrics = await self._remote("train_step", list(batch), loss, optim, activity="train", retry=False)
        return metrics

    async def publish(self) -> PolicyVersion:
        published: PolicyVersion = await self._remote("publish", activity="train")
        self._version = published.version
        return published

    async def rollback(self, version: int) -> PolicyVersion:
        # Not retried: a rollback that ran but whose answer was lost would publish twice.
        published: PolicyVersion = await self._remote("rollback", version, activity="train", retry=False)
        self._version = published.version
        return published

    async def save_state(self, name: str) -> str:
        return str(await self._remote("save_state", name, activity="train"))

    async def load_state(self, name: str) -> None:
        await self._remote("load_state", name, activity="train")
        self._version = int((await self._remote("info"))["version"])  # the engine restores it

    async def restore(self, version: int, path: str | None) -> None:
        """Serve and train on from `version`'s weights on the Volume (the engine's restore: a
        fresh optimizer)."""
        await self._remote("restore", version, path, activity="train")
        self._version = int((await self._remote("info"))["version"])

    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Train another lineage (`protocol.Lineages`): the engine's switch, in the container (a
        checkpoint, or a published adapter on the Volume). Retried: loading twice loads the same."""
        await self._remote("switch", state, version, path, activity="train")

    async def close(self) -> None:
        return None  # the container scales down by itself after its idle window


def from_settings(settings: Settings) -> Any:
    """What `clawbridge up --backend modal` calls (`clawbridge.server.build_backend`): the
    backend behind the redaction hook unless `--no-redact`."""
    from clawbridge.backends.redact import protect

    return protect(ModalBackend.from_settings(settings), settings.judging.redact)
