"""An offline Tinker (tinker 0.38) at its SDK boundary.

The same method names as `tinker.ServiceClient`, `TrainingClient` and `SamplingClient`, taking
and returning the SDK's real types (`tinker.types.ModelInput`, `Datum`, `SamplingParams`,
`AdamParams`, `SampleResponse`, `ForwardBackwardOutput`, ...) through the SDK's own
`AwaitableConcurrentFuture`, backed by `TinyPlatform`. Validation mirrors the service: PPO data
must carry exactly target_tokens, logprobs and advantages, each as long as the model input.
Errors are the SDK's exception classes (`tinker.RateLimitError`, `InternalServerError`, ...).
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import numpy as np
import tinker
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from .torch_platform import Run, TinyPlatform

PPO_KEYS = {"target_tokens", "logprobs", "advantages"}


def status_error(status: int, message: str = "") -> tinker.APIStatusError:
    """The exception the SDK raises for an HTTP status, as the SDK builds it."""
    request = httpx.Request("POST", "https://tinker.fake/api/v1/x")
    response = httpx.Response(status, request=request)
    cls: type[tinker.APIStatusError] = {
        400: tinker.BadRequestError, 401: tinker.AuthenticationError, 402: tinker.BillingError,
        409: tinker.ConflictError, 429: tinker.RateLimitError,
    }.get(status, tinker.InternalServerError if status >= 500 else tinker.APIStatusError)
    return cls(message or f"HTTP {status}", response=response, body=None)


def timeout_error() -> tinker.APITimeoutError:
    return tinker.APITimeoutError(httpx.Request("POST", "https://tinker.fake/api/v1/x"))


def _future(platform: TinyPlatform, op: str, work: Any) -> AwaitableConcurrentFuture[Any]:
    return AwaitableConcurrentFuture(platform.submit(op, work))


class FakeSamplingClient:
    def __init__(self, platform: TinyPlatform, weights: Any, path: str | None) -> None:
        self._platform = platform
        self._weights = weights  # None: the base model
        self.model_path = path

    def sample(
        self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0, prompt_logprobs_last_n: int | None = None, **_: Any,
    ) -> AwaitableConcurrentFuture[types.SampleResponse]:
        tokens = prompt.to_ints()
        p = sampling_params
        stop = p.stop
        if stop is not None and any(isinstance(s, str) for s in stop):
            raise NotImplementedError("fake tinker: string stops are not simulated")
        stop_ids = [int(s) for s in stop] if stop is not None else None  # type: ignore[arg-type]

        def work() -> types.SampleResponse:
            seqs = self._platform.sample(
                tokens, num_samples, max_tokens=p.max_tokens or 16, temperature=p.temperature,
                top_p=p.top_p, top_k=p.top_k, stop_ids=stop_ids, seed=p.seed,
                weights=self._weights, top_logprobs=topk_sample_logprobs,
            )
            out = [
                types.SampledSequence(
                    stop_reason=s.stop_reason,  # type: ignore[arg-type]
                    sequence_id=f"seq-{i}",
                    tokens_np=np.asarray(s.tokens, dtype=np.int32),
                    logprobs_np=np.asarray(s.logprobs, dtype=np.float32),
                    _topk_logprobs_list=s.top,  # type: ignore[arg-type]
                )
                for i, s in enumerate(seqs)
            ]
            prompt_lp = None
            if include_prompt_logprobs:
                lps = self._platform.prompt_logprobs(tokens, self._weights)
                if prompt_logprobs_last_n is not None:
                    cut = len(lps) - prompt_logprobs_last_n
                    lps = [None] * cut + lps[cut:]
                prompt_lp = np.asarray([np.nan if x is None else x for x in lps], dtype=np.float32)
            return types.SampleResponse(sequences=out, prompt_logprobs_np=prompt_lp)

        return _future(self._platform, "sample", work)

    def compute_logprobs(
        self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> AwaitableConcurrentFuture[list[float | None]]:
        tokens = prompt.to_ints()
        if prompt_logprobs_last_n is not None and not 1 <= prompt_logprobs_last_n <= len(tokens) - 1:
            raise ValueError("prompt_logprobs_last_n must be between 1 and len(prompt) - 1")

        def work() -> list[float | None]:
            lps = self._platform.prompt_logprobs(tokens, self._weights)
            if prompt_logprobs_last_n is not None:
                cut = len(lps) - prompt_logprobs_last_n
                lps = [None] * cut + lps[cut:]
            return lps

        return _future(self._platform, "compute_logprobs", work)


class FakeTrainingClient:
    """A training client is a training run of its own on the service: its work runs on its run's
    weights and optimizer, whatever other clients did meanwhile."""

    def __init__(self, service: FakeTinkerService, base_model: str, run: Run) -> None:
        self._service = service
        self._platform = service.platform
        self.base_model = base_model
        self._run = run
        self._ids = itertools.count(1)
        self._saved: set[str] = set()  # checkpoint names this run has saved

    def _submit(self, op: str, work: Any) -> AwaitableConcurrentFuture[Any]:
        def on_run() -> Any:
            self._platform.activate(self._run)
            return work()

        return _future(self._platform, op, on_run)

    def _items(self, data: list[types.Datum], keys: set[str]) -> list[Any]:
        items = []
        for d in data:
            if set(d.loss_fn_inputs) != keys:
                raise tinker.BadRequestError(
                    f"loss_fn_inputs must be exactly {sorted(keys)}, got {sorted(d.loss_fn_inputs)}",
                    response=httpx.Response(400, request=httpx.Request("POST", "https://tinker.fake")),
                    body=None,
                )
            ids = d.model_input.to_ints()
            inputs = {k: v.to_numpy().tolist() for k, v in d.loss_fn_inputs.items()}
            if any(len(v) != len(ids) for v in inputs.values()):
                raise ValueError("every loss_fn_input must be as long as model_input")
            targets = [int(t) for t in inputs.pop("target_tokens")]
            items.append((ids, targets, inputs))
        return items

    def _output(self, outs: list[list[float]], loss: float) -> types.ForwardBackwardOutput:
        return types.ForwardBackwardOutput(
            loss_fn_output_type="TorchLossReturn",
            loss_fn_outputs=[{"logprobs": types.TensorData(data=o, dtype="float32", shape=[len(o)])} for o in outs],
            metrics={"loss:sum": loss},
        )

    def forward_backward(
        self, data: list[types.Datum], loss_fn: types.LossFnType, loss_fn_config: dict[str, float] | None = None
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        keys = PPO_KEYS if loss_fn in ("ppo", "importance_sampling") else {"target_tokens", "weights"}
        items = self._items(data, keys)
        cfg = dict(loss_fn_config or {})

        def work() -> types.ForwardBackwardOutput:
            outs, loss = self._platform.forward_backward(items, loss_fn, cfg)
            return self._output(outs, loss)

        return self._submit("forward_backward", work)

    def forward(
        self, data: list[types.Datum], loss_fn: types.LossFnType, loss_fn_config: dict[str, float] | None = None
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        items = self._items(data, {"target_tokens", "weights"} if loss_fn == "cross_entropy" else PPO_KEYS)

        def work() -> types.ForwardBackwardOutput:
            outs, loss = self._platform.forward_backward(items, loss_fn, dict(loss_fn_config or {}), backward=False)
            return self._output(outs, loss)

        return self._submit("forward", work)

    def optim_step(self, optim_params: types.AdamParams | None = None, *, adam_params: types.AdamParams | None = None) -> AwaitableConcurrentFuture[types.OptimStepResponse]:
        p = optim_params or adam_params or types.AdamParams()

        def work() -> types.OptimStepResponse:
            metrics = self._platform.optim_step(
                lr=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm,
            )
            return types.OptimStepResponse(metrics=metrics)

        return self._submit("optim_step", work)

    def save_weights_and_get_sampling_client(self, name: str | None = None, kind: str = "snapshot", **_: Any) -> AwaitableConcurrentFuture[FakeSamplingClient]:
        def work() -> FakeSamplingClient:
            path = f"tinker://fake-run/sampler_weights/ephemeral-{next(self._ids)}"
            weights = self._platform.current_weights()
            self._platform.snapshots[path] = weights
            return FakeSamplingClient(self._platform, weights, path)

        return self._submit("save_weights_and_get_sampling_client", work)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None, **_: Any) -> AwaitableConcurrentFuture[types.SaveWeightsForSamplerResponse]:
        def work() -> types.SaveWeightsForSamplerResponse:
            path = f"tinker://fake-run/sampler_weights/{name}"
            self._platform.snapshots[path] = self._platform.current_weights()
            return types.SaveWeightsForSamplerResponse(path=path)

        return self._submit("save_weights_for_sampler", work)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   **_: Any) -> AwaitableConcurrentFuture[types.SaveWeightsResponse]:
        """A name is a checkpoint of this run's: saved again, it is refused unless `overwrite`."""

        def work() -> types.SaveWeightsResponse:
            if name in self._saved and not overwrite:
                raise status_error(409, f"checkpoint {name!r} already exists (overwrite=True replaces it)")
            self._saved.add(name)
            path = f"tinker://fake-run/weights/{name}"
            self._platform.save_state(path)
            return types.SaveWeightsResponse(path=path)

        return self._submit("save_state", work)

    def get_tokenizer(self) -> Any:
        from clawbridge.local_gpu import models

        return models.load_tokenizer(models.resolve(models.TINY))


