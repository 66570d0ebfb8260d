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
from clawbridge.local_gpu.kvcache import CACHE
from clawbridge.local_gpu.slotbatch import SlotBatch
from clawbridge.types import Completion, SamplingParams

G = torch.Generator().manual_seed(7)
PROMPTS = [tuple(torch.randint(100, 4000, (n,), generator=G).tolist()) for n in (8, 3, 250, 40, 17)]


def _engine(data_dir: Path, **kw: object) -> Engine:
    """The tiny model's engine: four rows, one thread (the fixture's and the tests' own)."""
    return Engine(models.resolve(models.TINY), data_dir=data_dir, lora_rank=4, lora_alpha=8, threads=1,
                  max_batch=4, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    threads = torch.get_num_threads()  # the engine's setting is process-wide: restored
    # "bucketed": the CUDA-graph shapes (power-of-two rows, every allocated column, fixed input
    # buffers) run eagerly, as they do on a CPU; only the capture itself needs CUDA
    modes = {"dynamic": {}, "static": {"static_cache": True}, "bucketed": {"cuda_graphs": True}}
    made = {mode: _engine(Path(tmp_path_factory.mktemp(mode)), **kw) for mode, kw in modes.items()}
    for e in made.values():
        e.start()
    yield made
    for e in made.values():
        e.close()
    torch.set_num_threads(threads)


async def staggered(
    engine: Engine, jobs: list[tuple[tuple[int, ...], SamplingParams]]
) -> list[Completion]:
    """Requests joining a batch that is already decoding, more of them than the batch has rows,
    finishing at different steps (rows leave from the middle of the batch)."""

    async def one(i: int, prompt: tuple[int, ...], params: SamplingParams) -> Completion:
        await asyncio.sleep(0.01 * i)
        return await collect(engine.sample_stream(prompt, params))

    return list(await asyncio.gather(*(one(i, p, params) for i, (p, params) in enumerate(jobs))))


def jobs(temperature: float) -> list[tuple[tuple[int, ...], SamplingParams]]:
    return [
        (
            PROMPTS[i % len(PROMPTS)],
            SamplingParams(
                max_tokens=6 + 5 * (i % 4), temperature=temperature, seed=40 + i, stop_token_ids=()
            ),
        )
        for i in range(7)
    ]


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_a_step_writes_each_row_at_its_own_position_and_masks_the_rest(bucketed: bool):
    from transformers import DynamicCache

    batch = SlotBatch(slots=4, max_length=1024, bucketed=bucketed)
    for n in (2, 5, 3):
        k = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1) + 10 * n
        batch.add_rows(DynamicCache(ddp_cache_data=[(k, k.clone())]), None, [n], [n])
    seen: dict[str, torch.Tensor] = {}

    def forward(inputs: dict) -> torch.Tensor:  # one attention layer's view of the step
        rows = inputs["input_ids"].shape[0]
        new = -torch.arange(1, rows + 1, dtype=torch.float32).view(rows, 1, 1, 1)
        seen["keys"], _ = inputs[CACHE].update(new, torch.zeros(rows, 1, 1, 1), 0)
        seen["mask"], seen["positions"] = inputs["attention_mask"][:, 0, 0], inputs["position_ids"]
        return torch.zeros(rows, 7)

    assert batch.step(forward, None).shape == (3, 7)  # only the live rows' logits
    keys, mask = seen["keys"], seen["mask"]
    width = batch.capacity if bucketed else 6
    assert batch.capacity == SlotBatch.MIN_LENGTH and keys.shape == (
        4 if bucketed else 3,
        1,
        width,
        1,
    )
    assert seen["positions"].view(-1).tolist() == ([2, 5, 3, 0] if bucketed else [2, 5, 3])
    assert keys[0, 0, :3, 0].tolist() == [20, 21, -1] and keys[1, 0, :6, 0].tolist() == [
        50,
        51,
        52,
        53,
        54,
        -2,
    ]
    assert (mask[0, :3] == 0).all() and (mask[0, 3:] < -1e30).all() and (mask[1, :6] == 0).all()
    if bucketed:  # the free row rides along on its own column 0, attending only to it
        assert keys[3, 0, 0, 0] == -4 and (mask[3, 1:] < -1e30).all()
    batch.advance([7, 8, 9])
    batch.keep([1, 2])  # the first row finished: the others move down
    assert batch.positions == [6, 4] and batch.keys[0][0, 0, :6, 0].tolist() == [
        50,
        51,
        52,
        53,
        54,
        -2,
    ]
    assert batch.keys[0][1, 0, :4, 0].tolist() == [30, 31, 32, -3]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
async def test_the_static_cache_samples_what_the_dynamic_cache_samples(engines, temperature: float):
    dynamic = await staggered(engines["dynamic"], jobs(temperature))
    for mode in ("static", "bucketed"):
        static = await staggered(engines[mode], jobs(temperature))
        for a, b in zip(dynamic, static, strict=True):
            assert a.tokens == b.tokens, mode
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4, mode


@pytest.mark.parametrize("mode", ["static", "bucketed"])
async def test_score_reproduces_what_the_static_cache_sampled(engines, mode: str):
    engine = engines[mode]
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s, stop_token_ids=())
        for s in range(4)
    ]
    done = await staggered(engine, [(PROMPTS[i], p) for i, p in enumerate(params)])
    for i, c in enumerate(done):
        scored = await engine.score(PROMPTS[i], c.tokens, model="base", temperature=0.8)
        assert max(abs(x - y) for x, y in zip(scored, c.logprobs, strict=True)) < 2e-4


async def test_a_bucketed_step_with_rows_on_two_versions_runs_each_on_its_own(tmp_path: Path):
    """Three rows on two adapters ride a four-row bucketed step (the mixed-adapter path, never
    captured): the padding row needs an adapter too. Each row samples what it samples alone."""
    from clawbridge.types import Datum, LossSpec, OptimSpec

    engine = _engine(tmp_path, cuda_graphs=True)
    engine.start()
    try:
        batch = [Datum(PROMPTS[0], (5, 6, 7), (-11.0, -10.0, -10.5), (1.0, -1.0, 0.5))]
        await engine.train_step(batch, LossSpec(), OptimSpec(learning_rate=5e-2))
        v1 = (await engine.publish()).version
        params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=())
        rows = [(PROMPTS[0], 0), (PROMPTS[1], v1), (PROMPTS[3], 0)]
        together = await asyncio.gather(
            *(collect(engine.sample_stream(p, params, version=v)) for p, v in rows)
        )
        for (prompt, version), c in zip(rows, together, strict=True):
            alone = await collect(engine.sample_stream(prompt, params, version=version))
            assert c.version == version
            assert c.tokens == alone.tokens
    finally:
        engine.close()
