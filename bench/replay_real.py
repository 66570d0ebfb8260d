"""Replay a real-use run's samples through the trainer's own datums, under other settings.

`bench/real_use.py` takes most of an hour and decides two or three candidates; which settings
would let the weights learn the preference without costing the general probe is a question of
the steps alone. This takes the samples a recorded `clawbridge up` run judged (its turns,
instructions, hints and rewrites exactly as stored), builds each step's datums as the trainer
does (`Distillation.datums`: the student's view of an instructed turn, the teacher's prompt, the
fresh draws), trains them from v0 on a fresh local backend with `clawbridge up`'s settings for
the embedded model plus a configuration's changes, and after the chosen steps asks the gate's
general probe (plain) and the scenario's held-out prompts with the weights alone:

    .venv/bin/python bench/replay_real.py --data-dir RUN/data --configs "" "learning_rate=5e-4" \\
        "rewrites=off" "select=instructed" --after 1 2 3

A configuration is space-separated `name=value`: any flat setting name (`learning_rate`,
`w_rewrite`, `opd_topk`, `opd_draws`, `batch_size`, ...), or `rewrites=off` (the stored rewrites
left out), or `select=` `fifo` (the oldest first, as the trainer takes them; default),
`instructed` (turns served under an instruction), `approved` (samples the user did not correct)
or `corrected`. `--blends 0.75 0.5` measures the last step's candidate blended toward the base
as the gate would try it (`gate_blend`). v0 and the twin (v0 asked with the run's served instruction) are measured once,
on the same questions and seeds. Off-policy after the first step: the samples came from v0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from clawbridge.backends.local import LocalBackend
from clawbridge.chat.instructions import instructed
from clawbridge.chat.renderer import Renderer
from clawbridge.config import FLAT, Settings
from clawbridge.demo import scenario as scenarios
from clawbridge.judges import Teacher
from clawbridge.learning.distillation import Distillation
from clawbridge.learning.probes import gate_tiers, general_probes
from clawbridge.learning.trainer import warmed
from clawbridge.store import Sample, Store
from clawbridge.types import SamplingParams
from replay_steps import answers as replay_answers  # bench/, beside this script

SELECTIONS = ("fifo", "instructed", "approved", "corrected")


def parse_config(text: str) -> tuple[dict[str, Any], str, bool]:
    """(setting overrides by flat name, the selection, whether stored rewrites train) of a
    configuration's text."""
    overrides: dict[str, Any] = {}
    select, rewrites = "fifo", True
    for part in text.split():
        key, _, value = part.partition("=")
        if key == "select":
            if value not in SELECTIONS:
                raise SystemExit(f"select={value}: one of {', '.join(SELECTIONS)}")
            select = value
        elif key == "rewrites":
            rewrites = value != "off"
        elif key in FLAT:
            overrides[key] = yaml_value(value)
        else:
            raise SystemExit(f"{key!r} is neither a setting nor select/rewrites (in {text!r})")
    return overrides, select, rewrites


def yaml_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def recorded(store: Store) -> tuple[list[tuple[Sample, bool]], str | None]:
    """Every sample the run judged or trained, oldest first, each with whether its turn was
    served under an instruction; and the newest instruction served."""
    with store.engine.connect() as conn:
        ids = [r[0] for r in conn.exec_driver_sql(
            "select id from samples where state in ('judged', 'trained') order by id").all()]
    out, served = [], None
    for s in store.get_samples(ids):
        turn = store.get_turn(s.turn_id)
        ins = bool(turn is not None and turn.instruction)
        if ins and turn is not None:
            served = turn.instruction
        out.append((s, ins))
    return out, served


def chosen(samples: list[tuple[Sample, bool]], select: str) -> list[Sample]:
    keep = {
        "fifo": lambda s, ins: True,
        "instructed": lambda s, ins: ins,
        "approved": lambda s, ins: (s.reward or 0.0) > 0,
        "corrected": lambda s, ins: (s.reward or 0.0) < 0,
    }[select]
    return [s for s, ins in samples if keep(s, ins)]


