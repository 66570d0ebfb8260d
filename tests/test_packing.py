"""Sequence packing for the trainer: samples laid end to end in one row, positions restarting per
sample, and transformers' packed-sequence mask keeping them apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine
from clawbridge.local_gpu.packing import pack, packed_micro_batches
from clawbridge.types import Datum


def datum(prompt: list[int], completion: list[int], temperature: float = 1.0) -> Datum:
    n = len(completion)
    return Datum(tuple(prompt), tuple(completion), (-1.0,) * n, (1.0,) * n, temperature=temperature)


def test_pack_lays_samples_end_to_end_and_keeps_the_positions_that_predict_completions():
    p = pack([datum([5, 6], [7, 8]), datum([9], [10, 11, 12])])
    assert p.ids == [5, 6, 7, 8, 9, 10, 11, 12]
    assert p.positions == [0, 1, 2, 3, 0, 1, 2, 3]
    # position t predicts token t + 1: the first sample's completion is predicted from 1 and 2
    assert p.keep == [1, 2, 4, 5, 6]
    assert p.targets == [7, 8, 10, 11, 12]


def test_rows_fill_up_to_the_longest_sample_first_fit_by_decreasing_length(
    monkeypatch: pytest.MonkeyPatch,
):
    from clawbridge.local_gpu import packing

    monkeypatch.setattr(packing, "MIN_ROW", 1)
    lengths = [57, 113, 170, 227, 284, 341, 398, 455]  # 1 : 2 : ... : 8
    batch = [datum([1] * (n - n // 2), [2] * (n // 2)) for n in lengths]
    rows = [
        [len(d.prompt_ids) + len(d.completion_ids) for d in row]
        for row in packed_micro_batches(batch, 4096)
    ]
    assert rows == [[455], [398, 57], [341, 113], [284, 170], [227]]
    assert packed_micro_batches(batch, 300)[0] == [batch[-1]]  # longer than the budget: alone


def test_short_samples_share_a_row_of_at_least_min_row_tokens():
    batch = [datum([1] * 10, [2] * 10) for _ in range(30)]  # 600 tokens of 20-token samples
    assert [len(r) for r in packed_micro_batches(batch, 4096)] == [12, 12, 6]  # 256 // 20 = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    e = Engine(
        models.resolve(models.TINY), data_dir=Path(tmp_path_factory.mktemp("pack")), lora_rank=8
    )
    e.start()
    yield e
    e.close()


async def test_packed_logprobs_equal_each_sample_scored_alone(engine: Engine):
    """No token attends across samples: a packed forward gives every sample the logprobs it gets
    alone (the engine's `score` runs one unpadded sequence), at each sample's temperature."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 4000, (n,), generator=g).tolist()

    group = [datum(ids(7), ids(5)), datum(ids(31), ids(2), temperature=0.7), datum(ids(1), ids(12))]
    packed = await engine._call(engine._batch_logprobs, group)
    alone = []
    for d in group:
        alone += await engine.score(
            d.prompt_ids, d.completion_ids, model="base", temperature=d.temperature
        )
    assert packed.shape == (19,)
    assert torch.allclose(packed.detach(), torch.tensor(alone), atol=1e-5)


def test_stack_pads_each_row_with_a_segment_of_its_own_and_indexes_the_flat_positions():
    from clawbridge.local_gpu.packing import stack

    s = stack([[datum([5, 6], [7, 8]), datum([9], [10])], [datum([3], [4])]])
    assert s.ids == [[5, 6, 7, 8, 9, 10], [3, 4, 0, 0, 0, 0]]
    assert s.positions == [[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 2, 3]]
    assert s.keep == [1, 2, 4, 6]  # row 1's completion is predicted from flat position 6 + 0
    assert s.targets == [7, 8, 10, 4]


def test_rows_stack_while_rows_times_the_longest_stay_within_the_budget():
    from clawbridge.local_gpu.packing import stacked_micro_batches

    # 200-token samples: one per 256-token row
    batch = [datum([1] * 100, [2] * 100) for _ in range(5)]
    assert [len(f) for f in stacked_micro_batches(batch, 600)] == [3, 2]
    # a row alone may exceed the budget
    assert [len(f) for f in stacked_micro_batches(batch, 100)] == [1] * 5


async def test_stacked_rows_give_each_sample_its_logprobs_alone(engine: Engine):
    """Rows of unequal length stacked into one forward (the FSDP trainer's micro-batch): the
    padding segment changes no sample's logprobs."""
    from clawbridge.local_gpu.packing import stack
    from clawbridge.loss import token_logprobs

    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 4000, (n,), generator=g).tolist()

    rows = [[datum(ids(9), ids(4)), datum(ids(3), ids(6))], [datum(ids(5), ids(2))]]
    s = stack(rows)

    def forward() -> torch.Tensor:
        with torch.no_grad(), engine._model.disable_adapter():
            out = engine._model(
                input_ids=torch.tensor(s.ids),
                position_ids=torch.tensor(s.positions),
                use_cache=False,
            )
        flat = out.logits.reshape(-1, out.logits.shape[-1])[torch.tensor(s.keep)]
        return token_logprobs(flat, torch.tensor(s.targets))

    stacked = await engine._call(forward)
    alone = []
    for row in rows:
        for d in row:
            alone += await engine.score(d.prompt_ids, d.completion_ids, model="base")
    assert torch.allclose(stacked, torch.tensor(alone), atol=1e-5)
