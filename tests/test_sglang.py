"""The SGLang client and the publish protocol, against a faithful fake SGLang HTTP server with a
tiny torch model behind it (tests/fakes/fake_sglang.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch
from clawbridge.backends.sglang import SGLangBackend
from clawbridge.local_gpu.sglang import (
    PRIORITY,
    SGLangClient,
    SGLangError,
    StreamCursor,
    Timeouts,
    sampling_params_payload,
)
from clawbridge.protocol import Backend, ContextLengthExceeded, TransientBackendError
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams, StepMetrics
from fakes.fake_sglang import FakeSGLang, serve, tiny_peft_model

PROMPT = [1, 504, 3136, 2683, 30, 314, 5248]


class AdapterWriter:
    """Stands in for the FSDP trainer at the publish boundary: writes a real PEFT adapter whose
    weights change with every save, so each version serves different logprobs."""

    def __init__(self) -> None:
        self.model = tiny_peft_model(rank=8)
        self.saves = 0
        self.restored: Path | bool | None = False  # load_adapter's argument, until the next save

    async def train_step(self, batch: Sequence[Datum], loss: LossSpec, optim: OptimSpec) -> StepMetrics:
        raise NotImplementedError("publish tests do not train")

    async def load_adapter(self, path: Path | None) -> None:
        self.restored = path

    async def save_adapter(self, path: Path) -> None:
        self.saves += 1
        restored, self.restored = self.restored, False
        if isinstance(restored, Path):  # a rollback to vK: exactly vK's weights
            shutil.copytree(restored, path)
            return
        gen = torch.Generator().manual_seed(self.saves)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:  # after a rollback to v0: the initial adapter, B = 0
                    p.copy_(torch.zeros(p.shape) if restored is None else torch.randn(p.shape, generator=gen) * 0.5)
        await asyncio.to_thread(self.model.save_pretrained, str(path), selected_adapters=["placeholder"])
        # PEFT saves a non-default adapter in a subfolder; SGLang wants a flat PEFT folder.
        sub = path / "placeholder"
        if sub.exists():
            for f in sub.iterdir():
                f.rename(path / f.name)
            sub.rmdir()

    async def save_state(self, path: Path) -> None: ...
    async def load_state(self, path: Path) -> None: ...
    async def close(self) -> None: ...


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # the tiny model is latency-bound: two threads on a shared 2-core box are 30x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
async def server(tokenizer) -> AsyncIterator[tuple[FakeSGLang, str]]:
    fake = FakeSGLang(tiny_peft_model(), tokenizer, token_delay_s=0.002)
    runner, port = await serve(fake)
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def backend(server, tokenizer, tmp_path) -> AsyncIterator[SGLangBackend]:
    _, url = server
    b = SGLangBackend(url, tokenizer, model_name="tiny-random", context_length=256,
                      data_dir=tmp_path, trainer=AdapterWriter(),
                      timeouts=Timeouts(generate_s=30, lora_s=30))
    await b.start()
    try:
        yield b
    finally:
        await b.close()


def test_the_backend_implements_the_protocol(backend):
    assert isinstance(backend, Backend)


def test_every_sampling_parameter_is_spelled_out():
    sp = sampling_params_payload(SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=20,
                                                stop=("\n",), stop_token_ids=(2,), seed=3))
    assert sp["max_new_tokens"] == 7 and sp["temperature"] == 0.7 and sp["top_p"] == 0.9
    assert sp["top_k"] == 20 and sp["stop"] == ["\n"] and sp["stop_token_ids"] == [2]
    assert sp["sampling_seed"] == 3
    # the knobs a model's generation_config would otherwise set are neutralised explicitly
    assert sp["min_p"] == 0.0 and sp["repetition_penalty"] == 1.0 and sp["presence_penalty"] == 0.0


async def test_sample_sends_input_ids_and_every_parameter_and_returns_exact_logprobs(server, backend):
    fake, _ = server
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=50, top_logprobs=2)
    (c,) = await backend.sample(PROMPT, params)
    body = fake.requests[-1]
    assert body["input_ids"] == PROMPT and "lora_path" not in body  # version 0 is the base
    assert set(sampling_params_payload(params)) <= set(body["sampling_params"])
    assert body["sampling_params"]["temperature"] == 0.8 and body["top_logprobs_num"] == 2
    assert 1 <= len(c.tokens) == len(c.logprobs) <= 6 and c.version == 0
    assert c.top_logprobs is not None and len(c.top_logprobs[0]) == 2
    # the recorded logprobs are what score computes at the same temperature: ratio 1 on-policy
    scored = await backend.score(PROMPT, c.tokens, temperature=0.8)
    assert scored == pytest.approx(list(c.logprobs), abs=1e-5)


async def test_n_samples_are_independent_requests_on_the_same_version(server, backend):
    fake, _ = server
    outs = await backend.sample(PROMPT, SamplingParams(max_tokens=3), n=3)
    assert len(outs) == 3 and len({r["rid"] for r in fake.requests[-3:]}) == 3


async def test_a_background_request_is_sent_below_a_users_priority(server, backend):
    """SGLang's priority scheduling (larger first) gets a user's request ahead of the learner's,
    by more than its preemption threshold; scores are the learner's."""
    fake, _ = server
    await backend.sample(PROMPT, SamplingParams(max_tokens=2))
    await backend.sample(PROMPT, SamplingParams(max_tokens=2), priority="background")
    [_ async for _ in backend.sample_stream(PROMPT, SamplingParams(max_tokens=2), priority="background")]
    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=2))
    await backend.score(PROMPT, c.tokens)
    user, background, streamed, _, scored = (r["priority"] for r in fake.requests[-5:])
    assert background == streamed == scored == PRIORITY["background"]
    assert user - background > 10  # SGLang's default preemption threshold


