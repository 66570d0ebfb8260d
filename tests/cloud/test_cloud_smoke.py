"""Real-credential smoke tests: a user with an account runs them to check the set-up.

    pytest -m cloud tests/cloud        # each platform runs only when its credentials are set

They spend a little money (a few cents: one short sample, one score, one tiny train step and a
publish on the platform's smallest configuration). Skipped, with the reason, without credentials.
Endpoints and models come from the usual settings (`CLAWBRIDGE_TINKER_BASE_MODEL`, ...).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from clawbridge.config import Settings
from clawbridge.protocol import Backend
from clawbridge.types import Datum, OptimSpec, SamplingParams

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(1800)]


def _need(*names: str) -> None:
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        pytest.skip(f"set {', '.join(missing)} to run this platform's smoke test (it spends a few cents)")


async def _round_trip(backend: Backend) -> None:
    """Sample, score, one tiny step, publish, sample on the new version."""
    await backend.start()
    try:
        tok = backend.tokenizer()
        chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(chat, add_special_tokens=False)
        (c,) = await backend.sample(prompt, SamplingParams(max_tokens=8))
        assert c.tokens and len(c.logprobs) == len(c.tokens)
        scored = await backend.score(prompt, c.tokens)
        assert max(abs(a - b) for a, b in zip(scored, c.logprobs, strict=True)) < 0.05
        metrics = await backend.train_step([Datum(tuple(prompt), c.tokens, c.logprobs, (1.0,) * len(c.tokens))],
                                           optim=OptimSpec(learning_rate=1e-5))
        assert metrics.tokens == len(c.tokens)
        v = await backend.publish()
        (after,) = await backend.sample(prompt, SamplingParams(max_tokens=4))
        assert after.version == v.version == 1
    finally:
        await backend.close()


async def test_tinker_account_can_sample_score_train_and_publish(tmp_path: Path) -> None:
    _need("TINKER_API_KEY")
    from clawbridge.backends.tinker import TinkerBackend

    await _round_trip(TinkerBackend.from_settings(Settings(data_dir=tmp_path, backend="tinker", lora_rank=8)))


async def test_fireworks_account_has_training_api_access_and_round_trips(tmp_path: Path) -> None:
    _need("FIREWORKS_API_KEY")
    from clawbridge.backends.fireworks import FireworksBackend

    await _round_trip(FireworksBackend.from_settings(Settings(data_dir=tmp_path, backend="fireworks", lora_rank=8)))


async def test_modal_deployed_engine_round_trips(tmp_path: Path) -> None:
    if not (os.environ.get("MODAL_TOKEN_ID") or (Path.home() / ".modal.toml").exists()):
        pytest.skip("run `modal token new` (or set MODAL_TOKEN_ID/SECRET) and `clawbridge modal deploy` first")
    from clawbridge.backends.modal import ModalBackend

    await _round_trip(ModalBackend.from_settings(Settings(data_dir=tmp_path, backend="modal", model="smollm2-135m-instruct")))
