"""An offline Fireworks training SDK (fireworks-ai 1.2.28) at its boundary.

Method names of `FiretitanServiceClient`, `FiretitanTrainingClient`, `FiretitanSamplingClient`
(sample -> `concurrent.futures.Future`), `DeploymentSampler.sample_with_prompt_tokens` (->
`SampledCompletion`) and `WeightSyncer.save_and_hotload`, with Fireworks' own types
(`fireworks.training.sdk.types`) and exceptions. The server side is `TinyPlatform`: PPO summed
over tokens, and `optim_step(grad_accumulation_normalization="num_loss_tokens")` dividing the
accumulated gradient by the loss tokens. A dedicated deployment answers 425 (as the SDK reports
it after its own retries: `SamplingRequestError(final_status=425)`) while an adapter hot-loads.
"""

from __future__ import annotations

import itertools
import warnings
from concurrent.futures import Future
from typing import Any

import httpx
import numpy as np
from fireworks.training.sdk import GradAccNormalization, types
from fireworks.training.sdk._core import _exceptions as fx
from fireworks.training.sdk._core.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from fireworks.training.sdk.sampling import SampledCompletion
from fireworks.training.sdk.sampling_observability import SamplingRequestError

from .torch_platform import TinyPlatform

PPO_KEYS = {"target_tokens", "logprobs", "advantages"}
CE_KEYS = {"target_tokens", "weights"}


def status_error(status: int, message: str = "") -> fx.APIStatusError:
    request = httpx.Request("POST", "https://api.fireworks.fake/training/v1/x")
    response = httpx.Response(status, request=request)
    cls: type[fx.APIStatusError] = {
        400: fx.BadRequestError, 401: fx.AuthenticationError, 403: fx.PermissionDeniedError,
        409: fx.ConflictError, 429: fx.RateLimitError,
    }.get(status, fx.InternalServerError if status >= 500 else fx.APIStatusError)
    return cls(message or f"HTTP {status}", response=response, body=None)


class FakeSampler:
    """`FiretitanSamplingClient`: a sampler snapshot; `sample` answers a concurrent future."""

    def __init__(self, platform: TinyPlatform, weights: Any) -> None:
        self._platform = platform
        self._weights = weights
        self.closed = False

    def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, **_: Any) -> Future[types.SampleResponse]:
        p = sampling_params
        stop_ids = [int(s) for s in p.stop] if p.stop is not None else None  # type: ignore[arg-type, union-attr]
        tokens = prompt.to_ints()

        def work() -> types.SampleResponse:
            seqs = self._platform.sample(tokens, num_samples, max_tokens=p.max_tokens or 16,
                                         temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                         stop_ids=stop_ids, seed=p.seed, weights=self._weights)
            return types.SampleResponse(sequences=[
                types.SampledSequence(stop_reason=s.stop_reason,  # type: ignore[arg-type]
                                      tokens_np=np.asarray(s.tokens, dtype=np.int32),
                                      logprobs_np=np.asarray(s.logprobs, dtype=np.float32))
                for s in seqs
            ])

        return self._platform.submit("sample", work)

    def compute_logprobs(self, prompt: types.ModelInput) -> Future[list[float | None]]:
        """The prompt's logprobs on the snapshot (the SDK samples one token with prompt logprobs,
        and warns that `training_client.forward()` is the recommended way)."""
        warnings.warn("We don't recommend using the sampling client to compute logprobs. "
                      "Please use training_client.forward() instead.", UserWarning, stacklevel=2)
        tokens = prompt.to_ints()
        return self._platform.submit("compute_logprobs",
                                     lambda: self._platform.prompt_logprobs(tokens, self._weights))

    def close(self) -> None:
        self.closed = True


