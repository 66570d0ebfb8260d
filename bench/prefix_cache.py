"""Time to first token of a prompt that shares all but its tail with the previous one, with the
torch engine's prefix KV cache and without it, in the same run (issue 16: OpenClaw's consecutive
requests share all but 144-263 of ~14.1 K prompt tokens, and on a CPU their prefill is the turn).

    nice -n 10 .venv/bin/python bench/prefix_cache.py --tokens 3000 --differ 200

The engine with the cache serves request A (`--tokens` tokens of this repository's docs), then
request B: A's first tokens but the last `--differ`, which are other text; the engine without it
serves B alone. B's time to first token is the figure: without the cache it prefills all of B,
with it only the tail. Greedy, one token; B's first token must be the same either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine, collect
from clawbridge.types import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def _text_ids(engine: Engine, n: int, skip: int = 0) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < skip + n:
        raise SystemExit(f"the docs hold {len(ids)} tokens; ask for fewer")
    return list(ids[skip : skip + n])


async def _ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=())
    started = time.perf_counter()
    c = await collect(engine.sample_stream(prompt, params))
    return time.perf_counter() - started, c.tokens[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=models.EMBEDDED)
    parser.add_argument("--tokens", type=int, default=3000, help="request A's prompt length")
    parser.add_argument("--differ", type=int, default=200, help="B's tokens not shared with A")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    result: dict[str, object] = {
        "model": args.model,
        "prompt_tokens": args.tokens,
        "shared_tokens": args.tokens - args.differ,
        "threads": args.threads,
    }
    spec = models.resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        firsts = {}
        for name, budget in (("without", 0), ("with", 2048)):
            engine = Engine(
                spec, data_dir=Path(tmp) / name, threads=args.threads, prefix_cache_mb=budget
            )
            engine.start()
            try:
                a = _text_ids(engine, args.tokens)
                b = a[: args.tokens - args.differ] + _text_ids(engine, args.differ, args.tokens)
                if budget:  # the engine without the cache needs no A: it would prefill all of B
                    result["a_ttft_s"] = round((await _ttft(engine, a))[0], 2)
                seconds, firsts[name] = await _ttft(engine, b)
                result[f"b_ttft_s_{name}"] = round(seconds, 2)
                if budget:
                    result["cache_mb"] = round(engine.prefix_cache.used / 2**20, 1)
                    result["reused_tokens"] = engine.prefix_cache.tokens_reused
            finally:
                engine.close()
    result["same_first_token"] = firsts["with"] == firsts["without"]
    without, with_cache = result["b_ttft_s_without"], result["b_ttft_s_with"]
    assert isinstance(without, float) and isinstance(with_cache, float)
    result["b_ttft_ratio_without_over_with"] = round(without / with_cache, 1)
    result["torch"] = torch.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
