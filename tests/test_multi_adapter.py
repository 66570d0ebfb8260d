"""Many adapters over one base model in the torch engine: rows on different registered adapters
decode in one batch, each with the logprobs it gets alone on its adapter; adapters live within a
memory budget, the least recently used evicted to disk and read back on demand, never one a
running request uses. The tiny model, fp32."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.local_gpu import adapters, models
from clawbridge.local_gpu.engine import Engine
from clawbridge.local_gpu.multilora import (
    NONE,
    Plan,
    gather,
    gathered_delta,
    grouped_delta,
    runs_of,
    single_delta,
)
from clawbridge.local_gpu.registry import AdapterInUse, Entry, UnknownAdapter, victims
from clawbridge.types import Completion, SamplingParams

PROMPT = (1, 520, 3121, 28, 1830, 446, 17, 905)
OTHER = (1, 4093, 314, 2201, 28, 690, 11, 12, 13, 14, 15)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=())


def random_adapter(like: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """LoRA weights shaped as `like`, B non-zero, so that each adapter moves the logits its own way."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * (0.5 if ".lora_B." in k else 0.2) for k, v in like.items()}


def _backend(root: Path, **kw: object) -> LocalBackend:
    backend = LocalBackend("tiny-random", root, lora_rank=8, lora_alpha=8, threads=1, **kw)  # type: ignore[arg-type]
    backend.engine.start()
    return backend


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    threads = torch.get_num_threads()
    backend = _backend(tmp_path_factory.mktemp("multi"))
    yield backend
    backend.engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shapes(tiny: LocalBackend) -> dict[str, torch.Tensor]:
    return asyncio.run(tiny.engine.trainable_state())


async def one(backend: LocalBackend, adapter: str | None, prompt: tuple[int, ...] = PROMPT,
              params: SamplingParams = GREEDY) -> Completion:
    (completion,) = await backend.sample(prompt, params, adapter=adapter)
    return completion


def close(a: Completion, b: Completion, tolerance: float = 1e-4) -> bool:
    return a.tokens == b.tokens and max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < tolerance


# --- the math ----------------------------------------------------------------------------------


def test_gathered_and_grouped_deltas_are_each_rows_own_adapters_product() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 6, generator=gen), torch.randn(3, 5, 4, generator=gen)
    scale, x = torch.tensor([1.0, 0.5, 2.0]), torch.randn(4, 2, 6, generator=gen)
    slots = [2, 0, 2, 1]
    expected = torch.stack([single_delta(x[i : i + 1], a[s], b[s], float(scale[s]))[0] for i, s in enumerate(slots)])
    plan = Plan.of(slots)
    assert torch.allclose(gathered_delta(x, gather(a, b, scale, plan.index)), expected, atol=1e-5)
    base = torch.randn(4, 2, 5, generator=gen)
    assert torch.allclose(gathered_delta(x, gather(a, b, scale, plan.index), base), base + expected, atol=1e-5)
    assert torch.allclose(grouped_delta(x, a, b, scale.tolist(), plan.runs), expected, atol=1e-5)
    assert runs_of([2, 2, 0, 2]) == ((0, 2, 2), (2, 3, 0), (3, 4, 2))


def test_a_plan_names_one_slot_only_when_every_row_is_on_it() -> None:
    assert Plan.of([1, 1, 1]).single == 1 and Plan.of([1, 1, 1]).live is None
    partial = Plan.of([1, NONE, 1])
    assert partial.single is None and partial.live is not None and partial.live.tolist() == [0, 2]
    assert Plan.of([0, 2]).single is None


def test_the_least_recently_used_idle_adapters_are_evicted_first() -> None:
    entries = [Entry("a", Path("a"), 1.0, 0, slot=0, used=3.0), Entry("b", Path("b"), 1.0, 0, slot=1, used=1.0),
               Entry("c", Path("c"), 1.0, 0, slot=2, refs=1, used=0.0), Entry("d", Path("d"), 1.0, 0, used=0.5)]
    assert victims(entries, free=0, need=1) == ["b"]  # c is in use, d is not resident
    assert victims(entries, free=0, need=3) == ["b", "a"]  # never c, even short of room
    assert victims(entries, free=1, need=1) == []


