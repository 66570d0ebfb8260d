"""The torch engine behind the `local` backend: sampling parameters, continuous batching,
streaming, versions and the context limit, on the tiny model; one reply from the real one."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.local_gpu import adapters, models, precision
from clawbridge.protocol import BackendError, ContextLengthExceeded
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams

PROMPT = (1, 520, 3121, 28, 1830, 446, 17, 905)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    # one intra-op thread: the tiny model gains nothing from more, and on shared CI cores a
    # second spinning thread costs several times the work (the setting is process-wide: restored)
    threads = torch.get_num_threads()
    backend = LocalBackend(
        "tiny-random", tmp_path_factory.mktemp("engine"), lora_rank=8, lora_alpha=8, threads=1
    )
    backend.engine.start()  # the engine is loop-agnostic: one instance serves every test's loop
    yield backend
    backend.engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model in bf16 (what `engine_dtype=auto` picks on a CPU with native bf16). No
    prefix cache: a hit's tail rounds differently in bf16 (~1e-3), and the random model's nearly
    flat distribution puts 49 K draw boundaries 2e-5 apart, so a seeded draw would move to a
    neighbouring id; tests/test_prefix_cache.py holds greedy output with the cache in bf16."""
    threads = torch.get_num_threads()
    backend = LocalBackend(
        "tiny-random", tmp_path_factory.mktemp("engine-bf16"), lora_rank=8, lora_alpha=8,
        threads=1, engine_dtype="bf16", prefix_cache_mb=0,
    )
    backend.engine.start()
    yield backend
    backend.engine.close()
    torch.set_num_threads(threads)


async def one(backend: LocalBackend, params: SamplingParams, prompt: tuple[int, ...] = PROMPT):
    (completion,) = await backend.sample(prompt, params)
    return completion


async def test_max_tokens_ends_generation_with_length(tiny: LocalBackend) -> None:
    c = await one(tiny, SamplingParams(max_tokens=7, seed=1, stop_token_ids=()))
    assert len(c.tokens) == len(c.logprobs) == 7
    assert c.finish_reason == "length"


async def test_same_seed_gives_same_tokens_and_other_seeds_differ(tiny: LocalBackend) -> None:
    a = await one(tiny, SamplingParams(max_tokens=12, seed=5))
    b = await one(tiny, SamplingParams(max_tokens=12, seed=5))
    c = await one(tiny, SamplingParams(max_tokens=12, seed=6))
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens


async def test_top_k_one_equals_greedy(tiny: LocalBackend) -> None:
    greedy = await one(tiny, SamplingParams(max_tokens=10, temperature=0.0))
    top1 = await one(tiny, SamplingParams(max_tokens=10, temperature=0.9, top_k=1, seed=3))
    assert top1.tokens == greedy.tokens
    # the recorded logprob is untruncated: under T=0.9 it is not 0 even though top_k=1
    assert all(lp < 0 for lp in top1.logprobs)


