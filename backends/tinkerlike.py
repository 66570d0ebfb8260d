"""What the Tinker-shaped platforms share: Tinker, and Fireworks' Tinker-compatible training SDK.

The data (`platform_datum`, the step's metrics), the temperature-1 rule of their losses, the index
of saved training states in the data directory, and the open sampling clients (`Samplers`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from clawbridge.loss import batch_tokens, ppo_token_losses
from clawbridge.protocol import (
    BackendError,
    ContextLengthExceeded,
    UnknownVersion,
    require_published,
)
from clawbridge.types import Datum, LossSpec, SamplingParams, StepMetrics

KEEP_SAMPLERS = 8  # sampling clients kept open: the versions used most recently (v0's always)

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


def scoring_datum(prompt_ids: Sequence[int], completion_ids: Sequence[int], types: Any) -> Any:
    """A cross-entropy datum whose target logprobs are the completion's scores (weight 1 on the
    completion, 0 on the prompt)."""
    full = [*prompt_ids, *completion_ids]
    n = len(full) - 1
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(completion_ids)
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData(data=full[1:], dtype="int64", shape=[n]),
        "weights": types.TensorData(data=weights, dtype="float32", shape=[n]),
    })


def completion_tail(prompt_logprobs: Sequence[float | None], k: int, platform: str) -> list[float]:
    """The last `k` of a sequence's prompt logprobs (a completion's scores); each must be there."""
    tail = list(prompt_logprobs)[-k:]
    if any(x is None for x in tail):
        raise BackendError(f"{platform} returned no logprob for a completion token")
    return [float(x) for x in tail if x is not None]


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


def sampler_state(version: int) -> str:
    """The index's name for the sampler weights of a published version (a path a sampling client
    can be opened on again), where the platform persisted them."""
    return f"{version_state(version)}.sampler"


def state_path(states: StateIndex, version: int, newest: int) -> str:
    """Where the training state of `version` lives (for `rollback` and `switch`), or UnknownVersion."""
    require_published(version, newest)
    path = states.path_of(version_state(version))
    if path is None:
        raise UnknownVersion(version, newest, f"policy@v{version} has no saved training state "
                                              "(it was published before a state was kept with each version)")
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


class Samplers:
    """The open sampling clients by version, the one used last at the end. Several users'
    versions serve at once (`protocol.Lineages`), so it is not the newest few that stay open but
    the `keep` used most recently, v0's (the base model) always; a version dropped is opened
    again when a request names it (the backend's `_open`). A request holds its sampler, so one
    dropped while the request runs still finishes on it."""

    def __init__(self, keep: int = KEEP_SAMPLERS) -> None:
        self.keep = keep
        self._open: dict[int, Any] = {}
        self._opening = asyncio.Lock()

    async def of(self, version: int, newest: int, opener: Callable[[int], Awaitable[Any]],
                 spare: Iterable[int] = ()) -> Any:
        """The sampler of published `version`, opened again with `opener` if it was dropped."""
        sampler = self.get(version)
        if sampler is None:
            require_published(version, newest)
            async with self._opening:  # concurrent requests for one version open it once
                sampler = self.get(version) or await opener(version)
                self.put(version, sampler, spare=(newest, *spare))
        return sampler

    def __contains__(self, version: object) -> bool:
        return version in self._open

    def versions(self) -> list[int]:
        return sorted(self._open)

    def values(self) -> list[Any]:
        return list(self._open.values())

    def get(self, version: int) -> Any | None:
        """The open sampler of `version` (now the one used last), or None."""
        sampler = self._open.pop(version, None)
        if sampler is not None:
            self._open[version] = sampler
        return sampler

    def put(self, version: int, sampler: Any, *, spare: Iterable[int] = ()) -> None:
        """Open `version` on `sampler`; the least recently used beyond `keep` are dropped, never
        v0, `version` itself or the versions in `spare` (the newest, the one serving)."""
        self._open.pop(version, None)
        self._open[version] = sampler
        kept = {0, version, *spare}
        extra = len(self._open) - self.keep
        for v in [v for v in self._open if v not in kept][: max(extra, 0)]:
            del self._open[v]
