"""The gate's two error rates against the prompted twin, measured, not argued.

    .venv/bin/python bench/gate_power.py                      # simulated probe sets
    .venv/bin/python bench/gate_power.py --replay answers.json  # recorded answers (bench/teacher.py --dump)
    .venv/bin/python bench/gate_power.py --validation            # the demo's validation split

For each design (probes asked, answers per probe of the twin) it prints how often the gate's rule
(`clawbridge.learning.gate_rules.decide`, the general probe judged `within` the margin of the twin)

- holds back a candidate **as good as the twin** (a fresh draw of the twin itself), and
- serves a candidate **10 points worse** than the twin (the same draw with a tenth of the
  probes' answers turned wrong: answers it had right, so the loss is exactly 10 points when the
  twin answers at least that share).

`--validation`: the demo's validation split (`GateProbe.measures_preference`: the preference itself, its mean
judged `within` the margin of the serving version) against the harm rule it had before (held back
only when shown worse beyond the margin, p < 0.1): how often each holds back a candidate that
keeps the preference as well as the serving version, and serves one 10 or 20 points worse. Each
prompt has its own rate around the split's (Beta, mean 35 %, as the demo's served versions read),
both versions answer every prompt the same number of times, independently (the engines' seed
coupling, which makes real pairs closer, is not counted).

Simulated: each probe has its own rate (Beta-distributed: most questions the model almost always
or almost never answers, as on the real set) and answers are independent draws. Replayed: the
per-probe scores of real answers (`--replay`), each run drawing the reference's answers and the
candidate's from different draws of the twin, so the spread is the real model's.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

from clawbridge.learning.gate_rules import Comparison, GroupRule, decide
from clawbridge.learning.stats import paired_worse

MARGIN = 0.05


def held_back(candidate: Sequence[float], twin: Sequence[float], margin: float = MARGIN) -> bool:
    """The gate's final decision on the general probe alone, against the twin."""
    fig = paired_worse(candidate, twin, margin)
    return decide({"probe vs twin": Comparison(GroupRule("probe", "twin", "within", margin, 0.1), fig)})[0] == "rejected"


def worsen(answers: Sequence[float], points: float, rng: random.Random) -> list[float]:
    """`answers` with right ones turned wrong until the rate falls by `points` (as a rate)."""
    out = list(answers)
    right = [i for i, a in enumerate(out) if a > 0]
    rng.shuffle(right)
    need = points * len(out)
    for i in right:
        if need <= 0:
            break
        take = min(out[i], need)
        out[i] -= take
        need -= take
    return out


def simulate(probes: int, ref_draws: int, runs: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    as_good = worse = 0
    for _ in range(runs):
        rates = [rng.betavariate(0.45, 0.35) for _ in range(probes)]
        twin = [sum(rng.random() < r for _ in range(ref_draws)) / ref_draws for r in rates]
        cand = [float(rng.random() < r) for r in rates]
        as_good += held_back(cand, twin)
        cand2 = [float(rng.random() < r) for r in rates]
        worse += not held_back(worsen(cand2, 0.10, rng), twin)
    return as_good / runs, worse / runs


def replay(draws: list[list[float]], probes: int, ref_draws: int, runs: int, seed: int) -> tuple[float, float]:
    """`draws[i]`: the scores of the twin's recorded answers to probe i (at least ref_draws + 1)."""
    rng = random.Random(seed)
    usable = [d for d in draws if len(d) >= ref_draws + 1]
    if len(usable) < probes:
        raise SystemExit(f"only {len(usable)} probes have {ref_draws + 1} recorded answers")
    as_good = worse = 0
    for _ in range(runs):
        chosen = rng.sample(usable, probes)
        picks = [rng.sample(d, ref_draws + 1) for d in chosen]
        twin = [sum(p[:ref_draws]) / ref_draws for p in picks]
        cand = [p[ref_draws] for p in picks]
        as_good += held_back(cand, twin)
        worse += not held_back(worsen(cand, 0.10, rng), twin)
    return as_good / runs, worse / runs


def validation(prompts: int, answers: int, loss: float, runs: int, seed: int, rate: float = 0.35,
               spread: float = 3.0) -> tuple[float, float]:
    """How often the preference rule (`within`) and the harm rule hold back a candidate `loss` below the serving
    version on the validation split (`loss` 0: as good as it)."""
    rng = random.Random(seed)
    within = harm = 0
    for _ in range(runs):
        rates = [rng.betavariate(rate * spread, (1 - rate) * spread) for _ in range(prompts)]
        worse = [max(0.0, r * (1 - loss / rate)) for r in rates]
        serving = [sum(rng.random() < r for _ in range(answers)) / answers for r in rates]
        cand = [sum(rng.random() < r for _ in range(answers)) / answers for r in worse]
        fig = paired_worse(cand, serving, MARGIN)
        within += decide({"validation vs serving": Comparison(GroupRule("validation", "serving", "within", MARGIN, 0.1), fig)})[0] == "rejected"
        harm += decide({"validation vs serving": Comparison(GroupRule("validation", "serving", "harm", MARGIN, 0.1), fig)})[0] == "rejected"
    return within / runs, harm / runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", type=Path, help="JSON {'asked': [[score per answer] per probe], ...}")
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validation", action="store_true", help="the demo's validation split: within vs harm rule")
    args = ap.parse_args()
    if args.validation:
        print(f"{'prompts':>7} {'answers':>7} {'rule':>5} {'held back when as good':>23} "
              f"{'served when 10 worse':>21} {'served when 20 worse':>21}")
        for prompts, answers in ((8, 4), (8, 8), (16, 4)):
            got = [validation(prompts, answers, loss, args.runs, args.seed) for loss in (0.0, 0.10, 0.20)]
            for i, rule in enumerate(("within", "harm")):
                print(f"{prompts:>7} {answers:>7} {rule:>5} {got[0][i]:>23.1%} {1 - got[1][i]:>21.1%} "
                      f"{1 - got[2][i]:>21.1%}")
        return
    draws = json.loads(args.replay.read_text())["asked"] if args.replay else None
    print(f"{'probes':>6} {'twin answers':>12} {'held back when as good':>23} {'served when 10 worse':>21}")
    for probes in (50, 100, 150, 200):
        for ref in (1, 2, 3):
            if draws is not None:
                if probes > len(draws) or any(len(d) < ref + 1 for d in draws[:probes]):
                    continue
                a, w = replay(draws, probes, ref, args.runs, args.seed)
            else:
                a, w = simulate(probes, ref, args.runs, args.seed)
            print(f"{probes:>6} {ref:>12} {a:>23.1%} {w:>21.1%}")


if __name__ == "__main__":
    main()