async def test_stop_string_ends_on_the_token_that_completes_it(tiny: LocalBackend) -> None:
    tok = tiny.tokenizer()
    free = await one(tiny, SamplingParams(max_tokens=30, seed=9, stop_token_ids=()))
    # a stop string made of the tail of a plain-ASCII token some way into the completion
    i = next(
        i
        for i in range(4, 30)
        if (piece := tok.decode(free.tokens[i : i + 1])).isascii() and len(piece.strip()) >= 3
    )
    stop = tok.decode(free.tokens[i : i + 1]).strip()[-3:]
    stopped = await one(tiny, SamplingParams(max_tokens=30, seed=9, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert len(stopped.tokens) <= i + 1
    assert stopped.tokens == free.tokens[: len(stopped.tokens)]
    assert stop in tok.decode(stopped.tokens)
    assert stop not in tok.decode(stopped.tokens[:-1])


async def test_stop_token_id_ends_generation_and_is_kept(tiny: LocalBackend) -> None:
    free = await one(tiny, SamplingParams(max_tokens=12, seed=4))
    chosen = free.tokens[5]
    stopped = await one(tiny, SamplingParams(max_tokens=12, seed=4, stop_token_ids=(chosen,)))
    first = free.tokens.index(chosen)
    assert stopped.tokens == free.tokens[: first + 1]
    assert stopped.finish_reason == "stop"


async def test_top_logprobs_lists_the_most_likely_alternatives(tiny: LocalBackend) -> None:
    c = await one(tiny, SamplingParams(max_tokens=4, temperature=0.0, top_logprobs=3))
    assert c.top_logprobs is not None and len(c.top_logprobs) == 4
    for token, lp, alternatives in zip(c.tokens, c.logprobs, c.top_logprobs, strict=True):
        assert len(alternatives) == 3
        assert alternatives[0].token_id == token and alternatives[0].logprob == pytest.approx(lp)
        assert [a.logprob for a in alternatives] == sorted(
            (a.logprob for a in alternatives), reverse=True
        )


async def test_concurrent_requests_get_the_tokens_they_get_alone(tiny: LocalBackend) -> None:
    await _concurrent_equal_alone(tiny, tolerance=1e-4)


async def test_in_bf16_concurrent_requests_get_the_tokens_they_get_alone(tiny_bf16: LocalBackend) -> None:
    await _concurrent_equal_alone(tiny_bf16, tolerance=1e-2)


async def _concurrent_equal_alone(tiny: LocalBackend, tolerance: float) -> None:
    prompts = [PROMPT, PROMPT[:3], (1, 4093, 314, 2201, 28, 690, 11, 12, 13, 14, 15)]
    params = [
        SamplingParams(max_tokens=10 + 5 * i, temperature=0.8, seed=100 + i) for i in range(6)
    ]
    jobs = [(prompts[i % 3], p) for i, p in enumerate(params)]
    alone = [await one(tiny, p, prompt) for prompt, p in jobs]

    async def staggered(i: int, prompt: tuple[int, ...], p: SamplingParams):
        await asyncio.sleep(0.02 * i)  # join a batch that is already decoding
        return await one(tiny, p, prompt)

    together = await asyncio.gather(
        *(staggered(i, prompt, p) for i, (prompt, p) in enumerate(jobs))
    )
    for a, b in zip(alone, together, strict=True):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < tolerance


async def test_stream_yields_one_token_per_chunk_and_finishes_last(tiny: LocalBackend) -> None:
    params = SamplingParams(max_tokens=16, seed=7, stop_token_ids=())
    chunks = [chunk async for chunk in tiny.sample_stream(PROMPT, params)]
    whole = await one(tiny, params)
    assert len(chunks) == 16 and all(len(c.tokens) == 1 for c in chunks)
    assert [c.finish_reason for c in chunks] == [None] * 15 + ["length"]
    assert tuple(t for c in chunks for t in c.tokens) == whole.tokens


async def test_a_consumer_that_stops_early_frees_its_row(tiny: LocalBackend) -> None:
    stream = tiny.sample_stream(PROMPT, SamplingParams(max_tokens=5000, seed=8, stop_token_ids=()))
    await anext(stream)
    await stream.aclose()
    deadline = time.monotonic() + 10
    while tiny.engine.active_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert tiny.engine.active_requests == 0


async def test_prompt_plus_max_tokens_over_the_context_is_refused(tiny: LocalBackend) -> None:
    params = SamplingParams(max_tokens=tiny.context_length)
    with pytest.raises(ContextLengthExceeded) as err:
        await tiny.sample(PROMPT, params)
    assert err.value.prompt_tokens == len(PROMPT)
    with pytest.raises(ContextLengthExceeded):
        async for _ in tiny.sample_stream(PROMPT, params):
            pass


async def test_old_versions_are_dropped_when_unused_and_reload_by_number(
    tiny: LocalBackend,
) -> None:
    c = await one(tiny, SamplingParams(max_tokens=5, seed=12))
    datum = Datum(PROMPT, c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    start = tiny.version
    for _ in range(2):
        await tiny.train_step([datum], LossSpec(), OptimSpec(learning_rate=1e-2))
        await tiny.publish()
    assert tiny.version == start + 2
    assert tiny.engine.loaded_versions == {start + 2}
    assert (tiny.engine.data_dir / "adapters" / f"v{start + 1}" / "adapter_config.json").exists()
    rollback = (
        await tiny.sample(PROMPT, SamplingParams(max_tokens=5, seed=12), version=start + 1)
    )[0]
    assert rollback.version == start + 1
    with pytest.raises(BackendError):
        await tiny.sample(PROMPT, SamplingParams(max_tokens=2), version=start + 3)


async def test_n_samples_with_a_seed_are_distinct_and_reproducible(tiny: LocalBackend) -> None:
    params = SamplingParams(max_tokens=8, seed=50)
    first = await tiny.sample(PROMPT, params, n=3)
    second = await tiny.sample(PROMPT, params, n=3)
    assert [c.tokens for c in first] == [c.tokens for c in second]
    assert len({c.tokens for c in first}) == 3


@pytest.mark.parametrize("engine_dtype", ["fp32", "bf16"])
async def test_the_embedded_model_answers_a_simple_question(tmp_path: Path, engine_dtype: str) -> None:
    backend = LocalBackend(
        models.EMBEDDED, tmp_path, lora_rank=4, lora_alpha=4, engine_dtype=engine_dtype  # type: ignore[arg-type]
    )
    await backend.start()
    try:
        tok = backend.tokenizer()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            add_generation_prompt=True,
            return_dict=False,
        )
        (c,) = await backend.sample(list(prompt), SamplingParams(max_tokens=8, temperature=0.0))
        assert "Paris" in tok.decode(c.tokens)
        # the real model's bf16 matmuls (docs/engine.md: 1.4e-2 on average at T = 1, 0.10 at
        # most): score is close
        scored = await backend.score(list(prompt), c.tokens)
        assert max(abs(x - y) for x, y in zip(scored, c.logprobs, strict=True)) < (
            2e-4 if engine_dtype == "fp32" else 0.15
        )
    finally:
        await backend.close()


def test_a_gpu_bf16_model_keeps_its_serving_slots_in_bf16_and_a_cpu_in_fp32() -> None:
    """A bf16 model cast whole (a GPU's arithmetic, built here on the CPU) serves its published
    adapters in bf16: PEFT's default upcast to fp32 made every LoRA layer cast each token's
    activations up and back (~500 extra kernels a token on a GPU). On a CPU the activations stay
    fp32 whatever the matmuls' dtype (`upcast`), and so do the slots. The trainable adapter is
    fp32 either way."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    for upcast, expected in ((False, torch.bfloat16), (True, torch.float32)):
        base = models.load_model(models.resolve(models.TINY))
        precision.to_compute_dtype(base, torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear"))
        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        slots = adapters.Slots(model, "default", layers, [m._active_adapter for m in layers], upcast=upcast)
        trainable = slots.trainable_params()
        name = slots.fill({k: v.detach() for k, v in trainable.items()})
        assert {p.dtype for p in slots.params[name].values()} == {expected}
        assert {p.dtype for p in trainable.values()} == {torch.float32}


async def _serve_adapter(backend: LocalBackend, version: int, seed: int, root: Path) -> None:
    """Serve random LoRA weights (large enough to move every logprob) as `version`, the way a
    restart serves a published folder."""
    shapes = await backend.engine.trainable_state()
    gen = torch.Generator().manual_seed(seed)
    weights = {k: torch.randn(v.shape, generator=gen) for k, v in shapes.items()}
    if not adapters.folder(root, version).exists():
        adapters.reserve(root, version)
        adapters.write(root, version, weights, adapters.config_json(backend.engine._model, adapters.TRAIN))
    await backend.engine.restore(version, str(adapters.folder(root, version)))


async def test_a_version_served_merged_into_the_bf16_weights_scores_as_its_adapter_beside_them(
    tmp_path: Path,
) -> None:
    """`merge_adapters` (bf16 on a CPU): a forward on one served version runs its adapter merged
    into the packed weights. Its scores are those of the adapter beside the weights up to the
    merged weights' rounding; a slot refilled with another version's weights is merged again;
    a batch mixing versions gets the base's own weights back (its v0 row is v0's)."""
    merged, beside = (
        LocalBackend("tiny-random", tmp_path / name, lora_rank=8, lora_alpha=8, threads=1, engine_dtype="bf16",
                     prefix_cache_mb=0, merge_adapters=merge)
        for name, merge in (("merged", True), ("beside", False))
    )
    for b in (merged, beside):
        b.engine.start()
    try:
        assert merged.engine._merged is not None and beside.engine._merged is None
        completion = (4093, 314, 2201, 28, 690, 11)
        base = await merged.score(PROMPT, completion, model="base")
        scores: dict[int, list[float]] = {0: base}

        def far(a: list[float], b: list[float]) -> float:
            return max(abs(x - y) for x, y in zip(a, b, strict=True))

        for version in (1, 2, 3):  # v3 refills v1's slot (freed when v2 served)
            for b in (merged, beside):
                await _serve_adapter(b, version, seed=version, root=tmp_path / "published")
            got, scores[version] = [await b.score(PROMPT, completion) for b in (merged, beside)]
            # the merged weights' rounding (0.004-0.04 measured) is well below what tells the
            # versions apart (0.19-0.47 from v0; a stale merge would score as another version)
            others = min(far(scores[version], scores[v]) for v in scores if v != version)
            assert far(got, scores[version]) < min(0.06, others / 3), version
        # a batch with rows on v0 and v3 right after a merged forward on v3: PEFT's mixed batch,
        # which adds each row's adapter to the base's own weights
        engine = merged.engine

        def forwards() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            ids, v3 = torch.tensor([PROMPT, PROMPT]), engine._row(3)
            with torch.inference_mode():
                alone = engine._forward([v3], input_ids=ids[:1]).logits[0]
                assert engine._merged is not None and engine._merged.in_place == v3
                mixed = engine._forward([adapters.BASE, v3], input_ids=ids).logits
                return alone, mixed, engine._forward([adapters.BASE], input_ids=ids[:1]).logits[0]

        alone_v3, mixed, alone_v0 = await engine._call(forwards)
        assert (mixed[0] - alone_v0).abs().max() < 1e-3  # v0's row is v0's, not v3's merged weights
        # v3's row is v3's adapter beside the weights: the merged forward's up to its rounding
        assert (mixed[1] - alone_v3).abs().mean() < 0.1 * (alone_v3 - alone_v0).abs().mean()
    finally:
        for b in (merged, beside):
            b.engine.close()


async def test_scores_asked_together_run_packed_and_equal_each_asked_alone(
    tiny: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting `score` jobs on one model run as one packed forward (`Engine._more_scores`): the
    same logprobs as each alone, each at its own temperature; a bad request among them fails
    alone; base and policy scores never share a forward."""
    engine = tiny.engine
    asks = [((1, 520, 3121), (28, 1830, 446), "policy", 1.0), (PROMPT, (17, 905, 11, 12), "base", 1.0),
            (PROMPT[:4], (4093, 314), "policy", 0.7), ((1, 4093), (314, 2201, 28, 690), "policy", 1.3),
            (PROMPT, (12, 13), "base", 0.5)]
    alone = [await tiny.score(p, c, model=m, temperature=t) for p, c, m, t in asks]  # type: ignore[arg-type]
    packed: list[int] = []
    scores = engine._scores
    monkeypatch.setattr(engine, "_scores", lambda asked: packed.append(len(asked)) or scores(asked))
    blocker = asyncio.ensure_future(engine._call(time.sleep, 0.5))  # the scores queue up behind it
    await asyncio.sleep(0.1)
    together = await asyncio.gather(
        *(tiny.score(p, c, model=m, temperature=t) for p, c, m, t in asks),  # type: ignore[arg-type]
        tiny.score(PROMPT, (), model="policy"), return_exceptions=True,
    )
    await blocker
    assert sorted(packed) == [2, 3]  # the base's two and the policy's three, each one forward
    # a publish is a barrier: the score asked after it is the new version's, never packed with one before
    await tiny.train_step([Datum(PROMPT, (28, 1830, 446), (-1.0,) * 3, (1.0,) * 3)], LossSpec(),
                          OptimSpec(learning_rate=1e-2))
    p, c, _, _ = asks[0]
    old = await tiny.score(p, c)
    blocker = asyncio.ensure_future(engine._call(time.sleep, 0.5))
    await asyncio.sleep(0.1)
    before, _, after = await asyncio.gather(tiny.score(p, c), tiny.publish(), tiny.score(p, c))
    await blocker
    new = await tiny.score(p, c)
    assert before == old and after == new and max(abs(x - y) for x, y in zip(old, new, strict=True)) > 1e-3
    assert isinstance(together[-1], ValueError)  # an empty completion: refused, alone
    for a, b in zip(alone, together[:-1], strict=True):
        assert isinstance(b, list) and len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
