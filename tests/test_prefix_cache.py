"""The torch engine's prefix KV cache (issue 16): a prompt that shares a prefix with a recent one
prefills only the rest. It must change nothing but the time: greedy output equals greedy output
without it, sampled logprobs equal what `score` returns, a request that hits it joins a running
batch like any other, and a version's entries serve only that version's requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine, collect
from clawbridge.local_gpu.prefixcache import PrefixCache
from clawbridge.types import Completion, Datum, LossSpec, OptimSpec, SamplingParams
from transformers import DynamicCache

G = torch.Generator().manual_seed(16)
SHARED = tuple(torch.randint(100, 4000, (300,), generator=G).tolist())
FIRST = SHARED + tuple(torch.randint(100, 4000, (40,), generator=G).tolist())
SECOND = SHARED + tuple(torch.randint(100, 4000, (30,), generator=G).tolist())
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=())


def _engine(data_dir: Path, **kw: object) -> Engine:
    engine = Engine(
        models.resolve(models.TINY),
        data_dir=data_dir,
        lora_rank=4,
        lora_alpha=8,
        threads=1,
        max_batch=4,
        **kw,  # type: ignore[arg-type]
    )
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    """Each mode with the cache, and the dynamic one without it (the reference)."""
    threads = torch.get_num_threads()  # the engine's setting is process-wide: restored
    made = {
        "dynamic": _engine(tmp_path_factory.mktemp("dynamic")),
        "static": _engine(tmp_path_factory.mktemp("static"), static_cache=True),
        "off": _engine(tmp_path_factory.mktemp("off"), prefix_cache_mb=0),
        "dynamic-bf16": _engine(tmp_path_factory.mktemp("dynamic-bf16"), dtype=torch.bfloat16),
        "static-bf16": _engine(
            tmp_path_factory.mktemp("static-bf16"), static_cache=True, dtype=torch.bfloat16
        ),
        "off-bf16": _engine(
            tmp_path_factory.mktemp("off-bf16"), prefix_cache_mb=0, dtype=torch.bfloat16
        ),
    }
    yield made
    for e in made.values():
        e.close()
    torch.set_num_threads(threads)


async def _sample(engine: Engine, prompt: tuple[int, ...], params: SamplingParams) -> Completion:
    return await collect(engine.sample_stream(prompt, params))


def _cache(length: int, fill: float = 0.0) -> DynamicCache:
    """A two-layer cache of `length` positions, 1 KiB a layer's keys and values per 64 positions."""
    k = torch.full((1, 1, length, 2), fill)
    return DynamicCache(ddp_cache_data=[(k, k.clone()), (k.clone(), k.clone())])


def test_the_longest_shared_prefix_on_the_same_version_is_reused() -> None:
    cache = PrefixCache(1 << 20)
    cache.store(1, (1, 2, 3, 4, 5), _cache(5, 1.0))
    cache.store(1, (1, 2, 9, 9), _cache(4, 2.0))
    cache.store(2, (1, 2, 3, 4, 5, 6), _cache(6, 3.0))
    hit = cache.lookup(1, (1, 2, 3, 4, 7, 7))
    assert hit is not None and hit.get_seq_length() == 4
    assert bool((hit.layers[0].keys == 1.0).all())  # the first entry's keys, not version 2's
    assert cache.lookup(1, (8, 1, 2)) is None  # nothing shared
    assert cache.lookup(3, (1, 2, 3)) is None  # no entry of that version


def test_a_prompt_equal_to_an_entry_still_prefills_its_last_token() -> None:
    cache = PrefixCache(1 << 20)
    cache.store(0, (1, 2, 3), _cache(3))
    hit = cache.lookup(0, (1, 2, 3))
    assert hit is not None and hit.get_seq_length() == 2


def test_the_least_recently_used_entry_leaves_first_and_the_budget_holds() -> None:
    one = sum(k.nbytes + v.nbytes for k, v in ((x.keys, x.values) for x in _cache(8).layers))
    cache = PrefixCache(2 * one)
    cache.store(0, (1,) * 8, _cache(8))
    cache.store(0, (2,) * 8, _cache(8))
    assert cache.lookup(0, (1,) * 9) is not None  # the first is now the most recently used
    cache.store(0, (3,) * 8, _cache(8))
    assert cache.used <= cache.budget and len(cache) == 2
    assert cache.lookup(0, (2,) * 9) is None  # evicted
    assert cache.lookup(0, (1,) * 9) is not None
    cache.store(0, (4,) * 100, _cache(100))  # larger than the whole budget: not kept
    assert len(cache) == 2 and cache.lookup(0, (4,) * 100) is None


def test_an_entry_that_a_new_prompt_extends_is_replaced_by_it() -> None:
    cache = PrefixCache(1 << 20)
    cache.store(0, (1, 2, 3), _cache(3))
    cache.store(0, (1, 2, 3, 4, 5), _cache(5))
    assert len(cache) == 1


def test_a_zero_budget_keeps_nothing() -> None:
    cache = PrefixCache(0)
    cache.store(0, (1, 2, 3), _cache(3))
    assert len(cache) == 0 and cache.lookup(0, (1, 2, 3, 4)) is None


@pytest.mark.parametrize("mode", ["dynamic", "static", "dynamic-bf16", "static-bf16"])
async def test_greedy_output_with_the_cache_equals_greedy_output_without(engines, mode: str):
    engine, off = engines[mode], engines["off-bf16" if mode.endswith("bf16") else "off"]
    tolerance = 1e-2 if mode.endswith("bf16") else 1e-4  # bf16: the tail's rounding differs
    for prompt in (FIRST, SECOND):
        reused = engine.prefix_cache.tokens_reused
        with_cache = await _sample(engine, prompt, GREEDY)
        without = await _sample(off, prompt, GREEDY)
        assert with_cache.tokens == without.tokens
        assert (
            max(abs(x - y) for x, y in zip(with_cache.logprobs, without.logprobs, strict=True))
            < tolerance
        )
    assert engine.prefix_cache.tokens_reused - reused >= len(SHARED)  # SECOND hit the cache
    assert len(off.prefix_cache) == 0


