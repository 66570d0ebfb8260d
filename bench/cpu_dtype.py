"""The engine in fp32 and in bf16, side by side in one run, as ratios (bf16 / fp32).

    .venv/bin/python bench/cpu_dtype.py                      # the embedded model, every figure
    .venv/bin/python bench/cpu_dtype.py --prefill 1024 4096 --concurrency 1 4 --json

Measured, each with its fp32 and bf16 runs alternating repeat by repeat (a shared, busy machine
slows both alike; medians are reported):

- the machine's matmul peak, 2048³, in both dtypes: the ceiling each figure is read against;
- prefill tokens/s at each `--prefill` length (a `sample` of 1 token, the prefix cache off);
- batched decode tokens/s at each `--concurrency` (summed over the requests);
- `train_step` on a mixed-length batch (lengths 1 : 2 : ... : n, bench/train_step.py's).

A figure's fraction of the peak counts the matmul FLOPs only: 2 per weight of the decoder's
linear layers per token (x2 more for a training step's backward through frozen weights), plus
the causal attention's 2·2·n²/2 per layer and head dimension (a training step: 4 per weight,
the backward through frozen weights computing only the inputs' gradients, and 3x the attention).
The peak is measured once, first: on a machine whose load changes during the run a fraction can
pass 100 %. Decode is bound by memory, not matmul: its fraction says little and is not printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine
from clawbridge.types import LossSpec, OptimSpec, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from train_step import make_batch  # a sibling script, not a package

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: the first call picks and prepares the kernel
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - started) / 1e9


def linear_weights(engine: Engine) -> int:
    """Weights of the decoder's linear layers (what every token multiplies), LoRA excluded."""
    return sum(
        m.weight.numel()
        for name, m in engine._model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lora_" not in name and "lm_head" not in name
    )


def attention_flops(engine: Engine, n: int) -> float:
    config = engine._model.config
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    return 2 * 2 * (n * n / 2) * width * config.num_hidden_layers


async def paired(
    engines: dict[str, Engine], repeats: int, run: Callable[[str, Engine], Awaitable[Any]]
) -> dict[str, float]:
    """Median seconds of `run` on each engine, the two alternating repeat by repeat."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            started = time.perf_counter()
            await run(name, engine)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.EMBEDDED)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096, 13312])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--train-tokens", type=int, default=2048, help="the mixed batch's size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-repeats", type=int, default=1, help="repeats of prefills over 8 K")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"model": args.model, "threads": args.threads, "load_before": _load()}

    peaks: dict[str, list[float]] = {name: [] for name in DTYPES}
    for _ in range(args.repeats):
        for name, dtype in DTYPES.items():
            peaks[name].append(matmul_gflops(dtype))
    peak = {name: statistics.median(v) for name, v in peaks.items()}
    out["matmul_gflops"] = peak
    _row("matmul 2048³ GFLOP/s", peak)

    spec = models.resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        engines = {
            name: Engine(spec, data_dir=Path(tmp) / name, dtype=dtype, threads=args.threads,
                         prefix_cache_mb=0)
            for name, dtype in DTYPES.items()
        }
        for engine in engines.values():
            engine.start()
        weights = linear_weights(engines["fp32"])
        g = torch.Generator().manual_seed(0)

        out["prefill"] = {}
        one = SamplingParams(max_tokens=1, temperature=0.0)
        for n in args.prefill:
            prompt = torch.randint(100, 40000, (n,), generator=g).tolist()
            repeats = args.long_repeats if n > 8192 else args.repeats
            seconds = await paired(engines, repeats, lambda _, e, p=prompt: e.sample(p, one))
            flops = 2 * weights * n + attention_flops(engines["fp32"], n)
            tps = {k: n / s for k, s in seconds.items()}
            out["prefill"][n] = {"tok_s": tps, "peak_fraction": _fraction(flops, seconds, peak)}
            _row(f"prefill {n} tokens, tok/s", tps, _fraction(flops, seconds, peak))

        out["decode"] = {}
        prompt = torch.randint(100, 40000, (64,), generator=g).tolist()
        for c in args.concurrency:
            params = SamplingParams(max_tokens=args.decode_tokens, temperature=1.0, seed=7)
            counts: dict[str, int] = {}

            async def decode(
                name: str, e: Engine, c: int = c, params: SamplingParams = params,
                counts: dict[str, int] = counts,
            ) -> None:
                done = await e.sample(prompt, params, n=c)
                counts[name] = sum(len(x.tokens) for x in done)  # a row may stop before the end

            seconds = await paired(engines, args.repeats, decode)
            tps = {k: counts[k] / s for k, s in seconds.items()}
            out["decode"][c] = {"tok_s": tps}
            _row(f"decode at {c} concurrent, tok/s summed", tps)

        batch = make_batch(args.train_tokens, 8, 0.5, mixed=True)
        tokens = sum(len(d.prompt_ids) + len(d.completion_ids) for d in batch)
        optim = OptimSpec(learning_rate=1e-6)
        seconds = await paired(engines, args.repeats, lambda _, e: e.train_step(batch, LossSpec(), optim))
        flops = 2 * 2 * weights * tokens + 3 * sum(
            attention_flops(engines["fp32"], len(d.prompt_ids) + len(d.completion_ids)) for d in batch
        )
        tps = {k: tokens / s for k, s in seconds.items()}
        out["train_step"] = {"tokens": tokens, "tok_s": tps, "peak_fraction": _fraction(flops, seconds, peak)}
        _row(f"train_step, mixed batch of {tokens} tokens, tok/s", tps, _fraction(flops, seconds, peak))
        for engine in engines.values():
            engine.close()
    out["load_after"] = _load()
    print(f"load average before {out['load_before']}, after {out['load_after']}")
    if args.json:
        print(json.dumps(out))


def _fraction(flops: float, seconds: dict[str, float], peak: dict[str, float]) -> dict[str, float]:
    return {k: flops / s / 1e9 / peak[k] for k, s in seconds.items()}


def _row(what: str, figures: dict[str, float], fraction: dict[str, float] | None = None) -> None:
    line = f"{what:<44} fp32 {figures['fp32']:9.1f}  bf16 {figures['bf16']:9.1f}  ratio {figures['bf16'] / figures['fp32']:5.2f}"
    if fraction:
        line += f"  of peak: fp32 {fraction['fp32']:.0%} bf16 {fraction['bf16']:.0%}"
    print(line, flush=True)


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


if __name__ == "__main__":
    asyncio.run(main())
