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
from clawbridge.backends.local import LocalBackend
from clawbridge.protocol import Backend

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
    # A platform limit: given a test's id, why this backend cannot take it (None: it can).
    unsupported: Callable[[str], str | None] | None = None
    # Its compute dtype: how close score comes to the sampled logprobs (a bf16 forward's rounding
    # depends on the shapes it runs at: one prompt whole vs a prefill then decode steps), and the
    # dtype the exact-gradient test's reference model computes in
    dtype: str = "fp32"
    logprob_tol: float = 2e-4


CASES: dict[str, BackendCase] = {}


def register(case: BackendCase) -> None:
    CASES[case.name] = case


async def make_local(tmp_path: Path, engine_dtype: str = "fp32") -> Backend:
    # a small token budget forces micro-batching, which must not change the gradient
    backend = LocalBackend(
        "tiny-random",
        tmp_path / "local",
        lora_rank=TINY_LORA_RANK,
        lora_alpha=TINY_LORA_ALPHA,
        train_token_budget=24,
        threads=1,  # the tiny model gains nothing from more; test_conformance restores it
        engine_dtype=engine_dtype,  # type: ignore[arg-type]
    )
    await backend.start()
    return backend


async def make_local_bf16(tmp_path: Path) -> Backend:
    return await make_local(tmp_path, "bf16")


async def local_weights(backend: Backend) -> dict[str, torch.Tensor]:
    assert isinstance(backend, LocalBackend)
    return await backend.engine.trainable_state()


register(BackendCase("local", make_local, local_weights))
# bf16 where the CPU has it natively (what `auto` picks there); on the tiny model score and the
# sampled logprobs agree to ~2e-3 (docs/engine.md has the embedded model's figures)
register(BackendCase("local-bf16", make_local_bf16, local_weights, dtype="bf16", logprob_tol=1e-2))


# --- the cloud backends against their offline SDK fakes (tests/fakes) ---------------------------
# One fake "account" per test directory, so a second `make` on the same directory is a restart
# that finds the first one's saved state on the platform.

_ACCOUNTS: dict[Path, object] = {}
_PLATFORM_OF: dict[int, object] = {}


def _cloud_retry():  # type: ignore[no-untyped-def]
    from clawbridge.backends.remote import RetryPolicy

    return RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02, timeout_s=120.0)


def _tiny_tokenizer():  # type: ignore[no-untyped-def]
    from clawbridge.local_gpu import models

    return models.load_tokenizer(models.resolve(models.TINY))


def _account(tmp_path: Path, make):  # type: ignore[no-untyped-def]
    if tmp_path not in _ACCOUNTS:
        _ACCOUNTS[tmp_path] = make()
    return _ACCOUNTS[tmp_path]


async def make_tinker(tmp_path: Path) -> Backend:
    from clawbridge.backends.tinker import TinkerBackend
    from fakes.fake_tinker import FakeTinkerService
    from fakes.torch_platform import TinyPlatform

    service = _account(tmp_path, lambda: FakeTinkerService(TinyPlatform(rank=TINY_LORA_RANK, alpha=TINY_LORA_ALPHA)))
    backend = TinkerBackend(service_client=service, base_model=service.known_models[0], tokenizer=_tiny_tokenizer(),
                            lora_rank=TINY_LORA_RANK, retry=_cloud_retry(), state_index=tmp_path / "tinker_states.json")
    await backend.start()
    _PLATFORM_OF[id(backend)] = service.platform
    return backend


async def make_fireworks(tmp_path: Path) -> Backend:
    from clawbridge.backends.fireworks import FireworksBackend
    from fakes.fake_fireworks import FakeFiretitanService
    from fakes.torch_platform import TinyPlatform

    service = _account(tmp_path, lambda: FakeFiretitanService(TinyPlatform(rank=TINY_LORA_RANK, alpha=TINY_LORA_ALPHA)))
    backend = FireworksBackend(connect=lambda: service, base_model="accounts/fireworks/models/qwen3-4b",
                               tokenizer=_tiny_tokenizer(), lora_rank=TINY_LORA_RANK, retry=_cloud_retry(),
                               state_index=tmp_path / "fireworks_states.json")
    await backend.start()
    _PLATFORM_OF[id(backend)] = service.platform
    return backend


async def platform_weights(backend: Backend) -> dict[str, torch.Tensor]:
    platform = _PLATFORM_OF[id(backend)]
    return {k.replace(".default", ""): v for k, v in platform.current_weights().items()}  # type: ignore[attr-defined]


async def make_modal(tmp_path: Path) -> Backend:
    from clawbridge.backends.modal import ModalBackend
    from fakes.fake_modal import FakeEngine

    engine = FakeEngine(tmp_path / "modal-volume", lora_rank=TINY_LORA_RANK, lora_alpha=TINY_LORA_ALPHA)
    backend = ModalBackend(engine=engine, tokenizer=_tiny_tokenizer(), model_name="tiny-random",
                           context_length=32768, retry=_cloud_retry())
    await backend.start()
    return backend


async def modal_weights(backend: Backend) -> dict[str, torch.Tensor]:
    from clawbridge.backends.modal import ModalBackend

    assert isinstance(backend, ModalBackend)
    container = backend.engine.obj._cached_user_cls_instance()  # the class instance Modal runs
    return await container.backend.engine.trainable_state()


def _temperature_one_only(platform: str) -> Callable[[str], str | None]:
    def unsupported(test: str) -> str | None:
        tempered = any(t in test for t in ("-t0.7", "-t1.3", "-t0.5")) or test.startswith("test_train_step_gradient")
        return (f"{platform}'s losses and scores see temperature-1 logprobs only (this test uses T != 1); "
                f"the exact T=1 update is proven in tests/test_backend_{platform.lower()}.py") if tempered else None

    return unsupported


register(BackendCase("tinker", make_tinker, platform_weights, unsupported=_temperature_one_only("Tinker")))
register(BackendCase("fireworks", make_fireworks, platform_weights, unsupported=_temperature_one_only("Fireworks")))
register(BackendCase("modal", make_modal, modal_weights))
