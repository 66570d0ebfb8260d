"""The Tinker backend (tinker 0.38): LoRA training and sampling on Thinking Machines' service.

The verbs map one to one onto Tinker's primitives (docs/design.md#the-backend-protocol):

- `sample`: the sampling client of the requested version, token ids in, token ids and sampling
  logprobs out; temperature 1, top_p 1, top_k -1 unless the request says otherwise.
- `score`: `compute_logprobs(prompt + completion, prompt_logprobs_last_n=len(completion))`.
- `train_step`: `forward_backward(loss_fn="ppo", clip thresholds 1-eps_low / 1+eps_high)` then
  `optim_step(AdamParams)`. Tinker's built-in losses SUM over tokens; advantages are scaled by
  1 / (completion tokens in the batch) (`clawbridge.loss.sum_loss_scale`), which makes the
  summed gradient equal the token-mean gradient of `clawbridge.loss.ppo_loss`: the PPO min/clip
  choice depends only on the sign of A, and the loss is linear in A on either branch.
- `publish`: `save_weights_and_get_sampling_client()`; every `persist_every` versions also
  `save_weights_for_sampler` (a persistent `tinker://` path that outlives the session).
- `save_state` / `load_state`: `save_state(name)` and
  `create_training_client_from_state_with_optimizer(path)`.
- `rollback(K)`: sampler weights cannot be loaded back into a training run, so every version
  also keeps a training state (`save_state("policy-vK")`, saved at start for v0 and beside each
  publish; the index in the data directory remembers its path). Rollback is
  `create_training_client_from_state(path)` (weights only: a fresh optimizer) and a publish.
- `switch` (several users' adapters, `protocol.Lineages`): one training client per lineage. The
  client left is kept while it is exactly the state just saved of it (the last `KEEP_LINEAGES`),
  so switching back to that state takes it up again with no call; any other state is
  `create_training_client_from_state_with_optimizer(path)`, a published version's weights
  `create_training_client_from_state("policy-vK")` (v0: `create_lora_training_client`).
- `score(version=K)`, `sample(version=K)`: vK's sampling client. The `KEEP_SAMPLERS` used most
  recently stay open; another is opened again from its persisted sampler weights, else from
  its training state (a training client of its own, `save_weights_and_get_sampling_client`).

Version 0 is the base model's sampling client: the judge samples there (`sample(version=0)`).
The SDK is imported lazily, and nothing touches the network before `start()`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.backends.costs import CostMeter, Usage
from clawbridge.backends.remote import RetryPolicy, call
from clawbridge.backends.tinkerlike import (
    TEMPERATURE_ONE,
    Samplers,
    StateIndex,
    check_batch,
    check_context,
    completion_logprobs,
    completion_tail,
    platform_datum,
    require_credentials,
    sampler_state,
    state_path,
    step_metrics,
    stop_list,
    temperature_reason,
    version_state,
)
from clawbridge.loss import sum_loss_scale
from clawbridge.protocol import (
    BackendError,
    Priority,
    Routing,
    ScoreModel,
    UnknownVersion,
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
    from clawbridge.config import Settings
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
KEEP_LINEAGES = 4  # training clients of lineages switched away from, kept to switch back to at no cost
__all__ = ["TinkerBackend", "check_context", "from_settings", "require_credentials", "version_state"]


# --- the backend --------------------------------------------------------------------------------


class TinkerBackend(Routing):
    name = "tinker"

    def __init__(
        self,
        *,
        service_client: Any,
        base_model: str,
        tokenizer: PreTrainedTokenizerBase | None = None,
        served_model_name: str | None = None,
        context_length: int = 32768,
        lora_rank: int = 32,
        seed: int | None = None,
        persist_every: int = 0,
        retry: RetryPolicy = RetryPolicy(),
        meter: CostMeter | None = None,
        state_index: Path | None = None,
    ) -> None:
        self.service = service_client
        self.base_model = base_model
        self.model_name = served_model_name or base_model
        self.context_length = context_length
        self.lora_rank = lora_rank
        self.seed = seed
        self.persist_every = persist_every
        self.retry = retry
        self.meter = meter or CostMeter.for_platform("tinker")
        self._tokenizer = tokenizer
        self._training: Any = None
        self._clean: str | None = None  # the state the training client is exactly (saved, not trained since)
        self._parked: dict[str, Any] = {}  # state path -> the training client that is exactly it
        self._samplers = Samplers()
        self._states = StateIndex(state_index)
        self._version = 0

    @classmethod
    def from_settings(
        cls, settings: Settings, client: Any = None, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> TinkerBackend:
        """`client` is a `tinker.ServiceClient` (or the offline fake); by default one is built
        from TINKER_API_KEY (lazily: no network until `start`)."""
        if client is None:
            import tinker

            require_credentials("tinker")  # the SDK would retry for minutes without a key
            client = tinker.ServiceClient()
        return cls(
            service_client=client, base_model=settings.cloud.tinker_base_model, tokenizer=tokenizer,
            served_model_name=settings.serving.served_model_name, context_length=settings.cloud.cloud_context_length,
            lora_rank=settings.training.lora_rank, seed=settings.seed, persist_every=settings.cloud.tinker_persist_every,
            retry=RetryPolicy(attempts=settings.cloud.cloud_attempts, timeout_s=settings.cloud.cloud_timeout_s),
            meter=CostMeter.for_platform("tinker", settings.budget_usd, Path(settings.data_dir) / "costs.json"),
            state_index=Path(settings.data_dir) / "tinker_states.json",
        )

    @property
    def newest(self) -> int:
        return self._version

    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            if self._training is None:
                raise BackendError("the Tinker tokenizer is known after start()")
            self._tokenizer = self._training.get_tokenizer()
        return self._tokenizer

    async def start(self) -> None:
        self._training = await call(
            "tinker create_lora_training_client",
            lambda: self.service.create_lora_training_client(self.base_model, rank=self.lora_rank, seed=self.seed),
            self.retry,
        )
        self._samplers.put(0, await call(
            "tinker create_sampling_client(base)",
            lambda: self.service.create_sampling_client(base_model=self.base_model), self.retry,
        ))
        await self._save_state(version_state(0), 0)  # the fresh adapter: v0's, for rollback(0)
        log.info("tinker: LoRA rank %d on %s ready", self.lora_rank, self.base_model)

    async def _sampler(self, version: int) -> Any:
        """The sampling client of published `version`, opened again if it was dropped."""
        return await self._samplers.of(version, self._version, self._open, (self.version,))

    async def _open(self, version: int) -> Any:
        """A sampling client on vK's weights: its persisted sampler weights where there are any,
        else its training state loaded into a training client of its own (dropped after)."""
        path = self._states.path_of(sampler_state(version))
        if path is not None:
            return await call("tinker create_sampling_client",
                              lambda: self.service.create_sampling_client(model_path=path), self.retry)
        state = self._states.path_of(version_state(version))
        if state is None:
            raise UnknownVersion(version, self._version, f"policy@v{version} is no longer served: neither its "
                                                         "sampler weights nor its training state were kept")
        client = await call("tinker create_training_client_from_state",
                            lambda: self.service.create_training_client_from_state(state), self.retry)
        log.info("tinker: policy@v%d opened again from its training state", version)
        return await call("tinker save_weights_and_get_sampling_client",
                          lambda: client.save_weights_and_get_sampling_client(), self.retry)

    async def sample(  # `priority`: ignored, Tinker's sampling client takes none
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None,
        priority: Priority = "user",
    ) -> list[Completion]:
        from tinker import types

        check_context(len(prompt_ids), params.max_tokens, self.context_length)
        v = self.route(version)
        sampler = await self._sampler(v)
        eos = getattr(self._tokenizer, "eos_token_id", None)
        sp = types.SamplingParams(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, seed=params.seed, stop=stop_list(params, eos),
        )
        prompt = types.ModelInput.from_ints(list(prompt_ids))
        resp = await call(
            "tinker sample",
            lambda: sampler.sample(prompt=prompt, num_samples=n, sampling_params=sp,
                                   topk_sample_logprobs=params.top_logprobs),
            self.retry,
        )
        out = [_completion(seq, v, params.top_logprobs) for seq in resp.sequences]
        self.meter.record("serve", Usage(prefill_tokens=len(prompt_ids), sampled_tokens=sum(len(c.tokens) for c in out)))
        if params.temperature == 0.0:  # greedy: record logprobs under temperature 1 (the protocol's)
            out = [await self._rescored(sampler, prompt_ids, c) for c in out]
        return out

    async def _rescored(self, sampler: Any, prompt_ids: Sequence[int], c: Completion) -> Completion:
        if not c.tokens:
            return c
        lps = await self._logprobs(sampler, prompt_ids, c.tokens)
        return replace(c, logprobs=tuple(lps))

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None, priority: Priority = "user",
    ) -> AsyncIterator[TokenChunk]:
        # Tinker answers whole completions: one chunk.
        (c,) = await self.sample(prompt_ids, params, n=1, version=version)
        yield c.as_chunk()

    async def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
        model: ScoreModel = "policy", temperature: float = 1.0, version: int | None = None,
    ) -> list[float]:
        """On the sampling client of `version` (None: the newest; "base": v0's)."""
        if temperature != 1.0:
            raise BackendError(TEMPERATURE_ONE.format(platform="Tinker"))
        if not prompt_ids or not completion_ids:
            raise BackendError("score needs a non-empty prompt and completion")
        v = 0 if model == "base" else self._version if version is None else version
        return await self._logprobs(await self._sampler(v), prompt_ids, completion_ids)

    async def _logprobs(self, sampler: Any, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        from tinker import types

        full = types.ModelInput.from_ints([*prompt_ids, *completion_ids])
        k = len(completion_ids)
        lps = await call(
            "tinker compute_logprobs",
            lambda: sampler.compute_logprobs(full, prompt_logprobs_last_n=k), self.retry,
        )
        self.meter.record("score", Usage(prefill_tokens=len(prompt_ids) + k))
        return completion_tail(lps, k, "Tinker")

    def untrainable(self, datum: Datum) -> str | None:
        return temperature_reason(datum, "Tinker")

    async def train_step(
        self, batch: Sequence[Datum], loss: LossSpec = LossSpec(), optim: OptimSpec = OptimSpec()
    ) -> StepMetrics:
        from tinker import types

        self.meter.check_training()
        if loss.kl_coef:
            raise BackendError("kl_coef > 0 is not supported on Tinker's built-in ppo loss")
        if loss.topk:
            raise BackendError("top-k distillation (opd_topk > 0) needs the teacher's logits inside the loss; "
                               "Tinker's built-in ppo loss cannot take them")
        check_batch(batch, "Tinker")
        self._clean = None  # from here on the client is no longer the state it last saved
        started = time.monotonic()
        scale = sum_loss_scale(batch)
        data = [platform_datum(d, scale, types) for d in batch]
        config = {"clip_low_threshold": 1.0 - loss.clip_low, "clip_high_threshold": 1.0 + loss.clip_high}
        # forward_backward and optim_step are retried separately: a failed forward_backward has
        # accumulated nothing, and a failed optim_step leaves the gradients in place.
        fb = await call("tinker forward_backward",
                        lambda: self._training.forward_backward(data, "ppo", loss_fn_config=config), self.retry)
        adam = types.AdamParams(
            learning_rate=optim.learning_rate, beta1=optim.beta1, beta2=optim.beta2, eps=optim.eps,
            weight_decay=optim.weight_decay, grad_clip_norm=optim.grad_clip_norm,
        )
        step = await call("tinker optim_step", lambda: self._training.optim_step(adam), self.retry)
        new = [completion_logprobs(d, out["logprobs"].data) for d, out in zip(batch, fb.loss_fn_outputs, strict=True)]
        grad_norm = float((step.metrics or {}).get("grad_norm", math.nan))
        trained = sum(len(d.prompt_ids) + len(d.completion_ids) for d in batch)
        usd = self.meter.record("train", Usage(trained_tokens=trained))
        return step_metrics(batch, new, loss, time.monotonic() - started, grad_norm,
                            {"usd": usd, "spent_usd": self.meter.spent_usd, "advantage_scale": scale})

    async def publish(self) -> PolicyVersion:
        v = self._version + 1
        # A version published by an earlier process but never recorded (killed in between) keeps
        # its number and its saved state: this one takes the next free number.
        while self._states.path_of(version_state(v)) is not None:
            v += 1
        # both read the weights after the last optim_step; submitted together, awaited together
        sampler, _ = await asyncio.gather(
            call("tinker save_weights_and_get_sampling_client",
                 lambda: self._training.save_weights_and_get_sampling_client(), self.retry),
            self._save_state(version_state(v), v),
        )
        path: str | None = None
        if self.persist_every and v % self.persist_every == 0:
            saved = await call("tinker save_weights_for_sampler",
                               lambda: self._training.save_weights_for_sampler(f"policy-v{v}"), self.retry)
            path = saved.path
            self._states.put(sampler_state(v), saved.path, v)  # v's sampler can be opened again from it
        self._version = v  # requests admitted from now on get v; older ones keep their sampler
        self._samplers.put(v, sampler, spare=(self.version,))
        return PolicyVersion(v, path)

    async def rollback(self, version: int) -> PolicyVersion:
        """vK's training state into a new training client (weights only: a fresh optimizer),
        published as the next version."""
        path = state_path(self._states, version, self._version)
        self._training = await call(
            "tinker create_training_client_from_state",
            lambda: self.service.create_training_client_from_state(path), self.retry,
        )
        self._clean = None
        published = await self.publish()
        log.info("tinker: policy@v%d is a rollback to policy@v%d", published.version, version)
        return published

    async def save_state(self, name: str) -> str:
        """`overwrite`: a lineage is saved under its one name each time it is left, by the one
        training client it keeps."""
        return await self._save_state(name, self._version, overwrite=True)

    async def restore(self, version: int, path: str | None) -> None:
        """After a restart: train on from `version` and serve it. Every publish saved the
        training state of its version (`policy-vK`, weights and Adam's moments), so Tinker
        resumes it exactly, optimizer state included, whatever the checkpoint cadence."""
        if version == 0:
            return
        state = self._states.path_of(version_state(version))
        if state is None:
            raise UnknownVersion(version, self._version, f"policy@v{version} has no saved training state")
        self._training = await call(
            "tinker create_training_client_from_state_with_optimizer",
            lambda: self.service.create_training_client_from_state_with_optimizer(state), self.retry,
        )
        self._clean = state
        self._samplers.put(version, await call("tinker save_weights_and_get_sampling_client",
                                               lambda: self._training.save_weights_and_get_sampling_client(), self.retry))
        if path is not None:
            self._states.put(sampler_state(version), path, version)
        self._version = version

    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Train another lineage (`protocol.Lineages`) in a training client of its own: its state
        (`save_state`'s name or path: weights and Adam's moments), or published `version`'s
        weights (its `policy-vK` state, weights only; v0: a new LoRA run) with a fresh optimizer.
        The client left is kept while it is exactly the state last saved of it, so switching back
        to that state costs no call. What serves, and the versions' numbering, stay as they are."""
        where: str | None = None
        if state is not None:
            where, _ = self._states.get(state)
            if where == self._clean:
                return  # the training client is that state already
            client = self._parked.pop(where, None)
            if client is None:
                client = await call("tinker create_training_client_from_state_with_optimizer",
                                    lambda: self.service.create_training_client_from_state_with_optimizer(where),
                                    self.retry)
        elif version == 0:
            client = await call(
                "tinker create_lora_training_client",
                lambda: self.service.create_lora_training_client(self.base_model, rank=self.lora_rank, seed=self.seed),
                self.retry)
        else:
            source = state_path(self._states, version, self._version)
            client = await call("tinker create_training_client_from_state",
                                lambda: self.service.create_training_client_from_state(source), self.retry)
            if path is not None:
                self._states.put(sampler_state(version), path, version)
        if self._clean is not None:
            self._parked[self._clean] = self._training
            for old in list(self._parked)[:-KEEP_LINEAGES]:
                del self._parked[old]
        self._training, self._clean = client, where

    async def _save_state(self, name: str, version: int, *, overwrite: bool = False) -> str:
        """A training state under `name`, indexed with the version whose weights it holds."""
        saved = await call(f"tinker save_state({name})",
                           lambda: self._training.save_state(name, overwrite=overwrite), self.retry)
        self._states.put(name, str(saved.path), version)
        self._parked.pop(str(saved.path), None)  # a client kept for this path is no longer what it holds
        self._clean = str(saved.path)
        return str(saved.path)

    async def load_state(self, name: str) -> None:
        """Resume from a name saved by this or an earlier process (the index in the data
        directory remembers its tinker:// path and version), or from a tinker:// path."""
        path, version = self._states.get(name)
        self._training = await call(
            "tinker create_training_client_from_state_with_optimizer",
            lambda: self.service.create_training_client_from_state_with_optimizer(path), self.retry,
        )
        # The saved version serves the resumed weights again.
        self._clean = path
        sampler = await call("tinker save_weights_and_get_sampling_client",
                             lambda: self._training.save_weights_and_get_sampling_client(), self.retry)
        self._version = max(version, 1) if version is not None else max(self._version, 1)
        self._samplers.put(self._version, sampler)

    async def close(self) -> None:
        close = getattr(self.service, "close", None)
        if callable(close):
            close()


def _completion(seq: Any, version: int, top_k: int) -> Completion:
    tokens = tuple(int(t) for t in seq.tokens)
    logprobs = seq.logprobs
    if logprobs is None or len(logprobs) != len(tokens):
        raise BackendError("Tinker returned a completion without per-token logprobs")
    top = None
    if top_k and seq.topk_logprobs is not None:
        top = tuple(tuple(TokenLogprob(int(i), float(lp)) for i, lp in (row or ())) for row in seq.topk_logprobs)
    reason: Literal["stop", "length"] = "stop" if seq.stop_reason == "stop" else "length"
    return Completion(tokens, tuple(float(x) for x in logprobs), reason, version, top)


def from_settings(settings: Settings) -> Any:
    """What `clawbridge up --backend tinker` calls (`clawbridge.server.build_backend`): the
    backend behind the redaction hook unless `--no-redact`."""
    from clawbridge.backends.redact import protect

    return protect(TinkerBackend.from_settings(settings), settings.judging.redact)
