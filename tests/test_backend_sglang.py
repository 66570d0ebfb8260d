"""The GPU stack's backend with several users' adapters (`protocol.Lineages`), against the fake
SGLang server (tests/fakes/fake_sglang.py) and a trainer stand-in that writes real adapters:
`switch` is the trainer's, and any published version is scored and sampled by number, loaded
again when it was unloaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from clawbridge.backends import sglang as sglang_backend
from clawbridge.backends.sglang import SGLangBackend
from clawbridge.local_gpu.sglang import Timeouts
from clawbridge.protocol import Lineages, UnknownVersion
from clawbridge.types import SamplingParams
from fakes.fake_sglang import FakeSGLang, serve, tiny_peft_model
from test_sglang import AdapterWriter

PROMPT = [1, 504, 3136, 2683, 30, 314, 5248]
COMPLETION = [11, 12, 13]


class RecordingTrainer(AdapterWriter):
    """The adapter writer, also recording what the backend asked the trainer to load."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, Path | None]] = []

    async def load_adapter(self, path: Path | None) -> None:
        self.loaded.append(("adapter", path))
        await super().load_adapter(path)

    async def load_state(self, path: Path) -> None:
        self.loaded.append(("state", path))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
async def server(tokenizer) -> AsyncIterator[FakeSGLang]:
    fake = FakeSGLang(tiny_peft_model(), tokenizer, token_delay_s=0.002)
    runner, port = await serve(fake)
    fake.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.fixture
async def backend(server, tokenizer, tmp_path) -> AsyncIterator[SGLangBackend]:
    b = SGLangBackend(server.url, tokenizer, model_name="tiny-random", context_length=256, data_dir=tmp_path,
                      trainer=RecordingTrainer(), timeouts=Timeouts(generate_s=30, lora_s=30))
    await b.start()
    try:
        yield b
    finally:
        await b.close()


async def test_switch_loads_a_checkpoint_or_a_published_adapter_into_the_trainer(backend, tmp_path) -> None:
    assert isinstance(backend, Lineages)
    trainer = backend.trainer
    assert (await backend.publish()).version == 1
    await backend.switch("lineage-a")
    await backend.switch(str(tmp_path / "elsewhere" / "lineage-b"))
    await backend.switch(None, 1)
    await backend.switch(None, 1, str(tmp_path / "adapters" / "v1"))
    await backend.switch(None, 0)
    assert trainer.loaded == [
        ("state", tmp_path / "checkpoints" / "lineage-a"), ("state", tmp_path / "elsewhere" / "lineage-b"),
        ("adapter", tmp_path / "adapters" / "v1"), ("adapter", tmp_path / "adapters" / "v1"), ("adapter", None),
    ]
    with pytest.raises(UnknownVersion):
        await backend.switch(None, 2)  # never published
    assert backend.newest == backend.version == 1  # a switch publishes nothing
    assert (await backend.publish()).version == 2  # one numbering for every lineage


async def test_an_unloaded_version_is_loaded_again_for_the_requests_that_name_it(server, backend, monkeypatch) -> None:
    monkeypatch.setattr(sglang_backend, "KEEP_ADAPTERS", 2)
    scores = {0: await backend.score(PROMPT, COMPLETION)}
    for v in (1, 2, 3, 4):
        assert (await backend.publish()).version == v
        scores[v] = await backend.score(PROMPT, COMPLETION)
    await backend.drain()
    assert set(server.adapters) == {"policy@v4"}
    loads = sum(kind == "load" for _, kind, _ in server.events)

    # each older version scores as it did when it was the newest; concurrent requests load it once
    got = await asyncio.gather(*(backend.score(PROMPT, COMPLETION, version=1) for _ in range(3)))
    assert all(g == pytest.approx(scores[1], abs=1e-6) for g in got)
    assert sum(kind == "load" for _, kind, _ in server.events) == loads + 1
    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=3), version=1)
    assert c.version == 1 and server.requests[-1]["lora_path"] == "policy@v1"
    assert await backend.score(PROMPT, COMPLETION, version=2) == pytest.approx(scores[2], abs=1e-6)
    await backend.drain()
    assert set(server.adapters) == {"policy@v1", "policy@v2", "policy@v4"}  # kept: the two used last
    assert await backend.score(PROMPT, COMPLETION, version=3) == pytest.approx(scores[3], abs=1e-6)
    await backend.drain()
    assert set(server.adapters) == {"policy@v2", "policy@v3", "policy@v4"}  # v1, used longest ago, unloaded
    assert await backend.score(PROMPT, COMPLETION, version=0) == pytest.approx(scores[0], abs=1e-6)
    assert await backend.score(PROMPT, COMPLETION, model="base", version=3) == pytest.approx(scores[0], abs=1e-6)

    # a version the gate holds serving after the newer one was published: served, not refused
    backend.serve(3)
    assert (await backend.publish()).version == 5
    await backend.drain()
    (held,) = await backend.sample(PROMPT, SamplingParams(max_tokens=3))
    assert held.version == 3
