"""The torch engine's slotted static cache with CUDA graphs, on a GPU (skipped without CUDA): the
captured decode samples what the dynamic cache samples, `score` reproduces its logprobs, and a
publish in the middle of a stream keeps each request on its version (graphs are recorded per
adapter, and a slot refilled in place is read by the graph that captured it)."""

from __future__ import annotations

import asyncio

import pytest
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine, collect
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [(1, 504, 3136, 28, 17), (1, 2201, 28), tuple(range(300, 560))]


async def many(engine: Engine, temperature: float, version: int | None = None):
    async def one(i: int):
        await asyncio.sleep(0.005 * i)
        params = SamplingParams(
            max_tokens=8 + 4 * (i % 3), temperature=temperature, seed=i, stop_token_ids=()
        )
        return await collect(engine.sample_stream(PROMPTS[i % 3], params, version=version))

    return await asyncio.gather(*(one(i) for i in range(6)))


async def test_cuda_graph_decode_samples_what_the_dynamic_cache_samples(tiny_dir, tmp_path):
    engines = {
        mode: Engine(
            models.resolve(tiny_dir),
            data_dir=tmp_path / mode,
            lora_rank=8,
            lora_alpha=16,
            device="cuda",
            max_batch=4,
            **kw,
        )
        for mode, kw in (("dynamic", {}), ("graphs", {"cuda_graphs": True}))
    }
    for e in engines.values():
        e.start()
    try:
        for temperature in (0.0, 0.9):
            a, b = (
                await many(engines["dynamic"], temperature),
                await many(engines["graphs"], temperature),
            )
            for x, y in zip(a, b, strict=True):
                assert x.tokens == y.tokens
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-3
        graphs = engines["graphs"]
        for i, c in enumerate(await many(graphs, 0.8)):
            assert await graphs.score(
                PROMPTS[i % 3], c.tokens, model="base", temperature=0.8
            ) == pytest.approx(list(c.logprobs), abs=1e-3)
        # a publish while requests stream on v0: they finish on v0, new ones run on v1
        first = asyncio.ensure_future(many(graphs, 0.9))
        await asyncio.sleep(0.01)
        batch = [Datum(PROMPTS[0], (5, 6, 7), (-11.0, -10.0, -10.5), (1.0, -1.0, 0.5))]
        await graphs.train_step(batch, LossSpec(), OptimSpec(learning_rate=5e-2))
        v1 = await graphs.publish()
        for c in await first:
            assert c.version in (0, v1.version)
        after = await many(graphs, 0.8)
        assert {c.version for c in after} == {v1.version}
        for i, c in enumerate(after):
            assert await graphs.score(PROMPTS[i % 3], c.tokens, temperature=0.8) == pytest.approx(
                list(c.logprobs), abs=1e-3
            )
    finally:
        for e in engines.values():
            e.close()
