"""The backends the conformance suite runs against (tests/test_conformance.py).

To put another backend under the suite, register a case built on the tiny model (the same
tokenizer as the embedded model, random weights):

    from conformance_helpers import BackendCase, register

    async def make_tinker(tmp_path: Path) -> Backend: ...   # started, ready to sample
    register(BackendCase("tinker", make_tinker))

`make` receives a fresh per-test directory; called twice with the same directory it must give a
second backend that can `load_state` what the first saved (a restart). `trainable_weights`
exposes the LoRA weights (PEFT state-dict keys) for the exact-gradient test; a platform that
cannot show them leaves it None and that one test is skipped for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from clawbridge.backends.base import Backend
from clawbridge.backends.local import LocalBackend

Factory = Callable[[Path], Awaitable[Backend]]
WeightReader = Callable[[Backend], Awaitable[dict[str, torch.Tensor]]]

TINY_LORA_RANK = 8
TINY_LORA_ALPHA = 16  # alpha != rank so a backend that ignores alpha's scaling fails


@dataclass(frozen=True)
class BackendCase:
    name: str
    make: Factory
    trainable_weights: WeightReader | None = None
    lora_rank: int = TINY_LORA_RANK
    lora_alpha: int = TINY_LORA_ALPHA
    model_seed: int = 0  # tiny-random's weights for the reference model


CASES: dict[str, BackendCase] = {}


def register(case: BackendCase) -> None:
    CASES[case.name] = case


async def make_local(tmp_path: Path) -> Backend:
    # a small token budget forces micro-batching, which must not change the gradient
    backend = LocalBackend(
        "tiny-random",
        tmp_path / "local",
        lora_rank=TINY_LORA_RANK,
        lora_alpha=TINY_LORA_ALPHA,
        train_token_budget=24,
        threads=1,  # the tiny model gains nothing from more; test_conformance restores it
    )
    await backend.start()
    return backend


async def local_weights(backend: Backend) -> dict[str, torch.Tensor]:
    assert isinstance(backend, LocalBackend)
    return await backend.engine.trainable_state()


register(BackendCase("local", make_local, local_weights))
