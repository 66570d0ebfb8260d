"""A served adapter merged into the bf16 weights (`engine_merge_adapters`) against the same adapter
beside them: decode rate, and how far the logprobs move.

    .venv/bin/python bench/merged_adapters.py --adapter .clawbridge-demo/adapters/v5

`--adapter`: a published version's folder (a finished `make demo` leaves several); without it
the bench serves random LoRA weights of the demo's rank (entries of 0.02: not what training
makes, so read the rate from them, the agreement from a trained adapter). Two engines (bf16, on this CPU), one merging and one not, serve the same weights.
Each answers the first `--probes` general probe questions at once (`--rounds` times, the two
engines alternating; medians), then:

- *rate*: tokens/s of each, and merged / beside;
- *agreement*: every answer the merging engine sampled is scored by both engines. A score by the
  merging engine is what `score` returns for that version; one by the other engine is what the
  adapter beside the weights gives, as the trainer's forward computes it (mean and max |Δ| over
  the sampled tokens, against the sampled logprobs). The same for the other engine's answers.
- *kept*: on the answers sampled beside, the slope of (merged − base) on (beside − base) logprobs:
  the share of the adapter's effect the merged weights keep (1: all of it; rounding each merged
  weight to the nearest bf16 value drops every change under half a step).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from clawbridge.learning.probes import general_probes
from clawbridge.local_gpu import adapters, models, precision
from clawbridge.local_gpu.engine import Engine
from clawbridge.types import Completion, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from decode import (
    chat,  # a sibling script: a probe question as decode.py sends it
)


async def answers(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, list[Completion]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.7)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.sample(p, dataclasses.replace(params, seed=i), n=1, version=1)
                                  for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, [out[0] for out in outs]


async def gaps(scorer: Engine, prompts: list[list[int]], sampled: list[Completion]) -> tuple[float, float]:
    """(mean, max) |score − sampled logprob| over every sampled token, scored by `scorer`."""
    diffs: list[float] = []
    for prompt, c in zip(prompts, sampled, strict=True):
        scores = await scorer.score(prompt, c.tokens, model="policy", temperature=0.7)
        diffs += [abs(a - b) for a, b in zip(scores, c.logprobs, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


async def kept(engines: dict[bool, Engine], prompts: list[list[int]], sampled: list[Completion]) -> float:
    """How much of what the adapter moves survives the merge: the least-squares slope of the merged
    version's logprob − the base's on the adapter's own (beside) − the base's, over every token."""
    xy = xx = 0.0
    for prompt, c in zip(prompts, sampled, strict=True):
        base = await engines[False].score(prompt, c.tokens, model="base", temperature=0.7)
        beside = await engines[False].score(prompt, c.tokens, model="policy", temperature=0.7)
        merged = await engines[True].score(prompt, c.tokens, model="policy", temperature=0.7)
        for b, x, y in zip(base, beside, merged, strict=True):
            xy += (x - b) * (y - b)
            xx += (x - b) ** 2
    return xy / xx


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter", type=Path, help="a published version's folder (adapters/vK)")
    ap.add_argument("--rank", type=int, default=16, help="the LoRA rank (the adapter's own when --adapter is given)")
    ap.add_argument("--probes", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nearest", action="store_true",
                    help="merge with round-to-nearest instead of the engine's stochastic rounding (the comparison)")
    args = ap.parse_args()
    if args.nearest:
        precision.round_stochastically = lambda x, gen: x.to(torch.bfloat16)  # type: ignore[assignment]
    spec = models.resolve(models.EMBEDDED)
    dtype = precision.resolve("auto", "cpu")
    if args.adapter is not None:
        args.rank = int(json.loads((args.adapter / adapters.CONFIG).read_text())["r"])
    with tempfile.TemporaryDirectory() as tmp:
        engines = {merge: Engine(spec, data_dir=Path(tmp) / str(merge), lora_rank=args.rank, lora_alpha=args.rank,
                                 dtype=dtype, merge_adapters=merge) for merge in (True, False)}
        for e in engines.values():
            e.start()
        try:
            folder = args.adapter
            if folder is None:  # random weights, published once and served by both
                shapes = await engines[True].trainable_state()
                gen = torch.Generator().manual_seed(0)
                weights = {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in shapes.items()}
                root = Path(tmp) / "published"
                adapters.reserve(root, 1)
                folder = adapters.write(root, 1, weights, adapters.config_json(engines[True]._model, adapters.TRAIN))
            for e in engines.values():
                await e.restore(1, str(folder))
            merging = engines[True]._merged is not None
            print(f"model {spec.name} ({precision.name(dtype)}), adapter {folder} (rank {args.rank}); "
                  f"this engine {'merges' if merging else 'cannot merge (no packed bf16 weights): both rows run beside'}")
            prompts = [chat(engines[True], p.question) for p in general_probes()[: args.probes]]
            seconds: dict[bool, list[float]] = {True: [], False: []}
            sampled: dict[bool, list[Completion]] = {}
            for _ in range(args.rounds):
                for merge, e in engines.items():
                    took, sampled[merge] = await answers(e, prompts, args.tokens)
                    seconds[merge].append(took)
            tokens = {m: sum(len(c.tokens) for c in cs) for m, cs in sampled.items()}
            med = {m: statistics.median(s) for m, s in seconds.items()}
            for merge in (True, False):
                print(f"{'merged' if merge else 'beside':7s} {args.probes} answers: {med[merge]:6.1f} s median of "
                      f"{args.rounds}, {tokens[merge] / med[merge]:6.1f} tokens/s")
            print(f"merged / beside: {med[False] / med[True]:.2f}x the rate")
            for merge in (True, False):
                for by in (True, False):
                    mean, most = await gaps(engines[by], prompts, sampled[merge])
                    print(f"sampled {'merged' if merge else 'beside'}, scored {'merged' if by else 'beside'}: "
                          f"|Δ logprob| mean {mean:.4f}, max {most:.3f}")
            print(f"the adapter's effect kept merged: {await kept(engines, prompts, sampled[False]):.3f} "
                  "(1: all of it; below 1, the merged version is less trained than its adapter)")
        finally:
            for e in engines.values():
                e.close()


if __name__ == "__main__":
    asyncio.run(main())