class FakeTinkerService:
    """`tinker.ServiceClient` offline: one training run on the tiny model."""

    def __init__(self, platform: TinyPlatform | None = None, *, known_models: tuple[str, ...] = ("Qwen/Qwen3-4B-Instruct-2507",)) -> None:
        self.platform = platform or TinyPlatform()
        self.faults = self.platform.faults
        self.known_models = known_models
        self.closed = False

    def _check_model(self, base_model: str) -> None:
        if base_model not in self.known_models:
            raise tinker.BadRequestError(
                f"base model {base_model!r} is not available",
                response=httpx.Response(400, request=httpx.Request("POST", "https://tinker.fake")),
                body=None,
            )

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None, **_: Any) -> AwaitableConcurrentFuture[FakeTrainingClient]:
        self._check_model(base_model)
        def work() -> FakeTrainingClient:
            return FakeTrainingClient(self, base_model, self.platform.new_run())  # a fresh adapter

        return _future(self.platform, "create_lora_training_client", work)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None, **_: Any) -> AwaitableConcurrentFuture[FakeSamplingClient]:
        if model_path is None and base_model is None:
            raise ValueError("Either model_path or base_model must be provided")

        def work() -> FakeSamplingClient:
            weights = self.platform.snapshots[model_path] if model_path else None
            return FakeSamplingClient(self.platform, weights, model_path)

        return _future(self.platform, "create_sampling_client", work)

    def _from_state(self, op: str, path: str, with_optimizer: bool) -> AwaitableConcurrentFuture[FakeTrainingClient]:
        def work() -> FakeTrainingClient:
            if path not in self.platform.states:  # e.g. a sampler_weights path: not a training state
                raise tinker.BadRequestError(
                    f"no training weights at {path!r}",
                    response=httpx.Response(400, request=httpx.Request("POST", "https://tinker.fake")),
                    body=None,
                )
            run = self.platform.new_run()  # a run of its own, with the state's weights (and moments)
            self.platform.load_state(path, with_optimizer=with_optimizer)
            return FakeTrainingClient(self, self.known_models[0], run)

        return _future(self.platform, op, work)

    def create_training_client_from_state(self, path: str, base_model: str | None = None, **_: Any) -> AwaitableConcurrentFuture[FakeTrainingClient]:
        """Weights only: the new run's optimizer starts fresh (as the SDK documents)."""
        return self._from_state("create_training_client_from_state", path, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str, **_: Any) -> AwaitableConcurrentFuture[FakeTrainingClient]:
        return self._from_state("create_training_client_from_state_with_optimizer", path, with_optimizer=True)

    def close(self) -> None:
        self.closed = True
