"""Decode throughput of the engine at several concurrencies, and the cost of a publish.

    .venv/bin/python bench/decode.py --model smollm2-135m-instruct --tokens 64 --concurrency 1 4 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine
from clawbridge.types import SamplingParams


async def run(engine: Engine, prompt: list[int], tokens: int, concurrency: int) -> tuple[float, float]:
    """(summed tokens/s, mean seconds to first token) for `concurrency` simultaneous requests."""
    params = SamplingParams(max_tokens=tokens, temperature=1.0, stop_token_ids=())
    started = time.perf_counter()
    firsts: list[float] = []

    async def one(seed: int) -> int:
        n = 0
        async for _chunk in engine.sample_stream(prompt, dataclasses.replace(params, seed=seed)):
            if n == 0:
                firsts.append(time.perf_counter() - started)
            n += 1
        return n

    counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return sum(counts) / (time.perf_counter() - started), sum(firsts) / len(firsts)


async def main_async(args: argparse.Namespace) -> None:
    spec = models.resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(spec, data_dir=Path(tmp), lora_rank=args.rank, lora_alpha=args.rank, threads=args.threads)
        engine.start()
        try:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Tell me about the sea."}], add_generation_prompt=True, return_dict=False
            )
            await run(engine, list(prompt), 4, 1)  # warm-up
            print(f"model {spec.name}, {args.tokens} tokens per request, {torch.get_num_threads()} threads")
            for version in ("base (v0)", "adapter (v1)"):
                if version.startswith("adapter"):
                    t = time.perf_counter()
                    await engine.publish()
                    print(f"publish (write + load rank-{args.rank} adapter): {time.perf_counter() - t:.2f} s")
                for c in args.concurrency:
                    tps, ttft = await run(engine, list(prompt), args.tokens, c)
                    print(f"{version:13s} concurrency {c:2d}: {tps:7.1f} tokens/s summed, first token {ttft * 1000:6.0f} ms")
        finally:
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.EMBEDDED)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
