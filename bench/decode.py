"""Decode throughput of the engine at several concurrencies, and the cost of a publish.

    .venv/bin/python bench/decode.py --model smollm2-135m-instruct --tokens 64 --concurrency 1 4 8

`--probes N` instead sends the first N general probe questions at once, each with its own seed
(what the gate and the demo's measurements do), and times them on v0 and on a published adapter
for every `--max-batch` (rows the engine decodes together), the adapter merged into the bf16
weights (`engine_merge_adapters`) and beside them:

    .venv/bin/python bench/decode.py --probes 100 --tokens 40 --max-batch 16 32 64

`--scores N` scores N probe answers one at a time and all at once (packed by the engine):

    .venv/bin/python bench/decode.py --scores 32 --tokens 40
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
from clawbridge.learning.probes import general_probes
from clawbridge.local_gpu import models, precision
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


async def probes(engine: Engine, prompts: list[list[int]], tokens: int, version: int) -> tuple[float, int]:
    """(wall seconds, tokens) for every prompt at once, each with its own seed, on `version`."""
    params = SamplingParams(max_tokens=tokens, temperature=1.0)
    started = time.perf_counter()
    outs = await asyncio.gather(*(engine.sample(p, dataclasses.replace(params, seed=i), n=1, version=version)
                                  for i, p in enumerate(prompts)))
    return time.perf_counter() - started, sum(len(c.tokens) for out in outs for c in out)


def chat(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     return_dict=False))


async def concurrency(args: argparse.Namespace) -> None:
    spec = models.resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(spec, data_dir=Path(tmp), lora_rank=args.rank, lora_alpha=args.rank, threads=args.threads)
        engine.start()
        try:
            prompt = chat(engine, "Tell me about the sea.")
            await run(engine, prompt, 4, 1)  # warm-up
            print(f"model {spec.name}, {args.tokens} tokens per request, {torch.get_num_threads()} threads")
            for version in ("base (v0)", "adapter (v1)"):
                if version.startswith("adapter"):
                    t = time.perf_counter()
                    await engine.publish()
                    print(f"publish (write + load rank-{args.rank} adapter): {time.perf_counter() - t:.2f} s")
                for c in args.concurrency:
                    tps, ttft = await run(engine, prompt, args.tokens, c)
                    print(f"{version:13s} concurrency {c:2d}: {tps:7.1f} tokens/s summed, first token {ttft * 1000:6.0f} ms")
        finally:
            engine.close()


async def rows(args: argparse.Namespace) -> None:
    """Each row count with the served adapter merged into the bf16 weights and without
    (`merge_adapters`; where the engine cannot merge, both rows run the adapter beside them)."""
    spec = models.resolve(args.model)
    dtype = precision.resolve(args.dtype, "cpu")
    print(f"model {spec.name} ({precision.name(dtype)}), {args.probes} probe questions at once, up to {args.tokens} tokens each")
    reference: dict[str, float] = {}
    for max_batch in args.max_batch:
        for merge in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                engine = Engine(spec, data_dir=Path(tmp), lora_rank=args.rank, lora_alpha=args.rank, dtype=dtype,
                                max_batch=max_batch, threads=args.threads, merge_adapters=merge)
                engine.start()
                try:
                    prompts = [chat(engine, p.question) for p in general_probes()[: args.probes]]
                    await probes(engine, prompts[:4], 4, 0)  # warm-up
                    versions = (("v0", 0), ("adapter", 1)) if merge else (("adapter", 1),)
                    for name, version in versions:
                        if version:
                            await engine.publish()
                            name += " merged" if merge else " beside"
                        seconds, tokens = await probes(engine, prompts, args.tokens, version)
                        ratio = reference.setdefault(f"{max_batch}", seconds) / seconds
                        print(f"max_batch {max_batch:3d} {name:15s} {seconds:6.1f} s, {tokens} tokens, "
                              f"{tokens / seconds:6.1f} tokens/s, {ratio:.2f}x v0's time")
                finally:
                    engine.close()


async def scores(args: argparse.Namespace) -> None:
    """`--scores N`: N probe answers scored one at a time (each awaited: a forward each) and
    all at once (the engine packs waiting scores into rows, `Engine._more_scores`), alternating,
    medians of `--repeats`."""
    spec = models.resolve(args.model)
    dtype = precision.resolve(args.dtype, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(spec, data_dir=Path(tmp), lora_rank=args.rank, lora_alpha=args.rank, dtype=dtype,
                        threads=args.threads)
        engine.start()
        try:
            prompts = [chat(engine, p.question) for p in general_probes()[: args.scores]]
            params = SamplingParams(max_tokens=args.tokens, temperature=0.7)
            outs = await asyncio.gather(*(engine.sample(p, dataclasses.replace(params, seed=i))
                                          for i, p in enumerate(prompts)))
            pairs = [(p, out[0].tokens) for p, out in zip(prompts, outs, strict=True)]
            tokens = sum(len(p) + len(c) for p, c in pairs)
            took: dict[str, list[float]] = {"one at a time": [], "all at once": []}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for p, c in pairs:
                    await engine.score(p, c, temperature=0.7)
                took["one at a time"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await asyncio.gather(*(engine.score(p, c, temperature=0.7) for p, c in pairs))
                took["all at once"].append(time.perf_counter() - t0)
            print(f"model {spec.name} ({precision.name(dtype)}), {len(pairs)} answers scored, {tokens} tokens")
            med = {k: statistics.median(v) for k, v in took.items()}
            for k, v in med.items():
                print(f"{k:14s} {v:6.2f} s median of {args.repeats}, {tokens / v:7.1f} tokens/s")
            print(f"all at once / one at a time: {med['one at a time'] / med['all at once']:.2f}x the rate")
        finally:
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.EMBEDDED)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--probes", type=int, default=0, help="send this many probe questions at once instead")
    parser.add_argument("--max-batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--dtype", default="auto", choices=[*sorted(precision.DTYPES), "auto"],
                        help="with --probes: the engine's dtype (auto: bf16 where the CPU has it, as the demo)")
    parser.add_argument("--scores", type=int, default=0, help="score this many probe answers one at a time and at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    asyncio.run(scores(args) if args.scores else rows(args) if args.probes else concurrency(args))


if __name__ == "__main__":
    main()
