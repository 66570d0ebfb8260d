"""Renderer hot-path figures: incremental vs full prompt render on an OpenClaw-sized session,
and the streaming decoder's per-token cost at 1 K vs 8 K tokens (linear means a ratio near 1).

    .venv/bin/python bench/renderer.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from clawbridge.chat.renderer import Renderer
from clawbridge.local_gpu import models
from test_renderer import openclaw_sized_session


def main() -> None:
    tokenizer = models.load_tokenizer(models.resolve(models.TINY))
    requests, tools = openclaw_sized_session(12)
    incremental, full = Renderer(tokenizer), Renderer(tokenizer, incremental=False)
    full_ms, inc_ms = [], []
    for i, messages in enumerate(requests):
        t = time.perf_counter()
        expected = full.render(messages, tools=tools)
        full_ms.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        assert incremental.render(messages, tools=tools) == expected
        if i:  # the first request of a session is a full render by definition
            inc_ms.append(1e3 * (time.perf_counter() - t))
    f, n = statistics.median(full_ms), statistics.median(inc_ms)
    print(f"prompt render, {len(expected)} tokens: full {f:.1f} ms, incremental {n:.1f} ms, ratio {f / n:.1f}x")
    cache = incremental._cache
    assert cache is not None
    print(f"requests whose template text was rendered incrementally: {cache.text_hits} of {len(requests) - 1}")

    ids = tokenizer.encode("plain words 😀 and more words ")
    for label, count in (("1K", 1000), ("8K", 8000)):
        seq = (ids * (count // len(ids) + 1))[:count]
        best = float("inf")
        for _ in range(3):
            decoder = incremental.stream(["NEVER-SEEN"])
            t = time.perf_counter()
            for token in seq:
                decoder.feed([token])
            decoder.finish("length")
            best = min(best, time.perf_counter() - t)
        per = 1e6 * best / count
        print(f"stream decode, {label} tokens one at a time: {per:.1f} µs/token")
        if label == "1K":
            small = per
    print(f"per-token cost ratio 8K/1K: {per / small:.2f} (1.0 = linear total cost)")


if __name__ == "__main__":
    main()