# --- the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["gather", "group"])
async def test_rows_on_different_adapters_in_one_batch_get_their_solo_logprobs(
    tiny: LocalBackend, shapes: dict[str, torch.Tensor], strategy: str
) -> None:
    engine = tiny.engine
    assert engine._stack is not None
    engine._stack.strategy = strategy  # type: ignore[assignment]
    await engine.register_adapter("a", random_adapter(shapes, 1))
    await engine.register_adapter("b", random_adapter(shapes, 2))
    jobs = [("a", PROMPT), ("b", PROMPT), (None, PROMPT), ("b", OTHER)]
    alone = [await one(tiny, key, prompt) for key, prompt in jobs]
    assert alone[0].tokens != alone[1].tokens != alone[2].tokens  # each adapter moves the model its own way

    together = await asyncio.gather(*(one(tiny, key, prompt) for key, prompt in jobs))
    for solo, mixed in zip(alone, together, strict=True):
        assert close(solo, mixed)


async def test_a_registered_adapter_serves_as_the_same_weights_published_as_a_version_and_beside_one(
    tmp_path: Path, shapes: dict[str, torch.Tensor]
) -> None:
    backend = _backend(tmp_path / "engine")
    try:
        weights = random_adapter(shapes, 3)
        folder = tmp_path / "published"
        adapters.reserve(folder, 1)
        adapters.write(folder, 1, weights, backend.engine._adapter_config)
        await backend.engine.register_adapter("from-folder", adapters.folder(folder, 1))
        await backend.engine.restore(1, str(adapters.folder(folder, 1)))
        as_version = await one(backend, None)
        assert as_version.version == 1
        assert close(await one(backend, "from-folder"), as_version, tolerance=1e-5)
        # a version's row (PEFT's layers) and a registered adapter's row in one batch
        await backend.engine.register_adapter("other", random_adapter(shapes, 8))
        other = await one(backend, "other")
        together = await asyncio.gather(one(backend, None), one(backend, "other"))
        assert close(together[0], as_version) and close(together[1], other)
    finally:
        backend.engine.close()


async def test_an_evicted_adapter_comes_back_from_disk_with_the_same_outputs(
    tiny: LocalBackend, shapes: dict[str, torch.Tensor]
) -> None:
    engine = tiny.engine
    await engine.register_adapter("e", random_adapter(shapes, 4), version=7)
    before = await one(tiny, "e", OTHER)
    assert before.version == 7
    loads = engine.adapter_stats().loads
    assert await engine.evict_adapter("e")
    await engine.register_adapter("f", random_adapter(shapes, 9))  # takes the slot e left
    assert "e" not in engine.adapter_stats().resident_keys
    after = await one(tiny, "e", OTHER)
    stats = engine.adapter_stats()
    assert stats.loads == loads + 1 and "e" in stats.resident_keys
    assert close(after, before, tolerance=1e-5)  # (its prompt's keys cached: rounding apart)


async def test_an_unknown_adapter_is_refused(tiny: LocalBackend) -> None:
    with pytest.raises(UnknownAdapter):
        await one(tiny, "nobody")
    with pytest.raises(ValueError):
        await tiny.engine.sample(PROMPT, GREEDY, version=0, adapter="a")


async def test_an_adapter_reuses_only_its_own_cached_prompts(
    tiny: LocalBackend, shapes: dict[str, torch.Tensor]
) -> None:
    engine = tiny.engine
    await engine.register_adapter("p", random_adapter(shapes, 5))
    prompt = (*OTHER, 77, 78, 79)
    await one(tiny, None, prompt)  # v0 keeps this prompt's keys
    hits = engine.prefix_cache.hits
    first = await one(tiny, "p", prompt)
    assert engine.prefix_cache.hits == hits  # the base's keys are not the adapter's
    assert close(await one(tiny, "p", prompt), first)  # its own, reused
    assert engine.prefix_cache.hits == hits + 1
    await engine.register_adapter("p", random_adapter(shapes, 6))  # new weights: its keys go
    await one(tiny, "p", prompt)
    assert engine.prefix_cache.hits == hits + 1


async def _budget_of(slots: int, tmp_path: Path, shapes: dict[str, torch.Tensor]) -> LocalBackend:
    probe = _backend(tmp_path / "probe")
    slot_bytes = probe.engine.adapter_stats().slot_bytes
    probe.engine.close()
    backend = _backend(tmp_path / "engine", adapter_memory_mb=slots * slot_bytes / 2**20)
    for i, key in enumerate("abc"):
        await backend.engine.register_adapter(key, random_adapter(shapes, 10 + i))
    return backend