class FakeTrainingClient:
    """`FiretitanTrainingClient` (LoRA policy or frozen base)."""

    def __init__(self, platform: TinyPlatform, *, base_only: bool = False) -> None:
        self._platform = platform
        self._base_only = base_only
        self._ids = itertools.count(1)
        self.normalizations: list[str | None] = []

    def _future(self, op: str, work: Any) -> AwaitableConcurrentFuture[Any]:
        return AwaitableConcurrentFuture(self._platform.submit(op, work))

    def _items(self, data: list[types.Datum], keys: set[str]) -> list[Any]:
        items = []
        for d in data:
            if set(d.loss_fn_inputs) != keys:
                raise ValueError(f"loss_fn_inputs must be exactly {sorted(keys)}")
            ids = d.model_input.to_ints()
            inputs = {k: v.to_numpy().tolist() for k, v in d.loss_fn_inputs.items()}
            items.append((ids, [int(t) for t in inputs.pop("target_tokens")], inputs))
        return items

    def _output(self, outs: list[list[float]], loss: float) -> types.ForwardBackwardOutput:
        return types.ForwardBackwardOutput(
            loss_fn_output_type="TorchLossReturn",
            loss_fn_outputs=[{"logprobs": types.TensorData(data=o, dtype="float32", shape=[len(o)])} for o in outs],
            metrics={"loss:sum": loss},
        )

    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        items = self._items(data, CE_KEYS if loss_fn == "cross_entropy" else PPO_KEYS)

        def work() -> types.ForwardBackwardOutput:
            with self._platform.using(None) if self._base_only else _nothing():
                outs, loss = self._platform.forward_backward(items, loss_fn, dict(loss_fn_config or {}), backward=False)
            return self._output(outs, loss)

        return self._future("forward", work)

    def forward_backward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        if self._base_only:
            raise RuntimeError("the base-only client cannot train")
        items = self._items(data, PPO_KEYS if loss_fn == "ppo" else CE_KEYS)
        cfg = dict(loss_fn_config or {})
        return self._future("forward_backward", lambda: self._output(*self._platform.forward_backward(items, loss_fn, cfg)))

    def optim_step(self, adam_params: types.AdamParams, grad_accumulation_normalization: GradAccNormalization | str | None = None, **_: Any) -> AwaitableConcurrentFuture[types.OptimStepResponse]:
        p = adam_params
        norm = GradAccNormalization(grad_accumulation_normalization).value if grad_accumulation_normalization else None
        self.normalizations.append(norm)
        if norm == "num_sequences":
            raise NotImplementedError("fake fireworks: num_sequences is not simulated")

        def work() -> types.OptimStepResponse:
            metrics = self._platform.optim_step(
                lr=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps, weight_decay=p.weight_decay,
                grad_clip_norm=p.grad_clip_norm, divide_by_loss_tokens=norm == "num_loss_tokens",
            )
            return types.OptimStepResponse(metrics=metrics)

        return self._future("optim_step", work)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None, **_: Any) -> AwaitableConcurrentFuture[types.SaveWeightsForSamplerResponse]:
        def work() -> types.SaveWeightsForSamplerResponse:
            path = f"accounts/fake/snapshots/{name}"
            self._platform.snapshots[path] = self._platform.current_weights()
            return types.SaveWeightsForSamplerResponse(path=path)

        return self._future("save_weights_for_sampler", work)

    def save_state(self, name: str, ttl_seconds: int | None = None, **_: Any) -> AwaitableConcurrentFuture[types.SaveWeightsResponse]:
        def work() -> types.SaveWeightsResponse:
            path = f"gs://fake-trainer/checkpoints/{name}"
            self._platform.save_state(path)
            return types.SaveWeightsResponse(path=path)

        return self._future("save_state", work)

    def _load(self, op: str, path: str, with_optimizer: bool) -> AwaitableConcurrentFuture[Any]:
        def work() -> None:
            if path not in self._platform.states:  # a sampler snapshot is not a DCP checkpoint
                raise status_error(400, f"no DCP checkpoint at {path!r}")
            self._platform.load_state(path, with_optimizer=with_optimizer)

        return self._future(op, work)

    def load_state(self, path: str, weights_access_token: str | None = None) -> AwaitableConcurrentFuture[Any]:
        """Weights only; the optimizer starts fresh (as the SDK documents)."""
        return self._load("load_state", path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None) -> AwaitableConcurrentFuture[Any]:
        return self._load("load_state_with_optimizer", path, with_optimizer=True)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class FakeFiretitanService:
    """`FiretitanServiceClient` offline (the real one connects in its constructor)."""

    def __init__(self, platform: TinyPlatform | None = None, *, training_access: bool = True) -> None:
        self.platform = platform or TinyPlatform()
        self.faults = self.platform.faults
        self.training_access = training_access
        self.training: FakeTrainingClient | None = None
        self.closed = False

    def create_lora_training_client(self, base_model: str, rank: int = 32, **_: Any) -> FakeTrainingClient:
        if not self.training_access:
            raise status_error(403, "training API not enabled for this account")
        self.platform.new_run()  # a new trainer session starts from a fresh adapter
        self.training = FakeTrainingClient(self.platform)
        return self.training

    def create_base_training_client(self, base_model: str, **_: Any) -> FakeTrainingClient:
        return FakeTrainingClient(self.platform, base_only=True)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None, **_: Any) -> FakeSampler:
        return FakeSampler(self.platform, self.platform.snapshots[model_path] if model_path else None)

    def close(self) -> None:
        self.closed = True


