"""What it costs to train several users' adapters on one engine (docs/learning.md#each-user-their-own-adapter):
the switch between two users' lineages (the one left saved as a checkpoint, the one entered loaded:
weights and Adam's moments) against the training step it precedes, on the embedded model.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/lineage_switch.py --steps 6 --rank 16

Alternates two users' steps (every step then switches), each a batch of `--batch` samples of
`--tokens` completion tokens, and prints the median and max of the switch and of the step, and
their ratio; then as many steps of one user alone (no switch) for the reference step time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from clawbridge.backends.local import LocalBackend
from clawbridge.learning.lineages import UserLineages
from clawbridge.local_gpu import models, precision
from clawbridge.store import Store
from clawbridge.types import Datum, OptimSpec


def batch(tokenizer, user: str, n: int, tokens: int, step: int) -> list[Datum]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(n):
        prompt = tuple(tokenizer.encode(f"{user} asks question {step}.{i}: why is the sky blue?"))
        completion = tuple(tokenizer.encode(" because" * tokens))[:tokens]
        out.append(Datum(prompt, completion, (-1.0,) * len(completion), (1.0,) * len(completion)))
    return out


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        backend = LocalBackend(args.model, Path(tmp), lora_rank=args.rank, lora_alpha=args.rank, threads=args.threads,
                               dtype=precision.resolve(args.dtype, "cpu"))
        await backend.start()
        store = Store.open(f"sqlite:///{Path(tmp) / 'bench.db'}")
        try:
            lineages = UserLineages(backend, store)
            await lineages.load()
            tok = backend.tokenizer()
            views = {u: lineages.get(u).backend for u in ("alice", "bob")}
            optim = OptimSpec(learning_rate=1e-4)
            switches, steps, alone = [], [], []
            for k in range(args.steps):
                user = ("alice", "bob")[k % 2]
                t0 = time.perf_counter()
                await lineages.board.hold(user)
                t1 = time.perf_counter()
                await views[user].train_step(batch(tok, user, args.batch, args.tokens, k), optim=optim)
                await views[user].publish()
                t2 = time.perf_counter()
                if k:  # the first step warms the engine up
                    switches.append(t1 - t0)
                    steps.append(t2 - t1)
            for k in range(args.steps):  # the reference: bob alone, no switch
                t1 = time.perf_counter()
                await views["bob"].train_step(batch(tok, "bob", args.batch, args.tokens, 100 + k), optim=optim)
                await views["bob"].publish()
                if k:
                    alone.append(time.perf_counter() - t1)
            print(f"model {args.model}, rank {args.rank}, batch {args.batch} x {args.tokens} tokens, "
                  f"{args.steps} steps alternating two users, load {os.getloadavg()[0]:.2f}")
            print(f"switch (save the left lineage, load the entered): median {statistics.median(switches) * 1e3:.0f} ms, "
                  f"max {max(switches) * 1e3:.0f} ms")
            print(f"step + publish after a switch: median {statistics.median(steps):.2f} s; one user alone: "
                  f"median {statistics.median(alone):.2f} s")
            print(f"switch / step: {statistics.median(switches) / statistics.median(alone):.3f}; steps with a switch "
                  f"against alone (switch included): "
                  f"{(statistics.median(switches) + statistics.median(steps)) / statistics.median(alone):.2f}x")
        finally:
            store.close()
            await backend.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.EMBEDDED)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=[*sorted(precision.DTYPES), "auto"])
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