async def measure(backend: LocalBackend, renderer: Renderer, sc: scenarios.Scenario, settings: Settings,
                  instruction: str | None, answers: int, max_tokens: int, seed: int, show: int) -> dict[str, float]:
    """The general probe as the gate asks it (its first 100 questions in its order, plain or with
    `instruction`) and the held-out prompts' truly satisfied rate as `bench/real_use.py` asks them."""
    g = settings.gating
    first, rest = gate_tiers(general_probes(), g.gate_probes, g.gate_probes_max)
    qs = [*first, *rest]
    gate_params = SamplingParams(max_tokens=g.gate_max_tokens, temperature=g.gate_temperature, seed=seed)
    held_params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)

    # each question's `answers` answers in a row (`replay_steps.answers`)
    probe = await replay_answers(backend, renderer, [(instructed([{"role": "user", "content": q.question}], instruction), q)
                                                     for q in qs], gate_params, answers)
    held = await replay_answers(backend, renderer, [(instructed(sc.messages(p), instruction), p)
                                                    for p in sc.heldout_prompts], held_params, answers)
    ok = [qs[i // answers].key.answered(t) for i, (t, _) in enumerate(probe)]
    verdicts = [sc.rate(sc.heldout_prompts[i // answers], t, f) for i, (t, f) in enumerate(held)]
    for i in range(min(show, len(qs))):
        t = probe[i * answers][0]
        print(f"    probe [{'ok' if ok[i * answers] else '--'}] {qs[i].question[:40]!r} -> {t[:90]!r}", file=sys.stderr)
    for i in range(min(show, len(sc.heldout_prompts))):
        t, v = held[i * answers][0], verdicts[i * answers]
        print(f"    held  [{'truly' if v.truly else 'pref' if v.preferred else 'ans' if v.answered else '--'}] "
              f"{sc.heldout_prompts[i][:40]!r} -> {t[:90]!r}", file=sys.stderr)
    return {"probe": sum(ok) / len(ok), "truly": sum(v.truly for v in verdicts) / len(verdicts),
            "preferred": sum(v.preferred for v in verdicts) / len(verdicts)}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sc = scenarios.load(args.scenario)
    work = Path(tempfile.mkdtemp(prefix="cb-replay-real-"))
    db = work / "recorded.db"
    shutil.copyfile(Path(args.data_dir) / "clawbridge.db", db)  # opening may migrate: never the run's own
    store = Store.open(f"sqlite:///{db}")
    samples, served = recorded(store)
    print(f"{len(samples)} judged samples ({sum(i for _, i in samples)} served under an instruction); "
          f"the instruction: {served!r}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    configs: list[str | None] = [*([] if args.no_reference else [None]), *args.configs]
    try:
        for text in configs:
            overrides, select, rewrites = parse_config(text or "")
            settings = Settings.load(backend="local", data_dir=work / f"d{len(rows)}", seed=args.seed, **overrides)
            backend = LocalBackend.from_settings(settings)
            await backend.start()
            renderer = Renderer(backend.tokenizer())
            label = text or "clawbridge up's recipe"
            try:
                if text is None:
                    for name, ins in (("v0", None), ("twin", served)):
                        t0 = time.perf_counter()
                        m = await measure(backend, renderer, sc, settings, ins, args.answers, args.max_tokens,
                                          args.seed, args.show)
                        rows.append({"config": name, "step": 0, **m})
                        print(f"{name:34s} step 0  probe {m['probe']:.0%}  truly {m['truly']:.0%}  "
                              f"preferred {m['preferred']:.0%}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
                    continue
                tr = settings.training
                teacher = Teacher(backend, renderer, model=tr.teacher, clip=settings.learning.opd_clip)
                distillation = Distillation(tr, backend, store, teacher, settings.learning.redraw_max_tokens)
                pool = chosen(samples, select)
                for k in range(1, max(args.after) + 1):
                    batch = pool[(k - 1) * tr.batch_size: k * tr.batch_size]
                    if len(batch) < tr.batch_size:
                        print(f"{label:34s} only {len(pool)} samples selected: no step {k}", file=sys.stderr)
                        break
                    if not rewrites:
                        batch = [replace(s, rewrite=None) for s in batch]
                    t0 = time.perf_counter()
                    datums = [d for row in await asyncio.gather(*(distillation.datums(s) for s in batch)) for d in row]
                    optim = warmed(tr.optim, k, tr.warmup_steps)
                    metrics = await backend.train_step(datums, tr.loss, optim)
                    await backend.publish()
                    took = time.perf_counter() - t0
                    if k in args.after:
                        m = await measure(backend, renderer, sc, settings, None, args.answers, args.max_tokens,
                                          args.seed, args.show)
                        rows.append({"config": label, "step": k, "datums": len(datums), "tokens": metrics.tokens,
                                     "step_seconds": took, **m})
                        print(f"{label:34s} step {k}  probe {m['probe']:.0%}  truly {m['truly']:.0%}  "
                              f"preferred {m['preferred']:.0%}  ({len(datums)} datums, {metrics.tokens} tokens, "
                              f"{took:.0f} s)", file=sys.stderr)
                if args.blends and k in args.after:
                    candidate = backend.newest
                    for alpha in args.blends:  # each of the last candidate's delta, as the gate would try it
                        await backend.blend(candidate, alpha)
                        m = await measure(backend, renderer, sc, settings, None, args.answers, args.max_tokens,
                                          args.seed, args.show)
                        rows.append({"config": label, "step": k, "blend": alpha, **m})
                        print(f"{label:34s} step {k} x {alpha:g}  probe {m['probe']:.0%}  truly {m['truly']:.0%}  "
                              f"preferred {m['preferred']:.0%}", file=sys.stderr)
            finally:
                await backend.close()
    finally:
        store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", required=True, help="a recorded real-use run's data directory (its clawbridge.db)")
    ap.add_argument("--scenario", default=scenarios.DEFAULT_SCENARIO)
    ap.add_argument("--configs", nargs="+", default=[""], help="configurations ('' is clawbridge up's recipe)")
    ap.add_argument("--after", nargs="+", type=int, default=[1, 3], help="steps after which to measure")
    ap.add_argument("--blends", nargs="*", type=float, default=[],
                    help="after the last step, its delta scaled by each (gate_blend), measured too")
    ap.add_argument("--answers", type=int, default=2, help="answers per question and measurement")
    ap.add_argument("--max-tokens", type=int, default=64, help="a held-out answer's max_tokens (real_use.py's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="print this many answers of each measurement")
    ap.add_argument("--no-reference", action="store_true", help="do not measure v0 and the twin")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
