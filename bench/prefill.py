"""Prompts prefilled together (`prefill.Prefill`, what the engine does for the requests it admits
at once) against the same prompts prefilled one forward each (what it did before), on the engine's
own model: general probe questions as chat prompts, the chat template's opening cached as the
prefix cache would hold it.

    .venv/bin/python bench/prefill.py --rows 1 4 16 64

Prints, per row count, the milliseconds of each way (median of `--repeats`) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from clawbridge.learning.probes import general_probes
from clawbridge.local_gpu import models, precision
from clawbridge.local_gpu.engine import Engine
from clawbridge.local_gpu.kvcache import CACHE, cache_of
from clawbridge.local_gpu.prefill import prefill
from decode import chat
from transformers import DynamicCache


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.EMBEDDED)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=[*sorted(precision.DTYPES), "auto"])
    args = parser.parse_args()
    spec = models.resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(spec, data_dir=Path(tmp), dtype=precision.resolve(args.dtype, "cpu"))
        engine.start()  # the scheduler thread idles: the forwards below run on this one
        try:
            prompts = [tuple(chat(engine, p.question)) for p in general_probes()]
            shared = 0
            while all(p[shared] == prompts[0][shared] for p in prompts):
                shared += 1
            with torch.inference_mode():
                out = engine._forward([engine._row(0)], input_ids=torch.tensor([prompts[0][:shared]]), use_cache=True)
                layers = [(layer.keys, layer.values) for layer in cache_of(out).layers]

            def cached() -> DynamicCache:  # the prefix cache's hand-out: a fresh cache on the kept tensors
                return DynamicCache(ddp_cache_data=layers)

            def alone(group: list[tuple[int, ...]]) -> None:
                with torch.inference_mode():
                    for p in group:
                        engine._forward([engine._row(0)], input_ids=torch.tensor([p[shared:]]), use_cache=True,
                                        logits_to_keep=1, position_ids=torch.arange(shared, len(p)).view(1, -1),
                                        **{CACHE: cached()})

            def together(group: list[tuple[int, ...]]) -> None:
                layout = prefill(group, [cached() for _ in group], device="cpu", mask_dtype=engine._query_dtype)
                with torch.inference_mode():
                    engine._forward([engine._row(0)] * len(group), **layout.inputs, use_cache=True, logits_to_keep=1)

            new = statistics.median(len(p) - shared for p in prompts)
            print(f"model {spec.name} ({precision.name(engine.dtype)}), {torch.get_num_threads()} threads; "
                  f"chat prompts of {shared} cached + a median {new:.0f} new tokens")
            for rows in args.rows:
                group = prompts[:rows]
                a = median_ms(lambda g=group: alone(g), args.repeats)
                b = median_ms(lambda g=group: together(g), args.repeats)
                print(f"{rows:3d} prompts: one forward each {a:8.1f} ms, together {b:8.1f} ms "
                      f"({b / rows:6.1f} ms a prompt), {a / b:5.2f}x")
        finally:
            engine.close()


if __name__ == "__main__":
    main()
