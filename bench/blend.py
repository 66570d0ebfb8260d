"""A held-back candidate blended toward the base: what the gate's general probe and the
scenario's held-out prompts read at each alpha (`Settings.gate_blend`, docs/methods.md).

A demo run whose lineage the gate gave up (every candidate held back on the general probe) keeps
its candidates' weights under its data dir. This loads one of them on a fresh local backend,
publishes its LoRA delta scaled by each alpha (`backend.blend`: base + alpha x delta), and asks
every version the gate's own general probe (its questions, each with its own seed, one answer a
candidate and two of v0 and the prompted twin, as the gate asks them) and the held-out prompts
(truly satisfied: the preference met and the question answered, two answers a prompt, each
prompt with its own seed):

    .venv/bin/python bench/blend.py --data-dir RUN/data --version 4 --alphas 1 0.75 0.5

Prints, per alpha, the probe rate and its paired difference from the twin (the gate's rule:
held back more than `gate_margin` below it), and truly satisfied / preference met / answered.
The run's data dir is read, never written (the candidate's weights are copied).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.demo import scenario as scenarios
from clawbridge.demo.runner import demo_settings
from clawbridge.learning import preferences
from clawbridge.learning.gate import question_seed
from clawbridge.local_gpu import adapters
from clawbridge.server import build_gate
from clawbridge.store import Store
from clawbridge.types import SamplingParams


def standing_instruction(data_dir: Path) -> str | None:
    """The twin's instruction of the recorded run: its standing preferences."""
    store = Store.open(f"sqlite:///{data_dir / 'clawbridge.db'}")
    try:
        return preferences.wanted_instruction(preferences.reheard(store.history().preferences))
    finally:
        store.close()


async def heldout(backend: LocalBackend, renderer: Renderer, sc: scenarios.Scenario, version: int, seed: int,
                  draws: int) -> dict[str, float]:
    base = SamplingParams(max_tokens=sc.recipe.max_tokens, temperature=sc.recipe.temperature)

    async def one(prompt: str) -> list[scenarios.Verdict]:
        params = dataclasses.replace(base, seed=question_seed(seed, prompt))
        comps = await backend.sample(renderer.render(sc.messages(prompt)), params, n=draws, version=version)
        return [sc.rate(prompt, renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason)
                for c in comps]

    verdicts = [v for row in await asyncio.gather(*(one(p) for p in sc.heldout_prompts)) for v in row]
    share = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    return {"truly": share([v.truly for v in verdicts]), "preferred": share([v.preferred for v in verdicts]),
            "answered": share([v.answered for v in verdicts])}


async def main_async(args: argparse.Namespace) -> int:
    sc = scenarios.load(args.scenario)
    run = Path(args.data_dir)
    source = adapters.folder(run / "adapters", args.version)
    if not (source / adapters.WEIGHTS).exists():
        raise SystemExit(f"no weights of policy@v{args.version} under {run / 'adapters'}")
    asked = standing_instruction(run)
    work = Path(tempfile.mkdtemp(prefix="cb-blend-"))
    held = work / "held"
    shutil.copytree(source, held)
    settings = demo_settings(sc, work / "data", seed=args.seed)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    try:
        renderer = Renderer(backend.tokenizer())
        gate = build_gate(settings.gating, backend, renderer, seed=settings.seed)
        assert gate is not None
        await backend.restore(args.version, str(held))  # the candidate, as the engine's newest version
        t0 = time.perf_counter()
        plain = await gate.general_scores(0, samples=settings.gating.gate_reference_samples)
        twin = await gate.general_scores(0, asked, samples=settings.gating.gate_reference_samples)
        v0 = await heldout(backend, renderer, sc, 0, args.seed, args.draws)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(f"the twin asked {asked!r}; {len(plain)} probe questions ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
        print(f"{'':16s} probe   vs twin   truly  preferred  answered")
        print(f"{'v0':16s} {mean(plain):5.1%}  {mean(plain) - mean(twin):+6.1%}   {v0['truly']:5.0%}  "
              f"{v0['preferred']:8.0%}  {v0['answered']:8.0%}")
        print(f"{'twin':16s} {mean(twin):5.1%}")
        for alpha in args.alphas:
            t0 = time.perf_counter()
            version = args.version if alpha == 1 else (await backend.blend(args.version, alpha)).version
            probe = await gate.general_scores(version, samples=settings.gating.gate_samples)
            held_out = await heldout(backend, renderer, sc, version, args.seed, args.draws)
            diff = mean([c - t for c, t in zip(probe, twin, strict=True)])
            print(f"{f'v{args.version} x {alpha:g}':16s} {mean(probe):5.1%}  {diff:+6.1%}   {held_out['truly']:5.0%}  "
                  f"{held_out['preferred']:8.0%}  {held_out['answered']:8.0%}   ({time.perf_counter() - t0:.0f} s)")
            sys.stdout.flush()
    finally:
        await backend.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", required=True, help="a demo run's data dir (--data-dir of clawbridge demo)")
    ap.add_argument("--version", type=int, required=True, help="the held-back candidate to blend")
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    ap.add_argument("--scenario", default="concise")
    ap.add_argument("--seed", type=int, default=0, help="the run's --seed (the gate's question seeds)")
    ap.add_argument("--draws", type=int, default=2, help="answers per held-out prompt")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