async def test_stream_yields_tokens_as_they_are_made_and_ends_with_a_finish_reason(backend):
    params = SamplingParams(max_tokens=5)
    chunks = [c async for c in backend.sample_stream(PROMPT, params)]
    assert len(chunks) >= 5
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    tokens = [t for c in chunks for t in c.tokens]
    lps = [x for c in chunks for x in c.logprobs]
    assert len(tokens) == 5 and len(lps) == 5
    assert await backend.score(PROMPT, tokens) == pytest.approx(lps, abs=1e-5)


async def test_score_uses_max_new_tokens_zero_and_logprob_start_len(server, backend):
    fake, _ = server
    await backend.score(PROMPT, [11, 12, 13], model="base")
    body = fake.requests[-1]
    assert body["sampling_params"]["max_new_tokens"] == 0
    assert body["logprob_start_len"] == len(PROMPT) - 1
    assert body["input_ids"] == [*PROMPT, 11, 12, 13]


async def test_stream_cursor_reads_cumulative_and_incremental_chunks_alike():
    def chunk(ids: list[int], total: int) -> dict:
        return {"output_ids": ids, "meta_info": {"completion_tokens": total,
                                                 "output_token_logprobs": [[-float(i), i, None] for i in ids]}}

    cum, inc = StreamCursor(), StreamCursor()
    assert cum.delta(chunk([5], 1))[0] == [5] and cum.delta(chunk([5, 6, 7], 3))[0] == [6, 7]
    assert inc.delta(chunk([5], 1))[0] == [5] and inc.delta(chunk([6, 7], 3)) == ([6, 7], [-6.0, -7.0], None)


async def test_prompt_plus_max_tokens_beyond_the_context_is_refused_before_sending(server, backend):
    fake, _ = server
    n = len(fake.requests)
    with pytest.raises(ContextLengthExceeded):
        await backend.sample(list(range(250)), SamplingParams(max_tokens=10))
    assert len(fake.requests) == n


async def test_a_request_naming_an_unloaded_adapter_is_a_400(server):
    _, url = server
    client = SGLangClient(url)
    try:
        with pytest.raises(SGLangError, match="not loaded"):
            await client.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1},
                                   "lora_path": "policy@v9"})
    finally:
        await client.close()


async def test_a_server_that_does_not_answer_in_time_is_a_transient_error(tokenizer):
    fake = FakeSGLang(tiny_peft_model(), tokenizer, token_delay_s=0.6)
    runner, port = await serve(fake)
    client = SGLangClient(f"http://127.0.0.1:{port}", Timeouts(generate_s=0.3))
    try:
        with pytest.raises(TransientBackendError):
            await client.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    finally:
        await client.close()
        await runner.cleanup()


