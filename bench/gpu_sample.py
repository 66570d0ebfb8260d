"""Sampling throughput of the torch engine on GPU (point 5 of issue 6: without SGLang the local
backend serves with this engine on CUDA), random weights of a real architecture in bf16.

    python bench/gpu_sample.py --arch qwen3-4b --tokenizer build/gpu_assets/tokenizer
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine
from clawbridge.local_gpu.kvcache import CACHE, cache_of
from clawbridge.types import SamplingParams
from gpu_common import device_name, hbm_bandwidth, model_dir, write_result


async def run(engine: Engine, prompt: list[int], tokens: int, concurrency: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=tokens, temperature=1.0, stop_token_ids=())
    started = time.perf_counter()
    firsts: list[float] = []

    async def one(seed: int) -> int:
        n = 0
        async for chunk in engine.sample_stream(prompt, dataclasses.replace(params, seed=seed)):
            if n == 0:
                firsts.append(time.perf_counter() - started)
            n += len(chunk.tokens)
        return n

    counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "tokens": sum(counts),
        "tokens_per_s": round(sum(counts) / wall, 1),
        "per_request_tokens_per_s": round(sum(counts) / wall / concurrency, 1),
        "ttft_ms": round(1000 * sum(firsts) / len(firsts), 1),
    }


async def profile(engine: Engine, prompt: list[int], tokens: int = 16) -> None:
    """torch.profiler (host side, every thread: the engine's too) over one request's decode at
    c1: which ops and modules take the host's time per token. Host only: CUPTI tracing of every
    thread made the run stall on the H100 machine."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with torch_profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        started = time.perf_counter()
        await run(engine, prompt, tokens, 1)
        wall = time.perf_counter() - started
    print(f"profile: {tokens} tokens in {wall * 1000:.0f} ms wall", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def reference(folder: Path, prompt: list[int], tokens: int, batch: int) -> dict[str, float]:
    """The floor for an eager PyTorch decode of the same weights: plain Transformers (no PEFT, no
    scheduler), one forward per token for `batch` identical rows, greedy, one host sync per token
    (as any server streaming tokens has). The engine's ratio to this is its own overhead."""
    model = models.load_model(models.resolve(str(folder)), dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([prompt] * batch, device="cuda")
    with torch.inference_mode():
        for _ in range(2):  # warm-up, then the timed run
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.tolist()
            first = time.perf_counter() - started
            cache = cache_of(out)
            for _ in range(tokens - 1):
                out = model(input_ids=nxt, **{CACHE: cache}, use_cache=True)
                cache = cache_of(out)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.tolist()
            wall = time.perf_counter() - started
    del model, cache, out
    torch.cuda.empty_cache()
    return {
        "concurrency": batch,
        "tokens": tokens * batch,
        "tokens_per_s": round(tokens * batch / wall, 1),
        "per_request_tokens_per_s": round(tokens / wall, 1),
        "ttft_ms": round(1000 * first, 1),
    }


async def sweep(
    spec: models.ModelSpec, root: Path, args: argparse.Namespace, prompt: list[int], mode: str
) -> dict[str, Any]:
    """The engine in one decode mode (dynamic: the concatenated cache; static: the slotted
    static cache; graphs: static + CUDA graphs), base then a published adapter."""
    engine = Engine(
        spec,
        data_dir=root / mode,
        lora_rank=args.rank,
        lora_alpha=args.rank,
        device=args.device,
        dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
        max_batch=max(args.concurrency),
        static_cache=mode != "dynamic",
        cuda_graphs=mode == "graphs",
    )
    t = time.perf_counter()
    engine.start()
    rows: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t, 1)}
    try:
        await run(engine, prompt, 4, 1)  # warm-up
        for version in ("base", "adapter"):
            publish_s = None
            if version == "adapter":
                t = time.perf_counter()
                await engine.publish()
                publish_s = time.perf_counter() - t
                await run(engine, prompt, 4, 1)  # graphs are recorded per adapter
            rows[version] = {
                "publish_s": publish_s,
                "runs": [await run(engine, prompt, args.tokens, c) for c in args.concurrency],
            }
            print(mode, version, rows[version], flush=True)
        if args.profile:
            await profile(engine, prompt)
    finally:
        engine.close()
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-4b")
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["dynamic", "static", "graphs"],
        choices=["dynamic", "static", "graphs"],
    )
    ap.add_argument("--profile", action="store_true", help="print where a decode step's time goes")
    args = ap.parse_args()
    sys.setswitchinterval(0.0005)  # as `clawbridge up` runs (server.SWITCH_INTERVAL_S)
    root = Path(tempfile.mkdtemp(prefix="cb-sample-"))
    t = time.perf_counter()
    folder = model_dir(args.arch, Path(tempfile.gettempdir()) / "cb-models", args.tokenizer)
    made = time.perf_counter() - t
    spec = models.resolve(str(folder))
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt)]
    result: dict[str, Any] = {
        "arch": args.arch,
        "dtype": "bfloat16",
        "prompt": args.prompt,
        "tokens": args.tokens,
        "model_write_s": round(made, 1),
    }
    modes = []
    for mode in args.modes:
        try:
            result[mode] = await sweep(spec, root, args, prompt, mode)
            modes.append(mode)
        except Exception as e:  # one mode's failure is a finding: the others and the reference run
            result[f"{mode}_error"] = f"{type(e).__name__}: {e}"
            print(f"{mode} failed: {result[f'{mode}_error']}", flush=True)
    if args.profile or args.device != "cuda":
        return
    result["reference_hf_eager"] = {
        "runs": [reference(folder, prompt, args.tokens, c) for c in args.concurrency]
    }
    print("reference", result["reference_hf_eager"], flush=True)
    bandwidth = hbm_bandwidth(device_name())
    weights = sum(p.numel() for p in torch.nn.Module.parameters(_meta(folder))) * 2  # bf16 bytes
    limit = bandwidth / weights if bandwidth else None
    result["bandwidth_limit_tokens_per_s"] = round(limit, 1) if limit else None
    ratios: dict[str, Any] = {}
    for mode in modes:
        for i, c in enumerate(args.concurrency):
            engine_tps = result[mode]["adapter"]["runs"][i]["tokens_per_s"]
            eager_tps = result["reference_hf_eager"]["runs"][i]["tokens_per_s"]
            ratios[f"{mode}_c{c}_vs_eager"] = round(engine_tps / eager_tps, 2)
            if c == 1 and limit:
                ratios[f"{mode}_c1_of_bandwidth_limit"] = round(engine_tps / limit, 3)
            print(
                f"{mode} c{c}: engine (adapter v1) {engine_tps} tok/s vs plain eager {eager_tps} tok/s"
                f" = {engine_tps / eager_tps:.2f}x"
                + (
                    f"; {engine_tps / limit:.1%} of the {limit:.0f} tok/s bandwidth limit"
                    if c == 1 and limit
                    else ""
                ),
                flush=True,
            )
    result["ratios"] = ratios
    write_result("gpu_sample", result)


def _meta(folder: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))


if __name__ == "__main__":
    asyncio.run(main())
