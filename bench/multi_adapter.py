"""Many adapters over one base model in the torch engine (the embedded model, rank 16).

(a) Decode throughput of 8 requests in one batch, each on its own registered adapter (the stack's
per-row gather, and grouped by adapter), each as one of 8 users served their own version through
their lineages (what `clawbridge up` does for users other than `default`), against the same 8 requests on one registered adapter
(unmerged: the reference), on one published version merged into the bf16 weights (where the
engine merges), on one version beside the weights and on 8 versions in PEFT's mixed batch (a
second engine that does not merge). The configurations alternate within each round; the figures
are medians over rounds, the ratios taken within a round. Throughput is counted while all 8 rows
decode (from the last row's first token to the first row's last), so prefill and a row that ends
early do not enter it.

    .venv/bin/python bench/multi_adapter.py --tokens 48 --rounds 5 --threads 1
    .venv/bin/python bench/multi_adapter.py --tokens 48 --rounds 9 --threads 1 --only "8 adapters, one batch (gather)"

(b) `--registry 100`: that many adapters registered under `--budget-mb`: the slots' memory and
the process's resident memory (no prefix cache) against the budget, and the time to bring an evicted adapter back on its next request
(read from the safetensors in the cache dir into a slot), from the page cache and from disk
(the file's pages dropped first with posix_fadvise), median and max:

    .venv/bin/python bench/multi_adapter.py --registry 100 --budget-mb 512 --reloads 30
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.learning.lineages import LineageBackend, UserLineages
from clawbridge.learning.probes import general_probes
from clawbridge.local_gpu import models, precision
from clawbridge.local_gpu.engine import Engine
from clawbridge.store import Store
from clawbridge.store.records import PolicyVersionRow
from clawbridge.types import SamplingParams

ROWS = 8


def random_adapter(like: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in like.items()}


def chat(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     return_dict=False))


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def batch_rate(engine: Engine, prompts: list[list[int]], tokens: int,
                     adapters: list[str | None], versions: list[int | None]) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of the engine's thread) while every row
    decodes. The CPU clock is the steadier under other processes' load, and counts all the
    engine's work only with one intra-op thread (`--threads 1`)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    return await rows_rate(engine, [lambda i=i: engine.sample_stream(prompts[i], params, version=versions[i],
                                                                     adapter=adapters[i]) for i in range(len(prompts))])


async def views_rate(views: list[LineageBackend], prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """`batch_rate` through each user's own lineage (`learning.lineages`): row i as user i is served."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    engine = views[0].shared.engine  # type: ignore[attr-defined]
    return await rows_rate(engine, [lambda i=i: views[i].sample_stream(prompts[i], params) for i in range(len(prompts))])


async def rows_rate(engine: Engine, streams: list[Callable[[], AsyncIterator[Any]]]) -> tuple[float, float]:
    """The rows' tokens counted while all of them decode (from the last row's first token to the
    first row's last), by the wall clock and by the engine thread's CPU clock."""
    assert engine._thread is not None and engine._thread.ident is not None
    clock = time.pthread_getcpuclockid(engine._thread.ident)
    stamps: list[list[tuple[float, float]]] = [[] for _ in streams]

    async def one(i: int) -> None:
        async for _chunk in streams[i]():
            stamps[i].append((time.perf_counter(), time.clock_gettime(clock)))

    await asyncio.gather(*(one(i) for i in range(len(streams))))
    start = max((s[0] for s in stamps), key=lambda t: t[0])
    end = min((s[-1] for s in stamps), key=lambda t: t[0])
    counted = sum(1 for s in stamps for t in s if start[0] < t[0] <= end[0])
    if end[0] <= start[0]:
        return float("nan"), float("nan")
    return counted / (end[0] - start[0]), counted / (end[1] - start[1])


