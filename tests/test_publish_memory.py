"""Publish in memory (issue 17): a new version serves from the weights kept in memory while a
writer thread persists them to `adapters/vK`; `publish()` returns once they are on disk, which is
when a caller may record the version. On the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from clawbridge.local_gpu import adapters
from clawbridge.local_gpu.adapters import TRAIN
from clawbridge.local_gpu.engine import Engine, collect
from clawbridge.protocol import BackendError
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams

PROMPT = (1, 520, 3121, 28, 1830, 446, 17, 905)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())


def engine_on(data_dir: Path, dtype: torch.dtype = torch.float32) -> Engine:
    from clawbridge.local_gpu import models

    engine = Engine(
        models.resolve("tiny-random"),
        data_dir=data_dir,
        lora_rank=4,
        lora_alpha=8,
        dtype=dtype,
        threads=1,
    )
    engine.start()
    return engine


@pytest.fixture
def threads():
    before = torch.get_num_threads()  # the engine's setting is process-wide: restored
    yield
    torch.set_num_threads(before)


async def learn(engine: Engine, lr: float = 5e-2) -> None:
    """One step that moves the adapter (a fresh LoRA adapter has B = 0: it changes nothing)."""
    c = await collect(
        engine.sample_stream(PROMPT, SamplingParams(max_tokens=5, seed=3, stop_token_ids=()))
    )
    datum = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    await engine.train_step([datum], LossSpec(), OptimSpec(learning_rate=lr))


class Held:
    """Holds the engine's writer thread until released (a slow disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.release, self.fail, write = threading.Event(), fail, adapters.write

        def held(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.release.wait(60)
            if self.fail:
                raise OSError(28, "No space left on device")
            return write(*args, **kwargs)

        monkeypatch.setattr(adapters, "write", held)


async def test_a_version_serves_before_its_weights_reach_the_disk(
    tmp_path: Path, threads, monkeypatch
) -> None:
    engine = engine_on(tmp_path)
    held = Held(monkeypatch)
    try:
        await learn(engine)
        durable = asyncio.ensure_future(engine.publish())
        while engine.version != 1:
            await asyncio.sleep(0.01)
        served = await collect(engine.sample_stream(PROMPT, GREEDY))
        assert served.version == 1 and not durable.done()
        root = tmp_path / "adapters"
        assert not (root / "v1").exists() and (root / ".v1.tmp").is_dir()  # the number is taken
        # a second version while the first is still being written: v1 leaves its slot, and asking
        # for it by number serves the weights kept for the writer
        await learn(engine)
        v2 = await engine.publish(durable=False)
        assert v2.version == 2 and engine.loaded_versions == {2}
        again = await collect(engine.sample_stream(PROMPT, GREEDY, version=1))
        assert (
            again.version == 1
            and again.tokens == served.tokens
            and again.logprobs == served.logprobs
        )
        held.release.set()
        assert (await durable).version == 1
        assert (root / "v1" / adapters.WEIGHTS).exists() and not (root / ".v1.tmp").exists()
    finally:
        held.release.set()
        engine.close()
    assert (tmp_path / "adapters" / "v2" / adapters.WEIGHTS).exists()  # close waits for the writer


async def test_every_publish_finds_a_serving_slot_ready(tmp_path: Path, threads) -> None:
    """No publish creates LoRA layers while it switches versions: a spare slot is made after
    the previous publish, off the hot path, and a freed slot is kept for the next one."""
    engine = engine_on(tmp_path)
    try:
        slots = engine._slots
        assert slots is not None and len(slots.spare) == 1
        created: list[int] = []
        make, publish = slots._create, engine._publish
        slots._create = lambda: created.append(1) or make()  # type: ignore[method-assign]
        during: list[int] = []

        def counted():  # type: ignore[no-untyped-def]
            before = len(created)
            out = publish()
            during.append(len(created) - before)
            return out

        engine._publish = counted  # type: ignore[method-assign]
        for _ in range(4):
            await engine.publish()
        assert during == [0, 0, 0, 0] and created == [1]  # one spare made, between publishes
        assert len(slots.params) == 2  # the one serving and one spare
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
async def test_what_serves_from_memory_is_what_a_restart_loads(
    tmp_path: Path, threads, dtype
) -> None:
    engine = engine_on(tmp_path, dtype)
    try:
        await learn(engine)
        published = await engine.publish()
        in_memory = await engine.logits(PROMPT, version=published.version)
        trainable = await engine.trainable_state()
    finally:
        engine.close()
    restarted = engine_on(tmp_path, dtype)
    try:
        await restarted.restore(published.version, published.path)
        assert restarted.version == published.version
        assert torch.equal(await restarted.logits(PROMPT), in_memory)
        # the persisted weights are the trainable ones (fp32), not the serving copy's dtype
        on_disk = adapters.read(Path(published.path), "cpu")
        assert on_disk.keys() == trainable.keys()
        assert all(torch.equal(on_disk[k], trainable[k]) for k in trainable)
    finally:
        restarted.close()


async def test_the_persisted_folder_is_what_peft_writes_and_loads(tmp_path: Path, threads) -> None:
    from peft import PeftModel

    engine = engine_on(tmp_path)
    try:
        await learn(engine)
        published = await engine.publish()
        reference = tmp_path / "peft"
        model = engine._model
        await engine._call(lambda: model.save_pretrained(str(reference), selected_adapters=[TRAIN]))
    finally:
        engine.close()
    ours, theirs = (
        json.loads((d / adapters.CONFIG).read_text()) for d in (Path(published.path), reference)
    )
    assert set(ours.pop("target_modules")) == set(theirs.pop("target_modules"))
    assert ours == theirs
    mine, peft = adapters.read(Path(published.path), "cpu"), adapters.read(reference, "cpu")
    assert mine.keys() == peft.keys() and all(torch.equal(mine[k], peft[k]) for k in mine)
    loaded = PeftModel.from_pretrained(model.get_base_model(), published.path, adapter_name="check")
    assert "check" in loaded.peft_config


async def test_a_failed_persist_takes_the_version_back_and_burns_its_number(
    tmp_path: Path, threads, monkeypatch
) -> None:
    engine = engine_on(tmp_path)
    try:
        held = Held(monkeypatch, fail=True)
        await learn(engine)
        held.release.set()
        with pytest.raises(OSError):
            await engine.publish()  # raised once the engine serves the previous version again
        c = await collect(engine.sample_stream(PROMPT, GREEDY))
        assert engine.version == 0 and c.version == 0
        with pytest.raises(BackendError):
            await collect(engine.sample_stream(PROMPT, GREEDY, version=1))
        held.fail = False
        assert (await engine.publish()).version == 2  # v1's number is never reused
    finally:
        engine.close()


CHILD = """
import asyncio, os, signal, sys, threading
sys.path.insert(0, {tests!r})
from pathlib import Path
from clawbridge.local_gpu import adapters
import test_publish_memory as t

async def main():
    engine = t.engine_on(Path({data!r}))
    await t.learn(engine)
    adapters.write = lambda *a, **k: threading.Event().wait()  # the disk never finishes
    await engine.publish(durable=False)
    c = await t.collect(engine.sample_stream(t.PROMPT, t.GREEDY))
    print("SERVED", c.version, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_a_crash_between_serving_and_persisting_leaves_the_number_taken(
    tmp_path: Path, threads
) -> None:
    """The version served a request, then the process died before its weights reached the disk.
    It was never recorded (the caller records after a durable publish), so a restart serves the
    version before it; the lost number is never given to other weights."""
    code = CHILD.format(tests=str(Path(__file__).parent), data=str(tmp_path))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert "SERVED 1" in child.stdout
    root = tmp_path / "adapters"
    assert not (root / "v1").exists() and (root / ".v1.tmp").is_dir()

    engine = engine_on(tmp_path)
    try:
        await engine.restore(0, None)  # the newest recorded version: v1 never was
        assert (await collect(engine.sample_stream(PROMPT, GREEDY))).version == 0
        with pytest.raises(BackendError):
            await collect(engine.sample_stream(PROMPT, GREEDY, version=1))
        await learn(engine)
        published = await engine.publish()
        assert published.version == 2 and (root / "v2" / adapters.WEIGHTS).exists()
        assert not (root / "v1").exists()
    finally:
        engine.close()