@pytest.mark.parametrize("mode", ["dynamic", "static"])
async def test_score_reproduces_what_a_cache_hit_sampled(engines, mode: str):
    engine = engines[mode]
    await _sample(engine, FIRST, SamplingParams(max_tokens=1))
    hits = engine.prefix_cache.hits
    c = await _sample(engine, SECOND, SamplingParams(max_tokens=16, temperature=0.8, seed=4))
    assert engine.prefix_cache.hits == hits + 1
    scored = await engine.score(SECOND, c.tokens, temperature=0.8)
    assert max(abs(x - y) for x, y in zip(scored, c.logprobs, strict=True)) < 2e-4


@pytest.mark.parametrize("mode", ["dynamic", "static"])
async def test_a_request_that_hits_the_cache_joins_a_running_batch(engines, mode: str):
    engine, off = engines[mode], engines["off"]
    long = SamplingParams(max_tokens=40, temperature=0.8, seed=21, stop_token_ids=())
    short = SamplingParams(max_tokens=10, temperature=0.8, seed=22, stop_token_ids=())
    third = (*SHARED[:200], 7, 8, 9)
    alone = [await _sample(off, FIRST, long), await _sample(off, third, short)]
    await _sample(engine, SECOND, SamplingParams(max_tokens=1))  # the shared prefix is cached

    async def later() -> Completion:
        await asyncio.sleep(0.05)  # join the batch FIRST is decoding in
        return await _sample(engine, third, short)

    hits = engine.prefix_cache.hits
    together = await asyncio.gather(_sample(engine, FIRST, long), later())
    assert engine.prefix_cache.hits >= hits + 2
    for a, b in zip(alone, together, strict=True):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


async def test_a_new_version_never_reuses_an_old_versions_entries(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    engine = _engine(tmp_path)
    try:
        first = await _sample(engine, FIRST, SamplingParams(max_tokens=6, seed=3))
        assert engine.prefix_cache.versions() == [0]
        datum = Datum(FIRST, first.tokens, first.logprobs, (1.0,) * len(first.tokens))
        await engine.train_step([datum], LossSpec(), OptimSpec(learning_rate=1e-2))
        published = await engine.publish()
        # v0 is served to nobody now: its entries went with it
        assert engine.prefix_cache.versions() == []
        hits = engine.prefix_cache.hits
        c = await _sample(engine, SECOND, SamplingParams(max_tokens=8, temperature=0.8, seed=5))
        assert c.version == published.version and engine.prefix_cache.hits == hits
        assert engine.prefix_cache.versions() == [published.version]
        again = await _sample(engine, FIRST, SamplingParams(max_tokens=8, temperature=0.8, seed=6))
        assert engine.prefix_cache.hits == hits + 1  # on v1's own entry
        for prompt, done in ((SECOND, c), (FIRST, again)):
            scored = await engine.score(prompt, done.tokens, temperature=0.8)
            assert max(abs(x - y) for x, y in zip(scored, done.logprobs, strict=True)) < 2e-4
    finally:
        engine.close()
        torch.set_num_threads(threads)


async def test_the_embedded_model_greedy_equals_with_and_without_the_cache(tmp_path: Path):
    threads = torch.get_num_threads()
    spec = models.resolve(models.EMBEDDED)
    on, off = (
        Engine(spec, data_dir=tmp_path / name, lora_rank=4, lora_alpha=4, threads=1, **kw)  # type: ignore[arg-type]
        for name, kw in (("on", {}), ("off", {"prefix_cache_mb": 0}))
    )
    on.start()
    off.start()
    try:
        tok = on.tokenizer
        story = " ".join(f"Room {i} holds a {c} box." for i, c in enumerate(["red", "blue"] * 40))

        def prompt(question: str) -> tuple[int, ...]:
            messages = [
                {"role": "system", "content": f"You answer from this list. {story}"},
                {"role": "user", "content": question},
            ]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            return tuple(int(t) for t in ids)

        a, b = prompt("What colour is the box in room 3?"), prompt("Which room has box 7?")
        shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        assert shared > 500 and len(b) - shared < 30
        params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=())
        await _sample(on, a, params)
        reused = on.prefix_cache.tokens_reused
        hit, cold = await _sample(on, b, params), await _sample(off, b, params)
        assert on.prefix_cache.tokens_reused - reused == shared
        assert hit.tokens == cold.tokens
        assert max(abs(x - y) for x, y in zip(hit.logprobs, cold.logprobs, strict=True)) < 1e-4
        scored = await on.score(b, hit.tokens, temperature=1.0)
        assert max(abs(x - y) for x, y in zip(scored, hit.logprobs, strict=True)) < 2e-4
    finally:
        on.close()
        off.close()
        torch.set_num_threads(threads)


def test_the_setting_reaches_the_engine(tmp_path: Path) -> None:
    from clawbridge.backends.local import LocalBackend
    from clawbridge.config import Settings

    def budget(**kw: object) -> int:
        settings = Settings(model="tiny-random", data_dir=tmp_path, **kw)  # type: ignore[arg-type]
        return LocalBackend.from_settings(settings).engine._prefixes.budget

    assert budget() == 2048 << 20
    assert budget(prefix_cache_mb=0) == 0
