"""Adapter publish latency: from "save" to the first request served by the new version.

Measured on the torch engine (the `local` backend without SGLang; on CUDA where present):
publish() writes the adapter and loads it, then the first token of a request admitted on the new
version. The FSDP2 side of an SGLang publish (gathering the sharded adapter and writing it) is
measured by bench/gpu_train.py (`adapter_gather_and_write_s`); SGLang's own /load_lora_adapter
time is not measured (no SGLang on the bench machines).

    python bench/publish_latency.py --engine-model DIR_OR_NAME --rank 32 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine
from clawbridge.types import SamplingParams
from gpu_common import model_dir, write_result


async def first_token(sample_stream, prompt: list[int]) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    async for chunk in sample_stream(prompt, SamplingParams(max_tokens=1)):
        if chunk.tokens:
            break
    return time.perf_counter() - t


async def engine_path(spec: models.ModelSpec, rank: int, repeat: int, device: str) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="cb-pub-"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = Engine(spec, data_dir=root, lora_rank=rank, lora_alpha=rank, device=device, dtype=dtype)
    engine.start()
    prompt = list(range(100, 164))
    try:
        await first_token(engine.sample_stream, prompt)  # warm-up
        publish, first, total = [], [], []
        for _ in range(repeat):
            t = time.perf_counter()
            v = await engine.publish()
            p = time.perf_counter() - t
            f = await first_token(engine.sample_stream, prompt)
            assert engine.version == v.version
            publish.append(p)
            first.append(f)
            total.append(p + f)
        return {"publish_s_median": round(statistics.median(publish), 4),
                "first_token_s_median": round(statistics.median(first), 4),
                "save_to_first_token_s_median": round(statistics.median(total), 4)}
    finally:
        engine.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-model", default=models.TINY, help="registry name, HF folder, or arch:NAME")
    ap.add_argument("--tokenizer", type=Path, default=None, help="for arch:NAME models")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = args.engine_model
    if model.startswith("arch:"):
        model = str(model_dir(model.removeprefix("arch:"), Path(tempfile.gettempdir()) / "cb-models", args.tokenizer))
    spec = models.resolve(model)
    result = await engine_path(spec, args.rank, args.repeat, device)
    print(result, flush=True)
    write_result("publish_latency", {"path": "torch engine", "model": args.engine_model,
                                     "engine_device": device, "lora_rank": args.rank, **result})


if __name__ == "__main__":
    asyncio.run(main())
