"""Can the hint teach this preference? How often the base model meets a scenario's check with and
without the correction as a system instruction (the teacher of OPD and of hint-guided rewrites,
docs/methods.md#the-teacher-prompt). A preference the hinted teacher rarely meets cannot be learned
from hints: the rewrites have nothing right to imitate and OPD nothing to pull towards.

    .venv/bin/python bench/teacher.py --scenario bullets --draws 4
    .venv/bin/python bench/teacher.py --scenario my.yaml --hint "Answer as a list." --show 3

Prints, over the held-out prompts × draws at the recipe's temperature and max_tokens: the share
that meets the preference, that answers the question, and both ("truly satisfied"), for the plain
prompt and for the hinted one, and `--show` answers of each for reading.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.demo import scenario as scenarios
from clawbridge.demo.runner import demo_settings
from clawbridge.judges.hints import teacher_messages
from clawbridge.learning.probes import _STOP, words
from clawbridge.learning.rewrite import Draw
from clawbridge.types import SamplingParams


async def measure(sc: scenarios.Scenario, hint: str, draws: int, model: str | None, seed: int,
                  show: int, picks: bool = False, picks_only: bool = False) -> dict[str, dict[str, float]]:
    settings = demo_settings(sc, Path(tempfile.mkdtemp(prefix="cb-teacher-")), model=model, seed=seed)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    renderer = Renderer(backend.tokenizer())
    r = sc.recipe
    params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=seed)
    out: dict[str, dict[str, float]] = {}
    try:
        kinds = () if picks_only else (("plain", lambda p: sc.messages(p)),
                                         ("hinted", lambda p: teacher_messages(sc.messages(p), hint)))
        for label, build in kinds:
            async def one(prompt: str, build=build) -> list[tuple[str, scenarios.Verdict]]:
                comps = await backend.sample(renderer.render(build(prompt)), params, n=draws)
                texts = [(renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason) for c in comps]
                return [(t, sc.rate(prompt, t, f)) for t, f in texts]

            rated = [x for row in await asyncio.gather(*(one(p) for p in sc.heldout_prompts)) for x in row]
            n = len(rated)
            out[label] = {
                "preferred": sum(v.preferred for _, v in rated) / n,
                "answered": sum(v.answered for _, v in rated) / n,
                "truly": sum(v.truly for _, v in rated) / n,
                "n": float(n),
            }
            for text, v in rated[: show * draws : draws]:
                mark = "truly" if v.truly else "pref" if v.preferred else "answered" if v.answered else "neither"
                print(f"  [{label} · {mark}] {text[:160]!r}", file=sys.stderr)
        if picks or picks_only:
            out.update(await compare_picks(sc, backend, renderer, params, hint, draws))
    finally:
        await backend.close()
    return out


def content(question: str, text: str) -> set[str]:
    """The answer's content words the question does not already say."""
    q = set(words(question))
    return {w for w in words(text) if w not in _STOP and w not in q and w.rstrip("s") not in q}


async def compare_picks(sc: scenarios.Scenario, backend: LocalBackend, renderer: Renderer,
                        params: SamplingParams, hint: str, draws: int) -> dict[str, dict[str, float]]:
    """Which hinted draw a rewrite should train: for each prompt, the student's own answer and
    `draws` hinted draws; the truly-satisfied rate of the draw each rule picks."""
    rules = ("surest", "overlap", "lift", "finished+surest", "finished+overlap", "finished+lift")
    hits: dict[str, list[scenarios.Verdict]] = {r: [] for r in rules}

    async def one(prompt: str) -> None:
        [own] = await backend.sample(renderer.render(sc.messages(prompt)), params, n=1)
        own_text = renderer.parse(own.tokens, own.finish_reason).content or ""
        plain_ids = renderer.render(sc.messages(prompt))
        comps = await backend.sample(renderer.render(teacher_messages(sc.messages(prompt), hint)), params, n=draws)
        rows = []
        for c in comps:
            text = renderer.parse(c.tokens, c.finish_reason).content or ""
            conf = sum(c.logprobs) / len(c.logprobs) if c.logprobs else float("-inf")
            shared = len(content(prompt, text) & content(prompt, own_text))
            # how much more likely the hint made this draw: mean log p(draw | hint) - log p(draw | no hint)
            student = await backend.score(plain_ids, c.tokens, model="policy", temperature=params.temperature)
            lift = Draw(tuple(c.tokens), tuple(c.logprobs), tuple(student)).lift  # the product's rule
            rows.append((text, c.finish_reason, conf, shared, sc.rate(prompt, text, c.finish_reason), lift))
        done = [r for r in rows if r[1] == "stop"] or rows
        choice = {
            "surest": max(rows, key=lambda r: r[2]),
            "overlap": max(rows, key=lambda r: (r[3], r[2])),
            "lift": max(rows, key=lambda r: r[5]),
            "finished+surest": max(done, key=lambda r: r[2]),
            "finished+overlap": max(done, key=lambda r: (r[3], r[2])),
            "finished+lift": max(done, key=lambda r: r[5]),
        }
        for rule, row in choice.items():
            hits[rule].append(row[4])

    await asyncio.gather(*(one(p) for p in [*sc.heldout_prompts, *sc.gate_prompts]))
    return {f"pick:{r}": {"preferred": sum(v.preferred for v in h) / len(h),
                          "answered": sum(v.answered for v in h) / len(h),
                          "truly": sum(v.truly for v in h) / len(h), "n": float(len(h))} for r, h in hits.items()}


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
    args = ap.parse_args(argv)
    sc = scenarios.load(args.scenario)
    hint = args.hint or sc.replies.unsatisfied[0]
    print(f"scenario {sc.name} · hint {hint!r} · {len(sc.heldout_prompts)} prompts × {args.draws} draws")
    res = asyncio.run(measure(sc, hint, args.draws, args.model, args.seed, args.show, args.picks, args.picks_only))
    print(f"{'prompt':22s} {'preferred':>9s} {'answered':>9s} {'truly':>7s} {'n':>4s}")
    for label, row in res.items():
        pref = "" if row["preferred"] != row["preferred"] else f"{row['preferred']:.0%}"
        ans = "" if row["answered"] != row["answered"] else f"{row['answered']:.0%}"
        print(f"{label:22s} {pref:>9s} {ans:>9s} {row['truly']:7.0%} {row['n']:4.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