async def test_the_budget_holds_and_the_least_recently_used_adapter_goes(
    tmp_path: Path, shapes: dict[str, torch.Tensor]
) -> None:
    backend = await _budget_of(2, tmp_path, shapes)
    engine = backend.engine
    try:
        stats = engine.adapter_stats()
        assert stats.slots == 2 and stats.registered == 3 and stats.resident_keys == ("a", "b")
        await one(backend, "a")
        await asyncio.wait_for(one(backend, "c"), 30)  # needs a slot: b, used least recently, goes
        stats = engine.adapter_stats()
        assert stats.resident_keys == ("a", "c") and stats.evictions == 1
        assert stats.resident_bytes <= stats.budget_bytes
        await asyncio.wait_for(one(backend, "b"), 30)
        assert engine.adapter_stats().resident_keys == ("c", "b")
    finally:
        engine.close()


async def test_an_adapter_a_running_request_uses_is_never_evicted(
    tmp_path: Path, shapes: dict[str, torch.Tensor]
) -> None:
    backend = await _budget_of(1, tmp_path, shapes)
    engine = backend.engine
    long = SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=())
    try:
        solo_a, solo_b = await one(backend, "a", params=long), await one(backend, "b")
        # the learner's own sampling (background): an admin job runs beside it, and finds a in use
        stream = backend.sample_stream(PROMPT, long, adapter="a", priority="background")
        first = await anext(stream)
        with pytest.raises(AdapterInUse):
            await engine.evict_adapter("a")
        # a user's request for b: the background row pauses and gives a's slot up, b runs, then
        # a takes its slot back and goes on as it would have alone
        assert close(await asyncio.wait_for(one(backend, "b"), 30), solo_b)
        rest = [chunk async for chunk in stream]
        tokens = first.tokens + tuple(t for c in rest for t in c.tokens)
        logprobs = first.logprobs + tuple(x for c in rest for x in c.logprobs)
        assert tokens == solo_a.tokens and logprobs == pytest.approx(solo_a.logprobs, abs=1e-4)
        assert engine.adapter_stats().resident_keys == ("a",)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["static", "bucketed"])
async def test_rows_on_different_adapters_in_the_slotted_cache_get_their_solo_logprobs(
    tmp_path: Path, shapes: dict[str, torch.Tensor], kind: str
) -> None:
    """The static cache, and its CUDA-graph shapes run eagerly on a CPU (free rows ride along)."""
    engine = Engine(models.resolve(models.TINY), data_dir=tmp_path, lora_rank=8, lora_alpha=8, threads=1,
                    static_cache=True, cuda_graphs=kind == "bucketed")
    engine.start()
    try:
        await engine.register_adapter("a", random_adapter(shapes, 1))
        await engine.register_adapter("b", random_adapter(shapes, 2))
        jobs = [("a", PROMPT), ("b", OTHER), (None, PROMPT)]

        async def run(key: str | None, prompt: tuple[int, ...]) -> Completion:
            return (await engine.sample(prompt, GREEDY, adapter=key))[0]

        alone = [await run(key, prompt) for key, prompt in jobs]
        together = await asyncio.gather(*(run(key, prompt) for key, prompt in jobs))
        for solo, mixed in zip(alone, together, strict=True):
            assert close(solo, mixed)
    finally:
        engine.close()


async def test_a_users_request_waits_for_the_slot_another_users_request_holds(
    tmp_path: Path, shapes: dict[str, torch.Tensor]
) -> None:
    """Two users' requests on two adapters with one slot: the second waits until the first ends
    (a running user's row is never paused, its adapter never evicted); both answer as alone."""
    backend = await _budget_of(1, tmp_path, shapes)
    engine = backend.engine
    long = SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=())
    try:
        solo_a, solo_b = await one(backend, "a", params=long), await one(backend, "b")
        stream = backend.sample_stream(PROMPT, long, adapter="a")
        first = await anext(stream)
        waiting = asyncio.ensure_future(one(backend, "b"))  # a's slot is a's until a ends
        rest = [chunk async for chunk in stream]
        assert first.tokens + tuple(t for c in rest for t in c.tokens) == solo_a.tokens
        assert close(await asyncio.wait_for(waiting, 30), solo_b)
        assert engine.adapter_stats().resident_keys == ("b",)
    finally:
        engine.close()
