"""The gate on the real engine path, shared by its tests (test_gate_live, test_promotion): the
tiny random model wrecked by one step, and the answers each version gives the same prompts."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.learning.gate import question_seed
from clawbridge.store import Store
from clawbridge.types import SamplingParams

from helpers.learning import settings_for

PROMPTS = ["What is rain?", "Why is the sky blue?", "What is a cat?", "Where is Peru?", "What is snow?",
           "How do birds fly?"]


@contextlib.asynccontextmanager
async def _wrecked(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[Any, Store, LocalBackend, Renderer, SamplingParams]]:
    """A learning rate that wrecks the tiny model in one step (the "harmful run"), the gate on with
    only the caller's probes; a pinned local backend and seed-7 sampling. Closed on the way out."""
    settings = settings_for(tmp_path, learning_rate=0.5, gate="on", gate_probes=0, **overrides)
    store = Store.open(settings.db_url)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        yield settings, store, backend, Renderer(backend.tokenizer()), SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    finally:
        await backend.close()
        store.close()


def _as_gate(params: SamplingParams, question: str) -> SamplingParams:
    """`params` as the gate asks `question` with them: the question's own seed."""
    return dataclasses.replace(params, seed=question_seed(params.seed, question))


async def _answers(backend: LocalBackend, renderer: Renderer, params: SamplingParams, version: int) -> list[str]:
    out = []
    for p in PROMPTS:
        [c] = await backend.sample(renderer.render([{"role": "user", "content": p}]), params, version=version)
        out.append(renderer.decode(c.tokens))
    return out


async def _plain(backend: LocalBackend, renderer: Renderer, params: SamplingParams) -> list[str]:
    return [renderer.parse(
        (await backend.sample(renderer.render([{"role": "user", "content": p}]), _as_gate(params, p), version=0))[0].tokens,
        "length").content or "" for p in PROMPTS]
