"""The torch engine's slotted static KV cache (issue 17): each running request owns a row of a
preallocated cache, written in place at its own position. It must sample exactly what the dynamic
(left-padded, concatenated) cache samples, and `score` must reproduce its logprobs. Tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine, collect
from clawbridge.local_gpu.kvbatch import SlotBatch
from clawbridge.types import Completion, SamplingParams

G = torch.Generator().manual_seed(7)
PROMPTS = [tuple(torch.randint(100, 4000, (n,), generator=G).tolist()) for n in (8, 3, 250, 40, 17)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    threads = torch.get_num_threads()  # the engine's setting is process-wide: restored
    made = {static: Engine(models.resolve(models.TINY), data_dir=Path(tmp_path_factory.mktemp(f"s{static}")),
                           lora_rank=4, lora_alpha=8, threads=1, static_cache=static, max_batch=4)
            for static in (False, True)}
    for e in made.values():
        e.start()
    yield made
    for e in made.values():
        e.close()
    torch.set_num_threads(threads)


async def staggered(engine: Engine, jobs: list[tuple[tuple[int, ...], SamplingParams]]) -> list[Completion]:
    """Requests joining a batch that is already decoding, more of them than the batch has rows,
    finishing at different steps (rows leave from the middle of the batch)."""
    async def one(i: int, prompt: tuple[int, ...], params: SamplingParams) -> Completion:
        await asyncio.sleep(0.01 * i)
        return await collect(engine.sample_stream(prompt, params))

    return list(await asyncio.gather(*(one(i, p, params) for i, (p, params) in enumerate(jobs))))


def jobs(temperature: float) -> list[tuple[tuple[int, ...], SamplingParams]]:
    return [(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=6 + 5 * (i % 4), temperature=temperature,
                                                       seed=40 + i, stop_token_ids=()))
            for i in range(7)]


def test_a_step_writes_each_row_at_its_own_position_and_masks_the_rest():
    from transformers import DynamicCache

    batch = SlotBatch(slots=3, max_length=1024)
    for n in (2, 5):
        k = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1) + 10 * n
        batch.add(DynamicCache(ddp_cache_data=[(k, k.clone())]), n, next_token=n)
    inputs = batch.step_inputs()
    assert inputs["position_ids"].tolist() == [[2], [5]] and batch.capacity == SlotBatch.MIN_LENGTH
    mask = inputs["attention_mask"][:, 0, 0]
    assert (mask[0, :3] == 0).all() and (mask[0, 3:] < -1e30).all() and (mask[1, :6] == 0).all()
    keys, _ = batch.update(torch.tensor([[[[-1.0]]], [[[-2.0]]]]), torch.zeros(2, 1, 1, 1), 0)
    assert keys.shape == (2, 1, 6, 1)
    assert keys[0, 0, :3, 0].tolist() == [20, 21, -1] and keys[1, 0, :6, 0].tolist() == [50, 51, 52, 53, 54, -2]
    batch.advance([7, 8])
    batch.keep([1])  # the second row moves into the first
    assert batch.positions == [6] and batch.keys[0][0, 0, :6, 0].tolist() == [50, 51, 52, 53, 54, -2]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
async def test_the_static_cache_samples_what_the_dynamic_cache_samples(engines, temperature: float):
    dynamic = await staggered(engines[False], jobs(temperature))
    static = await staggered(engines[True], jobs(temperature))
    for a, b in zip(dynamic, static, strict=True):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


async def test_score_reproduces_what_the_static_cache_sampled(engines):
    engine = engines[True]
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s, stop_token_ids=()) for s in range(4)]
    done = await staggered(engine, [(PROMPTS[i], p) for i, p in enumerate(params)])
    for i, c in enumerate(done):
        scored = await engine.score(PROMPTS[i], c.tokens, model="base", temperature=0.8)
        assert max(abs(x - y) for x, y in zip(scored, c.logprobs, strict=True)) < 2e-4
