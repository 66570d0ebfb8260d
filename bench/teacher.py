"""Can the hint teach this preference? How often the base model meets a scenario's check with and
without the correction as a system instruction (the teacher of OPD and of hint-guided rewrites,
docs/methods.md#the-teacher-prompt). A preference the hinted teacher rarely meets cannot be learned
from hints: the rewrites have nothing right to imitate and OPD nothing to pull towards.

    .venv/bin/python bench/teacher.py --scenario bench/scenarios/bullets.yaml --draws 4
    .venv/bin/python bench/teacher.py --scenario my.yaml --hint "Answer as a list." --show 3
    .venv/bin/python bench/teacher.py --probe --draws 4    # what the preference costs on the probe
    .venv/bin/python bench/teacher.py --probe --probes bridge/learning/probes_large.yaml --draws 2

Prints, over the held-out prompts × draws at the recipe's temperature and max_tokens: the share
that meets the preference, that answers the question, and both ("truly satisfied"), for the plain
prompt and for the hinted one, and `--show` answers of each for reading. `--probe` asks the
general probe set instead (the gate's and the demo's "does it still answer questions"), plain and
hinted: the probe rate a student that learned the preference as the teacher shows it would have;
`--probes FILE` asks another probe file of the same format (the larger set, or candidates for it),
and `--per-probe FILE` writes every probe answer with its verdict (JSON lines) for reading and for
replaying a gate's decisions on recorded answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.config import LearningSettings
from clawbridge.demo import scenario as scenarios
from clawbridge.demo.runner import demo_settings
from clawbridge.judges.hints import teacher_messages
from clawbridge.learning.probes import DEFAULT_MIN_WORDS, AnswerKey, Probe, general_probes
from clawbridge.learning.rewrite import (
    Draw,
    Pick,
    echoes,
    pick,
    question_of,
    scored,
    usable,
    without_question,
)
from clawbridge.types import SamplingParams

Rate = Callable[[str, str | None], scenarios.Verdict]


def load_probes(path: str | Path | None) -> tuple[Probe, ...]:
    """A probe file in the format of `clawbridge/learning/probes.yaml`; None: the shipped set."""
    if path is None:
        return general_probes()
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    min_words = int(data.get("min_words", DEFAULT_MIN_WORDS))
    return tuple(Probe(p["q"], AnswerKey(p["q"], tuple(str(k) for k in p["k"]), min_words)) for p in data["probes"])


async def rated(backend: LocalBackend, renderer: Renderer, params: SamplingParams, draws: int,
                asks: list[tuple[list[dict[str, str]], Rate]]) -> list[tuple[str, scenarios.Verdict]]:
    """`draws` answers to each (messages, rate) ask, concurrently, each with its verdict."""
    async def one(messages: list[dict[str, str]], rate: Rate) -> list[tuple[str, scenarios.Verdict]]:
        comps = await backend.sample(renderer.render(messages), params, n=draws)
        texts = [(renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason) for c in comps]
        return [(t, rate(t, f)) for t, f in texts]

    return [x for row in await asyncio.gather(*(one(m, r) for m, r in asks)) for x in row]


def rates(rows: list[tuple[str, scenarios.Verdict]]) -> dict[str, float]:
    n = len(rows)
    share = lambda f: sum(getattr(v, f) for _, v in rows) / n if n else math.nan  # noqa: E731
    return {"preferred": share("preferred"), "answered": share("answered"), "truly": share("truly"), "n": float(n)}


def print_rows(label: str, rows: list[tuple[str, scenarios.Verdict]], show: int, draws: int) -> None:
    """The first answer to each of the first `show` asks, marked as the simulated user sees it."""
    for text, v in rows[: show * draws : draws]:
        mark = "truly" if v.truly else "pref" if v.preferred else "answered" if v.answered else "neither"
        print(f"  [{label} · {mark}] {text[:160]!r}", file=sys.stderr)


async def measure(sc: scenarios.Scenario, hint: str, draws: int, model: str | None, seed: int,
                  show: int, picks: bool = False, picks_only: bool = False,
                  probe: bool = False, probes: tuple[Probe, ...] = (), per_probe: Path | None = None,
                  only: str | None = None) -> dict[str, dict[str, float]]:
    settings = demo_settings(sc, Path(tempfile.mkdtemp(prefix="cb-teacher-")), model=model, seed=seed)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    renderer = Renderer(backend.tokenizer())
    r = sc.recipe
    params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=seed)
    out: dict[str, dict[str, float]] = {}
    try:
        kinds = () if picks_only or probe else (("plain", lambda p: sc.messages(p)),
                                                 ("hinted", lambda p: teacher_messages(sc.messages(p), hint)))
        for label, build in kinds:
            asks = [(build(p), lambda t, f, p=p: sc.rate(p, t, f)) for p in sc.heldout_prompts]
            rows = await rated(backend, renderer, params, draws, asks)
            out[label] = rates(rows)
            print_rows(label, rows, show, draws)
        if probe:
            out.update(await probe_cost(sc, backend, renderer, params, hint, draws, show,
                                        probes or general_probes(), per_probe, only))
        if picks or picks_only:
            out.update(await compare_picks(sc, backend, renderer, params, hint, draws))
    finally:
        await backend.close()
    return out


async def probe_cost(sc: scenarios.Scenario, backend: LocalBackend, renderer: Renderer,
                     params: SamplingParams, hint: str, draws: int, show: int = 0,
                     probes: tuple[Probe, ...] = (), per_probe: Path | None = None,
                     only: str | None = None) -> dict[str, dict[str, float]]:
    """What the preference itself costs the base model on the general probe set (which the
    gate and the demo hold a version to): each probe question asked plain and with the hint as a
    system instruction (the teacher a rewrite imitates), `draws` answers each. `answered` is the
    probe's check; `preferred` the scenario's. The hinted rows are what a student that learned the
    preference exactly as the teacher shows it would score; `hinted, preferred` / `hinted, not
    preferred` split the hinted answers by whether they meet the preference, so the first is
    the probe rate of a student that always meets it, as far as the teacher's answers say.
    `per_probe` appends every answer as a JSON line; each kind's wall time per 100 answers is
    printed (what the gate pays for its probe on this machine)."""
    out: dict[str, dict[str, float]] = {}
    probes = probes or general_probes()
    kinds = (("probe, plain", lambda q: [{"role": "user", "content": q}]),
             ("probe, hinted", lambda q: teacher_messages([{"role": "user", "content": q}], hint)))
    for label, build in [k for k in kinds if only is None or k[0] == f"probe, {only}"]:
        asks = [(build(p.question), lambda t, f, p=p: scenarios.Verdict(sc.check.satisfied(t, f), p.key.answered(t)))
                for p in probes]
        t0 = time.perf_counter()
        rows = await rated(backend, renderer, params, draws, asks)
        took = time.perf_counter() - t0
        print(f"{label}: {len(rows)} answers in {took:.0f} s, {100 * took / len(rows):.1f} s per 100", file=sys.stderr)
        out[label] = rates(rows)
        print_rows(label, rows, show, draws)
        if per_probe is not None:
            with per_probe.open("a") as f:
                for i, (text, v) in enumerate(rows):
                    f.write(json.dumps({"kind": label, "seed": params.seed, "q": probes[i // draws].question,
                                        "answered": v.answered, "preferred": v.preferred, "text": text}) + "\n")
        if label == "probe, hinted":
            out["hinted, preferred"] = rates([x for x in rows if x[1].preferred])
            out["hinted, not preferred"] = rates([x for x in rows if not x[1].preferred])
    return out


async def compare_picks(sc: scenarios.Scenario, backend: LocalBackend, renderer: Renderer,
                        params: SamplingParams, hint: str, draws: int,
                        floors: tuple[float, ...] = (10.0, 15.0, 20.0, 25.0),
                        lifts: tuple[float, ...] = (0.2, 0.3, 0.5)) -> dict[str, dict[str, float]]:
    """Which hinted draw a rewrite should train: for each held-out and validation prompt,
    `draws` hinted draws scored as `write_rewrite` scores them (the policy without the hint, the
    teacher with the question blanked); the rates of the draw each rule picks (the product's
    `pick`), and `none`: prompts where the rule trains no rewrite at all. `lifts`: the lift
    floors tried on top of the default relevance floor (15 nats)."""
    rules: dict[str, tuple[Pick, float, float]] = {"surest": ("surest", -math.inf, -math.inf),
                                                   "lift": ("lift", -math.inf, -math.inf)}
    rules.update({f"lift, relevance >= {f:g}": ("lift", f, -math.inf) for f in floors})
    rules.update({f"lift, relevance >= 15, lift >= {x:g}": ("lift", 15.0, x) for x in lifts})
    hits: dict[str, list[scenarios.Verdict]] = {r: [] for r in rules}
    none = dict.fromkeys(rules, 0)
    # the tokens `write_rewrite` sends to `score` for its floors at the product's defaults (each
    # usable draw under the blanked prompt, those past relevance under the plain one): every
    # usable draw, against the finished ones first and the cut ones only when no finished one
    # passes (what it does)
    min_relevance = LearningSettings.model_fields["rewrite_min_relevance"].default
    min_lift = LearningSettings.model_fields["rewrite_min_lift"].default
    every_scored, finished_first = 0, 0

    async def one(prompt: str) -> None:
        nonlocal every_scored, finished_first
        messages = sc.messages(prompt)
        plain_ids = renderer.render(messages)
        at, question = question_of(messages) or (len(messages) - 1, prompt)
        blank_ids = renderer.render(teacher_messages(without_question(messages, at), hint))
        comps = await backend.sample(renderer.render(teacher_messages(messages, hint)), params, n=draws)
        parsed = [renderer.parse(c.tokens, c.finish_reason) for c in comps]
        texts = [m.content or "" for m in parsed]
        rows = [Draw(tuple(c.tokens), tuple(c.logprobs), echo=echoes(question, m), finished=c.finish_reason != "length")
                for c, m in zip(comps, parsed, strict=True)]
        every = range(len(rows))
        rows = await scored(backend, rows, every, plain_ids, "plain", model="base", temperature=params.temperature)
        rows = await scored(backend, rows, every, blank_ids, "alone", model="base", temperature=params.temperature)
        verdicts = [sc.rate(prompt, t, c.finish_reason) for t, c in zip(texts, comps, strict=True)]
        def cost(which: list[int]) -> int:
            return sum(len(blank_ids) + len(rows[i].ids)
                       + (len(plain_ids) + len(rows[i].ids)) * (rows[i].relevance >= min_relevance) for i in which)

        ok = usable(rows)
        done = [i for i in ok if rows[i].finished]
        passed = bool(usable([rows[i] for i in done], min_relevance=min_relevance, min_lift=min_lift))
        every_scored += cost(ok)
        finished_first += cost(done if passed else ok)
        for rule, (how, floor, lift) in rules.items():
            i = pick(rows, rule=how, min_relevance=floor, min_lift=lift)
            if i is None:
                none[rule] += 1
            else:
                hits[rule].append(verdicts[i])
        for d, v, t in zip(rows, verdicts, texts, strict=True):
            mark = "truly" if v.truly else "pref" if v.preferred else "answered" if v.answered else "neither"
            print(f"    [{mark:8s}] lift {d.lift:+.2f} relevance {d.relevance:+.2f}{' echo' if d.echo else ''} {t[:90]!r}",
                  file=sys.stderr)

    await asyncio.gather(*(one(p) for p in [*sc.heldout_prompts, *sc.gate_prompts]))
    print(f"tokens scored for the floors: {every_scored} scoring every usable draw, {finished_first} finished "
          f"draws first ({finished_first / max(1, every_scored):.2f}x)", file=sys.stderr)
    rate = lambda vs, f: sum(getattr(v, f) for v in vs) / len(vs) if vs else math.nan  # noqa: E731
    return {f"pick: {r}": {"preferred": rate(h, "preferred"), "answered": rate(h, "answered"),
                           "truly": rate(h, "truly"), "n": float(len(h)), "none": float(none[r])}
            for r, h in hits.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=scenarios.DEFAULT_SCENARIO)
    ap.add_argument("--hint", default=None, help="default: the scenario's first correction")
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="answers to print per prompt kind")
    ap.add_argument("--picks", action="store_true",
                    help="also compare the rules that pick a rewrite among the draws (held-out and validation prompts)")
    ap.add_argument("--picks-only", action="store_true", help="only the comparison of --picks")
    ap.add_argument("--probe", action="store_true",
                    help="instead of the held-out prompts: what the preference costs on the general probe set")
    ap.add_argument("--probes", type=Path, default=None, help="with --probe: this probe file instead of the shipped set")
    ap.add_argument("--per-probe", type=Path, default=None, help="with --probe: append every answer here (JSON lines)")
    ap.add_argument("--only", choices=("plain", "hinted"), default=None,
                    help="with --probe: only the plain or only the hinted answers (long runs in parts)")
    args = ap.parse_args(argv)
    sc = scenarios.load(args.scenario)
    hint = args.hint or sc.replies.unsatisfied[0]
    probes = load_probes(args.probes)
    asked = f"{len(probes)} probe questions" if args.probe else f"{len(sc.heldout_prompts)} prompts"
    print(f"scenario {sc.name} · hint {hint!r} · {asked} × {args.draws} draws")
    res = asyncio.run(measure(sc, hint, args.draws, args.model, args.seed, args.show, args.picks, args.picks_only,
                              args.probe, probes, args.per_probe, args.only))
    print(f"{'prompt':30s} {'preferred':>9s} {'answered':>9s} {'truly':>7s} {'n':>4s} {'none':>5s}")
    for label, row in res.items():
        pref = "" if row["preferred"] != row["preferred"] else f"{row['preferred']:.0%}"
        ans = "" if row["answered"] != row["answered"] else f"{row['answered']:.0%}"
        none = f"{row['none']:.0f}" if "none" in row else ""
        truly = "" if row["truly"] != row["truly"] else f"{row['truly']:.0%}"
        print(f"{label:30s} {pref:>9s} {ans:>9s} {truly:>7s} {row['n']:4.0f} {none:>5s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
