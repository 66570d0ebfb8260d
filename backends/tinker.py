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

Version 0 is the base model's sampling client: the judge samples there (`sample(version=0)`).
The SDK is imported lazily, and nothing touches the network before `start()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from clawbridge.backends.costs import CostMeter, Usage
from clawbridge.backends.remote import RetryPolicy, call
from clawbridge.loss import batch_tokens, ppo_token_losses, sum_loss_scale
from clawbridge.protocol import (
    BackendError,
    ContextLengthExceeded,
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
    TokenLogprob,
)

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
KEEP_VERSIONS = 4  # sampling clients kept for requests admitted on older versions


# --- pure helpers shared with the Fireworks backend (same Tinker-shaped data) -----------------


def platform_datum(d: Datum, scale: float, types: Any) -> Any:
    """Our Datum as a Tinker-shaped Datum: model_input = full[:-1], targets = full[1:],
    sampling logprobs and (scaled) advantages on completion positions, zeros on the prompt."""
    full = [*d.prompt_ids, *d.completion_ids]
    pad = len(d.prompt_ids) - 1
    n = len(full) - 1

    def tensor(values: Sequence[float], dtype: str) -> Any:
        return types.TensorData(data=list(values), dtype=dtype, shape=[n])

    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": tensor(full[1:], "int64"),
            "logprobs": tensor([0.0] * pad + [float(x) for x in d.logprobs], "float32"),
            "advantages": tensor([0.0] * pad + [a * scale for a in d.advantages], "float32"),
        },
    )


def completion_logprobs(d: Datum, output_logprobs: Sequence[float]) -> list[float]:
    """The completion part of a datum's per-position target logprobs."""
    return [float(x) for x in output_logprobs[len(d.prompt_ids) - 1 :]]


def step_metrics(
    batch: Sequence[Datum], new_logprobs: Sequence[Sequence[float]], spec: LossSpec,
    seconds: float, grad_norm: float, extra: dict[str, float] | None = None,
) -> StepMetrics:
    """Loss, clip fraction and approximate KL of the step, from the logprobs the platform
    computed in the forward pass (before the update), with the reference loss terms."""
    new = torch.tensor([x for lp in new_logprobs for x in lp], dtype=torch.float64)
    old = torch.tensor([x for d in batch for x in d.logprobs], dtype=torch.float64)
    adv = torch.tensor([x for d in batch for x in d.advantages], dtype=torch.float64)
    mask = torch.ones_like(new)
    terms = ppo_token_losses(new, old, adv, mask, LossSpec(spec.clip_low, spec.clip_high))
    n = max(len(new), 1)
    return StepMetrics(
        loss=float(terms.loss.sum()) / n, clip_fraction=float(terms.clipped.sum()) / n,
        approx_kl=float(terms.approx_kl.sum()) / n, grad_norm=grad_norm,
        tokens=batch_tokens(batch), samples=len(batch), seconds=seconds, extra=extra or {},
    )


def stop_list(params: SamplingParams, eos_id: int | None) -> list[str] | list[int] | None:
    """Tinker's `stop` takes strings or token ids, not both. Token ids replace the default stop
    set, so the EOS id is added back."""
    if params.stop_token_ids:
        ids = list(params.stop_token_ids)
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        return ids
    return list(params.stop) if params.stop else None


TEMPERATURE_ONE = (
    "{platform} computes training and scoring logprobs at temperature 1 only (its losses see "
    "target logprobs, not logits): sample with temperature 1 (the default) to train on {platform}, "
    "or use --backend local|modal for tempered sampling"
)


def temperature_reason(datum: Datum, platform: str) -> str | None:
    """Why `datum` cannot be trained on a platform whose losses see temperature-1 logprobs only
    (a greedy turn, stored at temperature 0, is one): the trainer drops it with this reason
    rather than retrying a batch that can never succeed."""
    if datum.temperature == 1.0:
        return None
    return (f"sampled at temperature {datum.temperature:g}: {platform} trains temperature-1 samples only "
            "(its loss sees target logprobs, not logits)")


def check_batch(batch: Sequence[Datum], platform: str) -> None:
    if not batch:
        raise BackendError("train_step needs at least one datum")
    if any(d.temperature != 1.0 for d in batch):
        raise BackendError(TEMPERATURE_ONE.format(platform=platform))


class StateIndex:
    """Saved-state names -> (platform path, policy version), in a JSON file of the data directory
    so a restarted process can `load_state(name)`; in memory when no file is given."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            self._entries = json.loads(path.read_text())

    def put(self, name: str, where: str, version: int) -> None:
        self._entries[name] = {"path": where, "version": version}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self._entries, indent=1))

    def path_of(self, name: str) -> str | None:
        entry = self._entries.get(name)
        return None if entry is None else str(entry["path"])

    def get(self, name: str) -> tuple[str, int | None]:
        if name in self._entries:
            return str(self._entries[name]["path"]), int(self._entries[name]["version"])
        if "://" in name or name.startswith(("accounts/", "gs://")):
            return name, None
        raise BackendError(f"no saved state named {name!r}: pass the path save_state returned")


def version_state(version: int) -> str:
    """The name of the training state kept with a published version, for `rollback`."""
    return f"policy-v{version}"


def rollback_path(states: StateIndex, version: int, newest: int) -> str:
    """Where the training state of `version` lives, or UnknownVersion."""
    require_published(version, newest)
    path = states.path_of(version_state(version))
    if path is None:
        raise UnknownVersion(version, newest, f"policy@v{version} has no saved training state to roll back to "
                                              "(it was published before rollback states were kept)")
    return path


def require_credentials(backend: str) -> None:
    """Fail at once, with the fix, when the platform's credentials are missing or malformed."""
    import os

    from clawbridge.backends import doctor

    checks = doctor.run_checks(os.environ, Path.home(), backend)
    if not doctor.ready(checks, backend):
        raise BackendError(f"{backend} is not ready:\n{doctor.report(checks)}")


def check_context(prompt_len: int, max_tokens: int, context_length: int) -> None:
    if prompt_len + max_tokens > context_length:
        raise ContextLengthExceeded(prompt_len, max_tokens, context_length)


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
        self._samplers: dict[int, Any] = {}
        self._paths: dict[int, str | None] = {0: None}
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
        self._samplers[0] = await call(
            "tinker create_sampling_client(base)",
            lambda: self.service.create_sampling_client(base_model=self.base_model), self.retry,
        )
        await self._save_state(version_state(0), 0)  # the fresh adapter: v0's, for rollback(0)
        log.info("tinker: LoRA rank %d on %s ready", self.lora_rank, self.base_model)

    def _sampler(self, version: int | None) -> tuple[int, Any]:
        v = self.route(version)
        if v not in self._samplers:
            raise BackendError(f"policy@v{v} is no longer served (kept: {sorted(self._samplers)})")
        return v, self._samplers[v]

    async def sample(  # `priority`: ignored, Tinker's sampling client takes none
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None,
        priority: Priority = "user",
    ) -> list[Completion]:
        from tinker import types

        check_context(len(prompt_ids), params.max_tokens, self.context_length)
        v, sampler = self._sampler(version)
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
            out = [await self._rescored(prompt_ids, c, v) for c in out]
        return out

    async def _rescored(self, prompt_ids: Sequence[int], c: Completion, version: int) -> Completion:
        if not c.tokens:
            return c
        lps = await self._logprobs(self._samplers[version], prompt_ids, c.tokens)
        return replace(c, logprobs=tuple(lps))

    async def sample_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None, priority: Priority = "user",
    ) -> AsyncIterator[TokenChunk]:
        # Tinker answers whole completions: one chunk.
        (c,) = await self.sample(prompt_ids, params, n=1, version=version)
        yield c.as_chunk()

    async def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
        model: ScoreModel = "policy", temperature: float = 1.0,
    ) -> list[float]:

        if temperature != 1.0:
            raise BackendError(TEMPERATURE_ONE.format(platform="Tinker"))
        if not prompt_ids or not completion_ids:
            raise BackendError("score needs a non-empty prompt and completion")
        _, sampler = self._sampler(0 if model == "base" else None)
        return await self._logprobs(sampler, prompt_ids, completion_ids)

    async def _logprobs(self, sampler: Any, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        from tinker import types

        full = types.ModelInput.from_ints([*prompt_ids, *completion_ids])
        k = len(completion_ids)
        lps = await call(
            "tinker compute_logprobs",
            lambda: sampler.compute_logprobs(full, prompt_logprobs_last_n=k), self.retry,
        )
        self.meter.record("score", Usage(prefill_tokens=len(prompt_ids) + k))
        tail = list(lps)[-k:]
        if any(x is None for x in tail):
            raise BackendError("Tinker returned no logprob for a completion token")
        return [float(x) for x in tail]

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
        self._samplers[v] = sampler
        self._paths[v] = path
        self._version = v  # requests admitted from now on get v; older ones keep their sampler
        for old in [k for k in self._samplers if 0 < k <= v - KEEP_VERSIONS]:
            del self._samplers[old]
        return PolicyVersion(v, path)

    async def rollback(self, version: int) -> PolicyVersion:
        """vK's training state into a new training client (weights only: a fresh optimizer),
        published as the next version."""
        path = rollback_path(self._states, version, self._version)
        self._training = await call(
            "tinker create_training_client_from_state",
            lambda: self.service.create_training_client_from_state(path), self.retry,
        )
        published = await self.publish()
        log.info("tinker: policy@v%d is a rollback to policy@v%d", published.version, version)
        return published

    async def save_state(self, name: str) -> str:
        return await self._save_state(name, self._version)

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
        self._samplers[version] = await call("tinker save_weights_and_get_sampling_client",
                                             lambda: self._training.save_weights_and_get_sampling_client(), self.retry)
        self._paths[version] = path
        self._version = version

    async def _save_state(self, name: str, version: int) -> str:
        """A training state under `name`, indexed with the version whose weights it holds."""
        saved = await call(f"tinker save_state({name})", lambda: self._training.save_state(name), self.retry)
        self._states.put(name, str(saved.path), version)
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
        sampler = await call("tinker save_weights_and_get_sampling_client",
                             lambda: self._training.save_weights_and_get_sampling_client(), self.retry)
        self._version = max(version, 1) if version is not None else max(self._version, 1)
        self._samplers[self._version] = sampler

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