async def test_publish_writes_the_adapter_loads_it_as_the_next_version_and_routes_to_it(server, backend, tmp_path):
    fake, _ = server
    base_lps = await backend.score(PROMPT, [11, 12, 13])
    v1 = await backend.publish()
    assert v1.version == 1 and backend.version == 1 and v1.name == "policy@v1"
    assert Path(v1.path or "") == tmp_path / "adapters" / "v1"
    assert json.loads((Path(v1.path or "") / "adapter_config.json").read_text())["r"] == 8
    assert not [p for p in (tmp_path / "adapters").iterdir() if p.name.startswith(".")]
    assert "policy@v1" in fake.adapters
    (c,) = await backend.sample(PROMPT, SamplingParams(max_tokens=2))
    assert c.version == 1 and fake.requests[-1]["lora_path"] == "policy@v1"
    policy_lps = await backend.score(PROMPT, [11, 12, 13])
    assert policy_lps != pytest.approx(base_lps, abs=1e-3)  # the adapter changes the model
    assert await backend.score(PROMPT, [11, 12, 13], model="base") == pytest.approx(base_lps, abs=1e-6)
    # a second publish supersedes v1, which is unloaded once nothing uses it
    await backend.publish()
    await backend.drain()
    assert set(fake.adapters) == {"policy@v2"}


async def test_publish_under_concurrent_streaming_load_drops_nothing_and_never_mixes_versions(server, backend):
    fake, _ = server
    results: list[tuple[int, list[int], str]] = []  # (version, tokens, rid)
    failures: list[BaseException] = []
    stop = asyncio.Event()

    async def client(i: int) -> None:
        while not stop.is_set():
            try:
                chunks = [c async for c in backend.sample_stream(PROMPT[: 3 + i % 4], SamplingParams(max_tokens=6))]
                versions = {c.version for c in chunks}
                assert len(versions) == 1, versions
                results.append((versions.pop(), [t for c in chunks for t in c.tokens], ""))
            except BaseException as e:  # every failure counts
                failures.append(e)
                return

    async def served_on(version: int, count: int) -> None:
        while sum(v == version for v, _, _ in results) < count and not failures:
            await asyncio.sleep(0.02)

    clients = [asyncio.create_task(client(i)) for i in range(4)]
    for k in range(1, 4):
        await asyncio.wait_for(served_on(k - 1, 2), 60)
        await backend.publish()  # streams admitted on k-1 are still running here
    await asyncio.wait_for(served_on(3, 2), 60)
    stop.set()
    await asyncio.gather(*clients)
    await backend.drain()

    assert failures == []
    assert {v for v, _, _ in results} == {0, 1, 2, 3}
    assert all(len(toks) == 6 for _, toks, _ in results)
    # server side: every request used exactly one adapter for all of its forwards
    stream_bodies = [b for b in fake.requests if b.get("stream")]
    assert len(stream_bodies) == len(results)
    for body in stream_bodies:
        served = fake.served[body["rid"]]
        assert len(set(served)) == 1 and served[0] == body.get("lora_path", "base")
    # old versions were unloaded, each only after its last request had finished
    assert set(fake.adapters) == {"policy@v3"}
    unloads = [n for _, kind, n in fake.events if kind == "unload"]
    assert unloads == ["policy@v1", "policy@v2"]


async def test_rollback_loads_the_old_adapter_into_the_trainer_and_publishes_it_as_the_next_version(server, backend):
    from clawbridge.protocol import UnknownVersion

    fake, _ = server
    completion = [11, 12, 13]
    base = await backend.score(PROMPT, completion, model="base")
    await backend.publish()
    v1 = await backend.score(PROMPT, completion)
    await backend.publish()
    assert await backend.score(PROMPT, completion) != pytest.approx(v1, abs=1e-3)
    stream = backend.sample_stream(PROMPT, SamplingParams(max_tokens=6))
    first = await anext(stream)  # admitted on v2
    v3 = await backend.rollback(1)
    rest = [c async for c in stream]
    assert {c.version for c in [first, *rest]} == {2}
    assert v3.version == backend.version == 3 and v3.path.endswith("adapters/v3")
    assert await backend.score(PROMPT, completion) == pytest.approx(v1, abs=1e-6)
    await backend.drain()
    assert set(fake.adapters) == {"policy@v3"}  # v2 was unloaded once its stream finished
    with pytest.raises(UnknownVersion):
        await backend.rollback(4)
    assert (await backend.rollback(0)).version == 4
    assert await backend.score(PROMPT, completion) == pytest.approx(base, abs=1e-6)