class FakeDeployment:
    """A dedicated inference deployment: serves the last hot-loaded adapter; answers 425 for the
    next `loading_requests` requests after a hot-load starts."""

    def __init__(self, platform: TinyPlatform, *, loading_requests: int = 2) -> None:
        self.platform = platform
        self.weights: Any = None  # the base model until the first hot-load
        self.loading_requests = loading_requests
        self._still_loading = 0
        self.answered_425 = 0

    async def sample_with_prompt_tokens(self, prompt_token_ids: list[int], n: int = 1, max_tokens: int = 1024,
                                        temperature: float = 1.0, stop: list[int] | None = None, **kw: Any) -> list[SampledCompletion]:
        if self._still_loading > 0:
            self._still_loading -= 1
            self.answered_425 += 1
            raise SamplingRequestError("deployment hot-loading", final_status=425, attempts=1)

        def work() -> list[SampledCompletion]:
            seqs = self.platform.sample(prompt_token_ids, n, max_tokens=max_tokens, temperature=temperature,
                                        top_p=kw.get("top_p", 1.0), top_k=kw.get("top_k", 0) or -1,
                                        stop_ids=stop, seed=kw.get("seed"), weights=self.weights)
            return [SampledCompletion(text="", full_tokens=[*prompt_token_ids, *s.tokens], prompt_len=len(prompt_token_ids),
                                      finish_reason=s.stop_reason, completion_len=len(s.tokens),
                                      inference_logprobs=s.logprobs, sampling_logprobs=list(s.logprobs))
                    for s in seqs]

        import asyncio

        return await asyncio.wrap_future(self.platform.submit("deployment_sample", work))


class FakeWeightSyncer:
    """`WeightSyncer(policy_client, deploy_mgr, deployment_id, ...)`: save sampler weights and
    hot-load them into the deployment (blocking, returns the snapshot name or None)."""

    def __init__(self, training: FakeTrainingClient, deployment: FakeDeployment) -> None:
        self.training = training
        self.deployment = deployment
        self.checkpoint_types: list[str] = []  # "base" (full weights) or "delta" per hot-load
        self._chain_started = False

    def reset_delta_chain(self) -> None:
        """The next save is a full `base` checkpoint (the SDK's bookkeeping for a delta chain)."""
        self._chain_started = False

    def save_and_hotload(self, name: str, checkpoint_type: str | None = None) -> str | None:
        self.checkpoint_types.append(checkpoint_type or ("delta" if self._chain_started else "base"))
        self._chain_started = True
        path = self.training.save_weights_for_sampler(name).result()
        self.deployment._still_loading = self.deployment.loading_requests
        self.deployment.weights = self.deployment.platform.snapshots[path.path]
        return name
