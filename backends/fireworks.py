"""The Fireworks backend (fireworks-ai 1.2.28, `fireworks.training.sdk`, its own types).

The training SDK is Tinker-shaped, so the data and metrics are the Tinker backend's
(`platform_datum`, `step_metrics`); what differs:

- the loss is normalised by the server: `optim_step(...,
  grad_accumulation_normalization=GradAccNormalization.NUM_LOSS_TOKENS)` divides the summed
  PPO gradient by the number of loss tokens, so advantages go unscaled and the gradient is the
  token mean of `clawbridge.loss.ppo_loss` (loss tokens = completion tokens: prompt positions
  carry zero advantage);
- teacher / policy logprobs come from `training_client.forward(data, "cross_entropy")`, the base
  model's from a frozen `create_base_training_client`;
- two modes. `serverless`: each published version is a sampler snapshot
  (`save_weights_for_sampler` + `create_sampling_client(model_path=...)`), older versions keep
  serving. `dedicated`: one inference deployment serves the policy; `publish` is
  `WeightSyncer.save_and_hotload`, and while the adapter loads the deployment answers HTTP 425:
  sampling waits and retries, the user's request never fails for it.
- `rollback(K)`: sampler snapshots are not trainer checkpoints, so every version also keeps a
  DCP checkpoint (`save_state("policy-vK")`, v0's at start); rollback is `load_state(path)`
  (weights only: a fresh optimizer) and a publish. On a deployment the delta chain is reset
  first, so the rolled-back weights hot-load as a full `base` checkpoint, not as a delta
  against a snapshot they do not descend from.
- `score(version=K)`: `forward` on the training client while its weights are vK's (as right
  after a publish), else on vK's sampler snapshot (`compute_logprobs`, serverless), v0 on the
  frozen base client. Snapshots stay in the index, so a dropped or earlier process's version's
  sampling client is opened again (`create_sampling_client(model_path=...)`).
- `switch` (several users' adapters, `protocol.Lineages`, serverless only: a deployment serves
  one adapter): the one training client, whose weights and optimizer become the lineage's:
  `load_state_with_optimizer(state)`, or a published version's checkpoint with `load_state`.

The serverless constructor connects at once, so the backend takes a `connect` callable and
calls it in `start()`; tests pass the offline fake (tests/fakes/fake_fireworks.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.backends.costs import CostMeter, Usage
from clawbridge.backends.fireworks_sdk import NO_TRAINING_ACCESS, connector, dedicated_parts
from clawbridge.backends.remote import PermanentBackendError, RetryPolicy, call, status_of
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
    scoring_datum,
    state_path,
    step_metrics,
    stop_list,
    temperature_reason,
    version_state,
)
from clawbridge.protocol import (
    BackendError,
    Priority,
    Routing,
    ScoreModel,
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
    from clawbridge.config import Settings
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
Mode = Literal["serverless", "dedicated"]


def _types() -> Any:
    from fireworks.training.sdk import types

    return types


class FireworksBackend(Routing):
    name = "fireworks"

    def __init__(
        self,
        *,
        connect: Callable[[], Any],
        base_model: str,
        mode: Mode = "serverless",
        tokenizer: PreTrainedTokenizerBase | None = None,
        served_model_name: str | None = None,
        context_length: int = 32768,
        lora_rank: int = 32,
        deployment_sampler: Any = None,
        weight_syncer: Callable[[Any], Any] | None = None,
        retry: RetryPolicy = RetryPolicy(),
        hotload_patience_s: float = 900.0,
        meter: CostMeter | None = None,
        state_index: Path | None = None,
    ) -> None:
        if mode == "dedicated" and (deployment_sampler is None or weight_syncer is None):
            raise BackendError("dedicated mode needs a deployment sampler and a weight syncer")
        self._connect = connect
        self.base_model = base_model
        self.mode = mode
        self.model_name = served_model_name or base_model
        self.context_length = context_length
        self.lora_rank = lora_rank
        self.retry = retry
        self.meter = meter or CostMeter.for_platform("fireworks" if mode == "serverless" else "fireworks-dedicated")
        self._tokenizer = tokenizer
        self._deployment = deployment_sampler
        self._make_syncer = weight_syncer
        self._syncer: Any = None
        # 425 means "the adapter is loading": wait as long as a hot-load takes, not 5 attempts.
        self._hotload_retry = replace(retry, attempts=max(retry.attempts, int(hotload_patience_s / retry.max_s) + 1))
        self.service: Any = None
        self._training: Any = None
        self._base: Any = None
        self._samplers = Samplers()
        self._states = StateIndex(state_index)
        self._version = 0
        self._trained_as: int | None = 0  # the version whose weights the trainer holds, if one's

    @classmethod
    def from_settings(
        cls, settings: Settings, client: Any = None, tokenizer: PreTrainedTokenizerBase | None = None,
        **dedicated: Any,
    ) -> FireworksBackend:
        """`client`: a ready service client (or the fake). Without one, a
        `FiretitanServiceClient` is built from FIREWORKS_API_KEY at `start()`. Dedicated mode
        also takes `deployment_sampler=` and `weight_syncer=` (a function of the training client)
        or builds them from `fireworks_deployment_id`."""
        if client is None:
            require_credentials("fireworks")
        connect = (lambda: client) if client is not None else connector(settings)
        if settings.cloud.fireworks_mode == "dedicated" and not dedicated:
            dedicated = dedicated_parts(settings)
        return cls(
            connect=connect, base_model=settings.cloud.fireworks_base_model, mode=settings.cloud.fireworks_mode,
            tokenizer=tokenizer, served_model_name=settings.serving.served_model_name,
            context_length=settings.cloud.cloud_context_length, lora_rank=settings.training.lora_rank,
            retry=RetryPolicy(attempts=settings.cloud.cloud_attempts, timeout_s=settings.cloud.cloud_timeout_s),
            meter=CostMeter.for_platform(
                "fireworks" if settings.cloud.fireworks_mode == "serverless" else "fireworks-dedicated",
                settings.budget_usd, Path(settings.data_dir) / "costs.json",
            ),
            state_index=Path(settings.data_dir) / "fireworks_states.json",
            **dedicated,
        )

    @property
    def newest(self) -> int:
        return self._version

    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            if self._training is None:
                raise BackendError("the Fireworks tokenizer is known after start()")
            self._tokenizer = self._training.get_tokenizer()
        return self._tokenizer

    async def _blocking(self, what: str, fn: Callable[[], Any], policy: RetryPolicy | None = None) -> Any:
        """SDK calls that block (client creation, hot-load) run in a thread."""
        return await call(what, lambda: asyncio.to_thread(fn), policy or self.retry)

    async def start(self) -> None:
        try:
            self.service = await self._blocking("fireworks connect", self._connect)
            self._training = await self._blocking(
                "fireworks create_lora_training_client",
                lambda: self.service.create_lora_training_client(self.base_model, rank=self.lora_rank),
            )
        except PermanentBackendError as e:
            status = status_of(e.__cause__) if e.__cause__ else None
            if status in (401, 403):
                raise PermanentBackendError(NO_TRAINING_ACCESS.format(status=status)) from e
            raise
        if self.mode == "serverless":
            self._samplers.put(0, await self._blocking(
                "fireworks create_sampling_client(base)",
                lambda: self.service.create_sampling_client(base_model=self.base_model),
            ))
        else:
            assert self._make_syncer is not None
            self._syncer = self._make_syncer(self._training)
        await self._save_state(version_state(0), 0)  # the fresh adapter: v0's, for rollback(0)
        log.info("fireworks (%s): LoRA rank %d on %s ready", self.mode, self.lora_rank, self.base_model)

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None,
        priority: Priority = "user",
    ) -> list[Completion]:
        """`priority` is accepted and ignored: neither the training SDK's sampler nor a
        deployment's takes one."""
        check_context(len(prompt_ids), params.max_tokens, self.context_length)
        if self.mode == "dedicated":
            out = await self._sample_deployment(prompt_ids, params, n)
        else:
            out = await self._sample_serverless(prompt_ids, params, n, version)
        self.meter.record("serve", Usage(prefill_tokens=len(prompt_ids), sampled_tokens=sum(len(c.tokens) for c in out)))
        if params.temperature == 0.0:  # greedy: record logprobs under temperature 1 (the protocol's)
            out = [replace(c, logprobs=tuple(await self.score(prompt_ids, c.tokens))) if c.tokens else c for c in out]
        return out

    async def _sample_serverless(self, prompt_ids: Sequence[int], params: SamplingParams, n: int, version: int | None) -> list[Completion]:
        types = _types()
        v = self.route(version)
        sampler = await self._samplers.of(v, self._version, self._open, (self.version,))
        sp = types.SamplingParams(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, seed=params.seed,
            stop=stop_list(params, getattr(self._tokenizer, "eos_token_id", None)),
        )
        prompt = types.ModelInput.from_ints(list(prompt_ids))
        resp = await call("fireworks sample", lambda: sampler.sample(prompt, n, sp), self.retry)
        out = []
        for seq in resp.sequences:
            if seq.logprobs is None:
                raise BackendError("Fireworks returned a completion without logprobs")
            reason: Literal["stop", "length"] = "stop" if seq.stop_reason == "stop" else "length"
            out.append(Completion(tuple(int(t) for t in seq.tokens), tuple(float(x) for x in seq.logprobs), reason, v))
        return out

    async def _open(self, version: int) -> Any:
        """A sampling client on vK's snapshot again (serverless): the index keeps every one."""
        path = self._states.path_of(sampler_state(version))
        if path is None:
            raise UnknownVersion(version, self._version, f"policy@v{version} is no longer served: its sampler "
                                                         "snapshot is not known")
        return await self._blocking("fireworks create_sampling_client",
                                    lambda: self.service.create_sampling_client(model_path=path))

    async def _sample_deployment(self, prompt_ids: Sequence[int], params: SamplingParams, n: int) -> list[Completion]:
        stop = stop_list(params, getattr(self._tokenizer, "eos_token_id", None))
        extra: dict[str, Any] = {"logprobs": True, "top_p": params.top_p, "top_k": max(params.top_k, 0)}
        if params.seed is not None:
            extra["seed"] = params.seed
        completions = await call(
            "fireworks deployment sample",
            lambda: self._deployment.sample_with_prompt_tokens(
                list(prompt_ids), n=n, max_tokens=params.max_tokens, temperature=params.temperature,
                stop=stop, **extra,
            ),
            self._hotload_retry,
        )
        v = self._version  # one adapter is live at a time on a deployment
        out = []
        for c in completions:
            tokens = tuple(int(t) for t in c.full_tokens[c.prompt_len :])
            lps = c.sampling_logprobs or c.inference_logprobs
            if lps is None or len(lps) != len(tokens) or any(x is None for x in lps):
                raise BackendError("the Fireworks deployment returned no sampling logprobs")
            reason: Literal["stop", "length"] = "length" if c.finish_reason == "length" else "stop"
            out.append(Completion(tokens, tuple(float(x) for x in lps), reason, v))
        return out

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None,
        priority: Priority = "user",
    ) -> AsyncIterator[TokenChunk]:
        (c,) = await self.sample(prompt_ids, params, n=1, version=version)
        yield c.as_chunk()

    async def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
        model: ScoreModel = "policy", temperature: float = 1.0, version: int | None = None,
    ) -> list[float]:
        """The trainer's `forward` where it holds `version`'s weights (None: the newest) or the
        base's; else `version`'s sampler snapshot."""
        if temperature != 1.0:
            raise BackendError(TEMPERATURE_ONE.format(platform="Fireworks"))
        if not prompt_ids or not completion_ids:
            raise BackendError("score needs a non-empty prompt and completion")
        v = 0 if model == "base" else self._version if version is None else version
        require_published(v, self._version)
        client = self._training
        if v != self._trained_as and v != 0:
            return await self._snapshot_logprobs(v, prompt_ids, completion_ids)
        if v != self._trained_as:
            if self._base is None:
                self._base = await self._blocking(
                    "fireworks create_base_training_client",
                    lambda: self.service.create_base_training_client(self.base_model),
                )
            client = self._base
        datum = scoring_datum(prompt_ids, completion_ids, _types())
        out = await call("fireworks forward", lambda: client.forward([datum], "cross_entropy"), self.retry)
        self.meter.record("score", Usage(prefill_tokens=len(prompt_ids) + len(completion_ids)))
        return [float(x) for x in out.loss_fn_outputs[0]["logprobs"].data[len(prompt_ids) - 1 :]]

    async def _snapshot_logprobs(self, version: int, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """Scores on vK's sampler snapshot, for a version the trainer no longer holds."""
        if self.mode == "dedicated":
            raise BackendError(f"policy@v{version} can no longer be scored: a dedicated deployment keeps one "
                               "adapter, and the trainer holds other weights now")
        sampler = await self._samplers.of(version, self._version, self._open, (self.version,))
        full = _types().ModelInput.from_ints([*prompt_ids, *completion_ids])

        def submit() -> Any:
            with warnings.catch_warnings():  # the SDK prefers forward(); no trainer holds these weights
                warnings.simplefilter("ignore", UserWarning)
                return sampler.compute_logprobs(full)

        lps = await call("fireworks compute_logprobs", submit, self.retry)
        self.meter.record("score", Usage(prefill_tokens=len(prompt_ids) + len(completion_ids)))
        return completion_tail(lps, len(completion_ids), "Fireworks")

    def untrainable(self, datum: Datum) -> str | None:
        return temperature_reason(datum, "Fireworks")

    async def train_step(
        self, batch: Sequence[Datum], loss: LossSpec = LossSpec(), optim: OptimSpec = OptimSpec()
    ) -> StepMetrics:
        from fireworks.training.sdk import GradAccNormalization

        types = _types()
        self.meter.check_training()
        if loss.kl_coef:
            raise BackendError("kl_coef > 0 is not supported on Fireworks' built-in ppo loss")
        if loss.topk:
            raise BackendError("top-k distillation (opd_topk > 0) needs the teacher's logits inside the loss; "
                               "Fireworks' built-in ppo loss cannot take them")
        check_batch(batch, "Fireworks")
        self._trained_as = None  # from here on the weights are no published version's
        started = time.monotonic()
        data = [platform_datum(d, 1.0, types) for d in batch]  # the server divides by loss tokens
        config = {"clip_low_threshold": 1.0 - loss.clip_low, "clip_high_threshold": 1.0 + loss.clip_high}
        fb = await call("fireworks forward_backward",
                        lambda: self._training.forward_backward(data, "ppo", loss_fn_config=config), self.retry)
        adam = types.AdamParams(
            learning_rate=optim.learning_rate, beta1=optim.beta1, beta2=optim.beta2, eps=optim.eps,
            weight_decay=optim.weight_decay, grad_clip_norm=optim.grad_clip_norm,
        )
        step = await call(
            "fireworks optim_step",
            lambda: self._training.optim_step(adam, grad_accumulation_normalization=GradAccNormalization.NUM_LOSS_TOKENS),
            self.retry,
        )
        new = [completion_logprobs(d, out["logprobs"].data) for d, out in zip(batch, fb.loss_fn_outputs, strict=True)]
        grad_norm = float((getattr(step, "metrics", None) or {}).get("grad_norm", math.nan))
        trained = sum(len(d.prompt_ids) + len(d.completion_ids) for d in batch)
        usd = self.meter.record("train", Usage(trained_tokens=trained))
        return step_metrics(batch, new, loss, time.monotonic() - started, grad_norm,
                            {"usd": usd, "spent_usd": self.meter.spent_usd})

    async def publish(self) -> PolicyVersion:
        v = self._version + 1
        # A version published by an earlier process but never recorded (killed in between) keeps
        # its number and its checkpoint: this one takes the next free number.
        while self._states.path_of(version_state(v)) is not None:
            v += 1
        name = version_state(v)
        await self._save_state(name, v)  # a DCP checkpoint of the weights about to be served
        if self.mode == "dedicated":
            snapshot = await self._blocking("fireworks save_and_hotload", lambda: self._syncer.save_and_hotload(name))
            if snapshot is None:
                raise BackendError(f"fireworks: hot-load of {name} failed; still serving policy@v{self._version}")
            self._version, self._trained_as = v, v
            return PolicyVersion(v, str(snapshot))
        saved = await call("fireworks save_weights_for_sampler",
                           lambda: self._training.save_weights_for_sampler(name), self.retry)
        sampler = await self._blocking(
            "fireworks create_sampling_client",
            lambda: self.service.create_sampling_client(model_path=saved.path),
        )
        self._states.put(sampler_state(v), saved.path, v)
        self._version, self._trained_as = v, v
        self._samplers.put(v, sampler, spare=(self.version,))
        return PolicyVersion(v, saved.path)

    async def rollback(self, version: int) -> PolicyVersion:
        """vK's checkpoint into the training session (weights only: a fresh optimizer),
        published as the next version."""
        path = state_path(self._states, version, self._version)
        await call("fireworks load_state", lambda: self._training.load_state(path), self.retry)
        self._trained_as = version
        if self._syncer is not None:
            self._syncer.reset_delta_chain()
        published = await self.publish()
        log.info("fireworks: policy@v%d is a rollback to policy@v%d", published.version, version)
        return published

    async def save_state(self, name: str) -> str:
        return await self._save_state(name, self._version)

    async def _save_state(self, name: str, version: int) -> str:
        """A training state under `name`, indexed with the version whose weights it holds."""
        saved = await call(f"fireworks save_state({name})", lambda: self._training.save_state(name), self.retry)
        self._states.put(name, str(saved.path), version)
        return str(saved.path)

    async def load_state(self, name: str) -> None:
        """Resume from a name saved by this or an earlier process, or from a checkpoint path;
        the saved version serves the resumed weights again (under its own number)."""
        path, version = self._states.get(name)
        await call("fireworks load_state_with_optimizer",
                   lambda: self._training.load_state_with_optimizer(path), self.retry)
        self._trained_as = None
        if version:
            await self._serve_again(version)

    async def restore(self, version: int, path: str | None) -> None:
        """After a restart: train on from `version` and serve it. Every publish saved a
        checkpoint of its version (`policy-vK`, with the optimizer state), so Fireworks resumes
        it exactly, whatever the checkpoint cadence."""
        if version == 0:
            return
        state = self._states.path_of(version_state(version))
        if state is None:
            raise UnknownVersion(version, self._version, f"policy@v{version} has no saved training state")
        await call("fireworks load_state_with_optimizer",
                   lambda: self._training.load_state_with_optimizer(state), self.retry)
        await self._serve_again(version)

    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Train another lineage (`protocol.Lineages`) in the one training client: its state
        (`save_state`'s name or path: weights and optimizer) or published `version`'s checkpoint
        (`policy-vK`, weights only: a fresh optimizer; v0's is the fresh adapter). `path` is not
        needed: every version's checkpoint is in the index. What serves, and the versions'
        numbering, stay as they are. Serverless only: a dedicated deployment serves one adapter."""
        if self.mode == "dedicated":
            raise BackendError("a dedicated Fireworks deployment serves one adapter at a time: several users' "
                               "adapters need fireworks_mode=serverless")
        if state is not None:
            where, _ = self._states.get(state)
            await call("fireworks load_state_with_optimizer",
                       lambda: self._training.load_state_with_optimizer(where), self.retry)
            self._trained_as = None
        else:
            source = state_path(self._states, version, self._version)
            await call("fireworks load_state", lambda: self._training.load_state(source), self.retry)
            self._trained_as = version

    async def _serve_again(self, version: int) -> None:
        """Serve the training session's weights as `version` again, writing over nothing: the
        sampler weights (or the deployment's snapshot) get a name of their own."""
        name = f"{version_state(version)}-resumed-{int(time.time())}"
        if self.mode == "dedicated":
            self._syncer.reset_delta_chain()
            if await self._blocking("fireworks save_and_hotload", lambda: self._syncer.save_and_hotload(name)) is None:
                raise BackendError(f"fireworks: hot-load of {name} failed")
        else:
            saved = await call("fireworks save_weights_for_sampler",
                               lambda: self._training.save_weights_for_sampler(name), self.retry)
            self._samplers.put(version, await self._blocking(
                "fireworks create_sampling_client",
                lambda: self.service.create_sampling_client(model_path=saved.path),
            ))
            if self._states.path_of(sampler_state(version)) is None:  # the index is append-only
                self._states.put(sampler_state(version), saved.path, version)
        self._version, self._trained_as = version, version

    async def close(self) -> None:
        for sampler in self._samplers.values():
            close = getattr(sampler, "close", None)
            if callable(close):
                await asyncio.to_thread(close)
        close = getattr(self.service, "close", None)
        if callable(close):
            await asyncio.to_thread(close)


def from_settings(settings: Settings) -> Any:
    """What `clawbridge up --backend fireworks` calls (`clawbridge.server.build_backend`): the
    backend behind the redaction hook unless `--no-redact`."""
    from clawbridge.backends.redact import protect

    return protect(FireworksBackend.from_settings(settings), settings.judging.redact)
