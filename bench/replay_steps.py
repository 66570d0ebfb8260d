"""Replay a demo run's training batches under other optimizer settings, and measure each.

The demo's candidates are judged on the general probe after one step from the served weights
(a held-back candidate is replaced by a copy of the served weights and a fresh optimizer). Which
optimizer settings keep that step within the price is a question of the step alone, so this
replays the batches a recorded run trained (its samples, rewrites and advantages exactly as
stored, in step order) from v0 on a fresh local backend, one configuration after another, and
after the chosen steps asks the general probe and the scenario's held-out prompts:

    .venv/bin/python bench/replay_steps.py --data-dir /tmp/run/data --configs lr=1e-3 lr=3e-4 \\
        "lr=1e-3 warmup=4" "lr=1e-3 finished" --after 1 3 5

A configuration is space-separated `key=value` (or a bare flag): `lr` (Adam's rate), `warmup`
(the rate ramps linearly over this many steps from a fresh optimizer: step k trains at
lr * min(1, k / warmup)), `finished` (train only rewrites that ended by themselves), `topk`
(top-k distillation of the hinted teacher, Settings.opd_topk), `eps` (Adam's epsilon), `rank`
(the LoRA rank), `draws` (that many fresh answers of the policy per hinted sample, trained on the
top-k term alone: on-policy distillation on fresh draws; needs `topk`). v0 and the
prompted twin (v0 asked for the run's standing preferences) are measured once, on the same
questions and seeds. Off-policy after the first step (the samples came from v0); the first step
is exactly what the gate judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from clawbridge.backends.local import LocalBackend
from clawbridge.chat.instructions import instructed
from clawbridge.chat.renderer import Renderer
from clawbridge.demo import scenario as scenarios
from clawbridge.demo.runner import demo_settings
from clawbridge.judges import Teacher
from clawbridge.learning import preferences
from clawbridge.learning.collector import turn_context
from clawbridge.learning.distillation import to_datums
from clawbridge.learning.probes import general_probes
from clawbridge.store import Sample, Store
from clawbridge.types import Datum, OptimSpec, SamplingParams


@dataclass(frozen=True)
class Config:
    label: str
    lr: float
    warmup: int = 0
    finished: bool = False
    topk: int = 0
    eps: float = 1e-8
    rank: int | None = None
    draws: int = 0

    def rate(self, k: int) -> float:
        """The learning rate of step k (1-based) after a fresh optimizer (pure)."""
        return self.lr * (min(1.0, k / self.warmup) if self.warmup > 0 else 1.0)


def parse_config(text: str, default_lr: float) -> Config:
    fields: dict[str, str] = {}
    for part in text.split():
        key, _, value = part.partition("=")
        fields[key] = value or "1"
    unknown = set(fields) - {"lr", "warmup", "finished", "topk", "eps", "rank", "draws"}
    if unknown:
        raise SystemExit(f"unknown config keys {sorted(unknown)} in {text!r}")
    return Config(text, float(fields.get("lr", default_lr)), int(fields.get("warmup", 0)), "finished" in fields,
                  int(fields.get("topk", 0)), float(fields.get("eps", 1e-8)),
                  int(fields["rank"]) if "rank" in fields else None, int(fields.get("draws", 0)))


def batches(data_dir: Path) -> tuple[list[list[Sample]], str | None]:
    """The trained samples of the recorded run, grouped by step, and its standing preferences
    (opening migrates a run recorded before the history tables)."""
    store = Store.open(f"sqlite:///{data_dir / 'clawbridge.db'}")
    try:
        steps = store.training_steps()
        with store.engine.connect() as conn:
            ids = [r[0] for r in conn.exec_driver_sql(
                "select id, step from samples where state = 'trained' order by step, id").all()]
        samples = store.get_samples(ids)
        by_step: dict[int, list[Sample]] = {}
        for s in samples:
            by_step.setdefault(int(s.step or 0), []).append(s)
        asked = preferences.wanted_instruction(preferences.reheard(store.history().preferences))
        return [by_step[st.step] for st in steps if st.step in by_step], asked
    finally:
        store.close()


def datums(batch: list[Sample], finished: bool, stop_ids: set[int],
           teacher: dict[int, list[int]] | None = None) -> list[Datum]:
    out = []
    for s in batch:
        for d in to_datums(s, (teacher or {}).get(s.id)):
            is_rewrite = s.rewrite is not None and tuple(d.completion_ids) == tuple(s.rewrite.ids)
            if finished and is_rewrite and (not d.completion_ids or d.completion_ids[-1] not in stop_ids):
                continue
            out.append(d)
    return out


async def teacher_prompts(data_dir: Path, recorded: list[list[Sample]], teacher: Teacher) -> dict[int, list[int]]:
    """The teacher prompt of every hinted recorded sample, as the trainer builds it."""
    store = Store.open(f"sqlite:///{data_dir / 'clawbridge.db'}", migrate=False)
    try:
        out = {}
        for s in (x for batch in recorded for x in batch if x.hint):
            turn = store.get_turn(s.turn_id)
            if turn is not None:
                out[s.id] = teacher.prompt_ids(turn_context(turn), s.hint)  # type: ignore[arg-type]
        return out
    finally:
        store.close()


async def fresh_draws(backend: LocalBackend, batch: list[Sample], teacher: dict[int, list[int]], n: int,
                      max_tokens: int) -> list[Datum]:
    """`n` answers of the current policy to each hinted sample's prompt, distilled from its teacher
    (no advantage of their own): on-policy distillation on fresh draws."""
    async def one(s: Sample) -> list[Datum]:
        params = SamplingParams(max_tokens=max_tokens, temperature=s.temperature)
        comps = await backend.sample(s.prompt_ids, params, n=n)
        return [Datum(s.prompt_ids, tuple(c.tokens), tuple(c.logprobs), (0.0,) * len(c.tokens), s.temperature,
                      tuple(teacher[s.id])) for c in comps if c.tokens]

    rows = await asyncio.gather(*(one(s) for s in batch if s.id in teacher))
    return [d for row in rows for d in row]


async def answers(backend: LocalBackend, renderer: Renderer, asks: list[tuple[list[dict[str, str]], object]],
                  params: SamplingParams, draws: int) -> list[tuple[str, str | None]]:
    async def one(messages: list[dict[str, str]]) -> list[tuple[str, str | None]]:
        comps = await backend.sample(renderer.render(messages), params, n=draws)
        return [(renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason) for c in comps]

    return [x for row in await asyncio.gather(*(one(m) for m, _ in asks)) for x in row]


async def measure(backend: LocalBackend, renderer: Renderer, sc: scenarios.Scenario, n_probes: int,
                  draws: int, seed: int, asked: str | None = None, show: int = 0) -> dict[str, float]:
    params = SamplingParams(max_tokens=sc.recipe.max_tokens, temperature=sc.recipe.temperature, seed=seed)
    probes = general_probes()[:n_probes]

    def wrap(messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return instructed(messages, asked)  # the twin, as the gate asks it

    got = await answers(backend, renderer, [(wrap([{"role": "user", "content": p.question}]), p) for p in probes],
                        params, draws)
    probe = [probes[i // draws].key.answered(t) for i, (t, _) in enumerate(got)]
    held = await answers(backend, renderer, [(wrap(sc.messages(p)), p) for p in sc.heldout_prompts], params, draws)
    verdicts = [sc.rate(sc.heldout_prompts[i // draws], t, f) for i, (t, f) in enumerate(held)]
    for i, (t, _) in enumerate(got[: show * draws : draws]):
        print(f"    probe [{'ok' if probe[i * draws] else '--'}] {t[:110]!r}", file=sys.stderr)
    for i, (t, _) in enumerate(held[: show * draws : draws]):
        v = verdicts[i * draws]
        print(f"    held  [{'truly' if v.truly else 'pref' if v.preferred else 'ans' if v.answered else '--'}] {t[:110]!r}",
              file=sys.stderr)
    share = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    return {"probe": share(probe), "truly": share([v.truly for v in verdicts]),
            "preferred": share([v.preferred for v in verdicts]), "answered": share([v.answered for v in verdicts])}


async def main_async(args: argparse.Namespace) -> int:
    sc = scenarios.load(args.scenario)
    recorded, asked = batches(Path(args.data_dir))
    if not recorded:
        raise SystemExit(f"no trained batches in {args.data_dir}")
    learning_rate = demo_settings(sc, Path(args.data_dir)).training.learning_rate  # the recipe's
    configs = [parse_config(c, learning_rate) for c in args.configs]
    print(f"{len(recorded)} recorded batches; the twin is asked: {asked!r}", file=sys.stderr)
    rows: list[dict[str, object]] = []
    for cfg in [*([] if args.no_reference else [None]), *configs]:
        rank = {} if cfg is None or cfg.rank is None else {"lora_rank": cfg.rank, "lora_alpha": cfg.rank}
        settings = demo_settings(sc, Path(tempfile.mkdtemp(prefix="cb-replay-")), seed=args.seed, **rank)
        backend = LocalBackend.from_settings(settings)
        await backend.start()
        renderer = Renderer(backend.tokenizer())
        stop_ids = set(renderer.stop_token_ids)
        try:
            if cfg is None:
                for label, ask in (("v0", None), ("twin", asked)):
                    t0 = time.perf_counter()
                    m = await measure(backend, renderer, sc, args.probes, args.draws, args.seed, ask, args.show)
                    rows.append({"config": label, "step": 0, **m})
                    print(f"{label:28s} step 0  probe {m['probe']:.0%}  truly {m['truly']:.0%}  "
                          f"preferred {m['preferred']:.0%}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
                continue
            tr = settings.training
            teacher = await teacher_prompts(Path(args.data_dir), recorded, Teacher(backend, renderer)) if cfg.topk else None
            loss = replace(tr.loss, topk=cfg.topk)
            for k, batch in enumerate(recorded[: max(args.after)], start=1):
                optim = OptimSpec(learning_rate=cfg.rate(k), grad_clip_norm=tr.optim.grad_clip_norm, eps=cfg.eps)
                extra = await fresh_draws(backend, batch, teacher or {}, cfg.draws, sc.recipe.max_tokens) if cfg.draws else []
                metrics = await backend.train_step(datums(batch, cfg.finished, stop_ids, teacher) + extra, loss, optim)
                await backend.publish()
                if k in args.after:
                    m = await measure(backend, renderer, sc, args.probes, args.draws, args.seed, None, args.show)
                    rows.append({"config": cfg.label, "step": k, "lr": optim.learning_rate, "tokens": metrics.tokens, **m})
                    print(f"{cfg.label:28s} step {k}  probe {m['probe']:.0%}  truly {m['truly']:.0%}  "
                          f"preferred {m['preferred']:.0%}  (lr {optim.learning_rate:.2g}, {metrics.tokens} tokens)",
                          file=sys.stderr)
        finally:
            await backend.close()
    print(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", required=True, help="a recorded run's data directory (its clawbridge.db)")
    ap.add_argument("--scenario", default=scenarios.DEFAULT_SCENARIO)
    ap.add_argument("--configs", nargs="+", default=["lr=1e-3"])
    ap.add_argument("--after", nargs="+", type=int, default=[1, 5], help="steps after which to measure")
    ap.add_argument("--probes", type=int, default=100)
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="print this many answers of each measurement")
    ap.add_argument("--no-reference", action="store_true", help="do not measure v0 and the twin")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
