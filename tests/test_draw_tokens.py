"""A decode step draws every row's token together (`sampling.draw_tokens`): each row gets the
token and logprob `draw_token` gives it alone, whatever its parameters."""

from __future__ import annotations

import torch
from clawbridge.local_gpu.sampling import draw_token, draw_tokens
from clawbridge.types import SamplingParams

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.3, top_logprobs=3),
    SamplingParams(temperature=1.0),
]


def test_each_row_gets_what_it_gets_alone():
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        logits = torch.randn(len(PARAMS), 4000, generator=g) * (1 + trial % 4)
        us = torch.rand(len(PARAMS), generator=g, dtype=torch.float64).tolist()
        together = draw_tokens(logits, PARAMS, us)
        alone = [draw_token(logits[i], p, us[i]) for i, p in enumerate(PARAMS)]
        assert [d.token for d in together] == [d.token for d in alone]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(together, alone, strict=True)) < 1e-6
        assert together[5].top == alone[5].top and together[5].top is not None


def test_plain_rows_draw_from_the_whole_distribution():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]] * 3)
    draws = draw_tokens(logits, [SamplingParams(temperature=1.0)] * 3, [0.1, 0.3, 0.9])
    assert [d.token for d in draws] == [0, 1, 3]  # quartiles of a uniform distribution
    assert all(abs(d.logprob - torch.log(torch.tensor(0.25)).item()) < 1e-6 for d in draws)