async def users_versions(backend: LocalBackend, data_dir: Path, weights: list[dict[str, torch.Tensor]]) -> list[LineageBackend]:
    """8 users, each with a version of their own published and recorded in a store, served through
    their lineages as `clawbridge up` serves them (a store of the run's own)."""
    store = Store.open(f"sqlite:///{data_dir / 'bench.db'}")
    for i, w in enumerate(weights):
        v = await publish(backend.engine, w)
        store.record_policy_version(PolicyVersionRow(version=v, path=str(data_dir / "merging" / "adapters" / f"v{v}"),
                                                     user=f"user{i}"))
    lineages = UserLineages(backend, store)
    await lineages.load()
    return [lineages.get(f"user{i}").backend for i in range(len(weights))]


async def publish(engine: Engine, weights: dict[str, torch.Tensor]) -> int:
    await engine._call(engine._set_trainable, weights)
    return (await engine.publish()).version


async def throughput(args: argparse.Namespace) -> None:
    spec = models.resolve(args.model)
    dtype = precision.resolve(args.dtype, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(lora_rank=args.rank, lora_alpha=args.rank, dtype=dtype, threads=args.threads, max_batch=16)
        local = LocalBackend(args.model, Path(tmp) / "merging", **kw)  # type: ignore[arg-type]
        merging = local.engine
        beside = Engine(spec, data_dir=Path(tmp) / "beside", merge_adapters=False, **kw)  # type: ignore[arg-type]
        merging.start()
        beside.start()
        try:
            like = await merging.trainable_state()
            weights = [random_adapter(like, i) for i in range(ROWS)]
            for i, w in enumerate(weights):
                await merging.register_adapter(f"user{i}", w)
            users = await users_versions(local, Path(tmp), weights)
            merged_v = await publish(merging, weights[0])
            peft_vs = [await publish(beside, w) for w in weights]
            prompts = [chat(merging, p.question) for p in general_probes()[:ROWS]]
            keys: list[str | None] = [f"user{i}" for i in range(ROWS)]
            none: list[str | None] = [None] * ROWS
            nov: list[int | None] = [None] * ROWS
            assert merging._stack is not None
            stack = merging._stack

            def gather(strategy: str) -> Callable[[], Awaitable[tuple[float, float]]]:
                async def run() -> tuple[float, float]:
                    stack.strategy = strategy  # type: ignore[assignment]
                    return await batch_rate(merging, prompts, args.tokens, keys, nov)
                return run

            configs: dict[str, Callable[[], Awaitable[tuple[float, float]]]] = {
                "8 adapters, one batch (gather)": gather("gather"),
                "8 users' own versions (lineages)": lambda: views_rate(users, prompts, args.tokens),
                "8 adapters, one batch (grouped)": gather("group"),
                "1 adapter, unmerged (reference)": lambda: batch_rate(merging, prompts, args.tokens,
                                                                      ["user0"] * ROWS, nov),
                f"1 version, {'merged' if merging._merged else 'beside'}": lambda: batch_rate(
                    merging, prompts, args.tokens, none, [merged_v] * ROWS),
                "1 version beside (PEFT)": lambda: batch_rate(beside, prompts, args.tokens, none,
                                                               [peft_vs[-1]] * ROWS),
                "8 versions, PEFT mixed batch": lambda: batch_rate(beside, prompts, args.tokens, none,
                                                                    list(peft_vs)),
            }
            if args.only:
                configs = {k: v for k, v in configs.items() if k.startswith(tuple(args.only)) or "reference" in k}
            for run in configs.values():  # warm-up: merged copies, slots, first-call costs
                await run()
            rates: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
            names = list(configs)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    rates[name].append(await configs[name]())
            ref = "1 adapter, unmerged (reference)"
            print(f"model {spec.name} ({precision.name(dtype)}), rank {args.rank}, {ROWS} rows, {args.tokens} tokens "
                  f"each, greedy, {args.rounds} rounds, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
            print(f"{'':34s} {'wall: tokens/s, x reference (rounds)':>44s}   engine CPU: tokens/s, x reference")
            for name in names:
                wall = [a[0] / b[0] for a, b in zip(rates[name], rates[ref], strict=True)]
                cpu = [a[1] / b[1] for a, b in zip(rates[name], rates[ref], strict=True)]
                print(f"{name:34s} {statistics.median(r[0] for r in rates[name]):7.1f}  {statistics.median(wall):.2f}x "
                      f"({min(wall):.2f}-{max(wall):.2f})        {statistics.median(r[1] for r in rates[name]):7.1f}  "
                      f"{statistics.median(cpu):.2f}x ({min(cpu):.2f}-{max(cpu):.2f})")
        finally:
            merging.close()
            beside.close()


async def registry(args: argparse.Namespace) -> None:
    spec = models.resolve(args.model)
    dtype = precision.resolve(args.dtype, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(spec, data_dir=Path(tmp), lora_rank=args.rank, lora_alpha=args.rank, dtype=dtype,
                        threads=args.threads, adapter_memory_mb=args.budget_mb,
                        prefix_cache_mb=0)  # the process's memory is then the model, the adapters and buffers
        engine.start()
        try:
            prompt = chat(engine, "Hello!")
            one = SamplingParams(max_tokens=1, temperature=0.0)
            await engine.sample(prompt, one)  # warm-up
            like = await engine.trainable_state()
            before = rss_mb()
            t0 = time.perf_counter()
            for i in range(args.registry):
                await engine.register_adapter(f"user{i}", random_adapter(like, i))
            took = time.perf_counter() - t0
            for i in range(args.registry):  # every adapter serves once: the slots all fill, most are evicted
                await engine.sample(prompt, one, adapter=f"user{i}")
            stats = engine.adapter_stats()
            print(f"model {spec.name} ({precision.name(dtype)}), rank {args.rank}, {args.registry} adapters of "
                  f"{stats.slot_bytes / 2**20:.1f} MB, budget {args.budget_mb} MB = {stats.slots} slots, "
                  f"load {os.getloadavg()[0]:.2f}")
            print(f"registered in {took:.1f} s ({took / args.registry * 1e3:.0f} ms each, the cache file written)")
            print(f"resident {stats.resident} adapters, {stats.resident_bytes / 2**20:.0f} MB of the "
                  f"{stats.budget_bytes / 2**20:.0f} MB budget; process RSS +{rss_mb() - before:.0f} MB since before "
                  f"registering; {stats.evictions} evictions, {stats.loads} loads")
            cache = Path(tmp) / "adapter-cache"
            for cold in (False, True):
                loads, firsts, hits = [], [], []
                for j in range(args.reloads):
                    key = f"user{j % args.registry}"
                    if key in engine.adapter_stats().resident_keys:
                        await engine.evict_adapter(key)
                    if cold:
                        for f in cache.glob(f"{key}-*.safetensors"):
                            fd = os.open(f, os.O_RDONLY)
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                            os.close(fd)
                    t = time.perf_counter()
                    await engine.sample(prompt, one, adapter=key)
                    firsts.append((time.perf_counter() - t) * 1e3)
                    loads.append(engine.adapter_stats().load_ms_last)
                    t = time.perf_counter()
                    await engine.sample(prompt, one, adapter=key)  # now resident
                    hits.append((time.perf_counter() - t) * 1e3)
                where = "from disk (pages dropped)" if cold else "from the page cache"
                print(f"back {where}: load {statistics.median(loads):.1f} ms median, {max(loads):.1f} max; "
                      f"one-token request {statistics.median(firsts):.0f} ms median against {statistics.median(hits):.0f} "
                      f"resident ({args.reloads} reloads)")
        finally:
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.EMBEDDED)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=[*sorted(precision.DTYPES), "auto"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", nargs="+", default=[], help="(a): only the configurations whose names start so (and the reference)")
    parser.add_argument("--registry", type=int, default=0, help="register this many adapters instead (part b)")
    parser.add_argument("--budget-mb", type=float, default=512)
    parser.add_argument("--reloads", type=int, default=30)
    args = parser.parse_args()
    asyncio.run(registry(args) if args.registry else throughput(args))


if __name__ == "__main__":
    main()
