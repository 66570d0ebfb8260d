"""Prompts admitted together are prefilled in one forward (`prefill.Prefill`): right-aligned, each
continuing its own cached prefix, padded on the left. It must change nothing but the time: every
row's next-token logits and cache equal its prompt's forward alone (a shorter prompt's padding
never reaches a real row), and the engine's greedy answers to requests sent at once equal each
one's answer alone, on both decode batches."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine, collect
from clawbridge.local_gpu.kvbatch import KVBatch
from clawbridge.local_gpu.kvcache import CACHE, cache_of
from clawbridge.local_gpu.prefill import prefill
from clawbridge.local_gpu.slotbatch import SlotBatch
from clawbridge.types import SamplingParams
from transformers import DynamicCache

G = torch.Generator().manual_seed(7)
SHARED = tuple(torch.randint(100, 4000, (24,), generator=G).tolist())


def _tokens(n: int) -> tuple[int, ...]:
    return tuple(torch.randint(100, 4000, (n,), generator=G).tolist())


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return models.load_model(models.resolve(models.TINY))


def _alone(model: torch.nn.Module, prompt: tuple[int, ...]) -> tuple[torch.Tensor, DynamicCache]:
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cache_of(out)


def _prefix(model: torch.nn.Module, prompt: tuple[int, ...], n: int) -> DynamicCache:
    """The cache of `prompt`'s first `n` tokens, as the prefix cache would hand it out."""
    _, cache = _alone(model, prompt[:n])
    return DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in cache.layers])


def test_each_row_of_a_prefill_together_equals_its_prompt_alone(model: torch.nn.Module) -> None:
    # lengths 31, 9, 40, 30: one shorter than the others' new tokens (left padded in the forward),
    # two continuing cached prefixes of different lengths, one with nothing cached
    prompts = [SHARED + _tokens(7), _tokens(9), SHARED + _tokens(16), _tokens(30)]
    cached = [_prefix(model, prompts[0], 24), None, _prefix(model, prompts[2], 30), None]
    layout = prefill(prompts, cached, device="cpu", mask_dtype=torch.float32)
    assert "attention_mask" in layout.inputs  # something is padded: the 4-D mask goes in
    with torch.inference_mode():
        out = model(**layout.inputs, use_cache=True, logits_to_keep=1)
    cache = cache_of(out)
    assert torch.isfinite(out.logits).all()
    for i, prompt in enumerate(prompts):
        logits, alone = _alone(model, prompt)
        torch.testing.assert_close(out.logits[i, -1], logits, atol=1e-4, rtol=1e-4)
        row = layout.row_cache(cache, i)
        for got, want in zip(row.layers, alone.layers, strict=True):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=1e-4)
        assert int(layout.mask[i].sum()) == len(prompt)


def test_one_prompt_unpadded_is_its_plain_forward(model: torch.nn.Module) -> None:
    prompt = SHARED + _tokens(5)
    layout = prefill([prompt], [_prefix(model, prompt, 24)], device="cpu", mask_dtype=torch.float32)
    assert "attention_mask" not in layout.inputs and layout.inputs["input_ids"].shape == (1, 5)
    assert layout.inputs["position_ids"].tolist() == [list(range(24, 29))]
    with torch.inference_mode():
        out = model(**layout.inputs, use_cache=True, logits_to_keep=1)
    assert layout.row_cache(cache_of(out), 0) is cache_of(out)  # nothing to copy


@pytest.mark.parametrize("batch", ["dynamic", "static"])
def test_rows_prefilled_together_decode_on_as_each_alone(model: torch.nn.Module, batch: str) -> None:
    """The rows join a decode batch (`add_rows`, with a repeated prompt) and the next step's
    logits equal each prompt's own next step."""
    prompts = [_tokens(12), SHARED + _tokens(3), _tokens(20)]
    layout = prefill(prompts, [None, _prefix(model, prompts[1], 24), None], device="cpu",
                     mask_dtype=torch.float32)
    with torch.inference_mode():
        out = model(**layout.inputs, use_cache=True, logits_to_keep=1)
        rows = [0, 1, 2, 1]
        nexts = [int(out.logits[r, -1].argmax()) for r in rows]
        kv: KVBatch | SlotBatch = KVBatch() if batch == "dynamic" else SlotBatch(4, 512)
        kv.add_rows(*layout.take(cache_of(out), rows), nexts)
        if isinstance(kv, KVBatch):
            step = model(**kv.step_inputs(), use_cache=True).logits[:, -1]
        else:
            step = kv.step(lambda inputs: model(**inputs, use_cache=True).logits[:, -1], None)
        for j, r in enumerate(rows):
            ids = torch.tensor([[*prompts[r], nexts[j]]])
            want = model(input_ids=ids).logits[0, -1]
            torch.testing.assert_close(step[j], want, atol=1e-4, rtol=1e-4)
    assert CACHE in layout.inputs


def _engine(data_dir: Path, **kw: object) -> Engine:
    engine = Engine(models.resolve(models.TINY), data_dir=data_dir, lora_rank=4, lora_alpha=8, threads=1,
                    max_batch=8, **kw)  # type: ignore[arg-type]
    engine.start()
    return engine


@pytest.mark.parametrize("static", [False, True])
def test_requests_sent_at_once_answer_as_each_alone(
    tmp_path: Path, static: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy answers and their logprobs: the requests at once (prefilled together, one of them
    twice, two sharing a cached prefix) against the same requests one at a time."""
    caplog.set_level(logging.DEBUG, logger="clawbridge.local_gpu.decoding")
    greedy = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=())
    prompts = [SHARED + _tokens(6), _tokens(5), SHARED + _tokens(11), _tokens(17)]
    prompts.append(prompts[1])

    async def run(engine: Engine, together: bool) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        await collect(engine.sample_stream(SHARED + _tokens(2), greedy))  # the shared prefix cached
        if together:
            outs = await asyncio.gather(*(collect(engine.sample_stream(p, greedy)) for p in prompts))
        else:
            outs = [await collect(engine.sample_stream(p, greedy)) for p in prompts]
        return [(tuple(o.tokens), tuple(o.logprobs)) for o in outs]

    answers = {}
    for together in (False, True):
        engine = _engine(tmp_path / f"{together}", static_cache=static)
        try:
            answers[together] = asyncio.run(run(engine, together))
            if together:
                assert engine.prefix_cache.hits >= 2  # the two prompts on the shared prefix used it
                together_sizes = [int(r.args[0]) for r in caplog.records  # type: ignore[index]
                                  if r.getMessage().startswith("prefill:")]
                assert max(together_sizes) >= 2, together_sizes  # some forward prefilled several
        finally:
            engine.close()
    for (tokens_t, lp_t), (tokens_a, lp_a) in zip(answers[True], answers[False], strict=True):
        assert tokens_t == tokens_a
        assert lp_t == pytest.approx(lp_a, abs=1e-4)
