"""The probe rates and the price of a preference, from recorded probe answers.

    .venv/bin/python bench/teacher.py --probe --probes bridge/learning/probes_large.yaml --draws 2 \
        --per-probe answers.jsonl
    .venv/bin/python bench/probe_rates.py answers.jsonl --probes bridge/learning/probes_large.yaml

Reads the JSON lines `bench/teacher.py --per-probe` writes (kind, q, answered, ...), keeps the
questions of the probe file, and prints each kind's rate and the price (plain − hinted) paired by
question, with a 95 % t-interval over questions (each question's rate is the mean of its draws).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from clawbridge.demo.scenario import paired_interval
from teacher import load_probes


def per_question(rows: list[dict[str, object]], kind: str, questions: list[str]) -> list[float] | None:
    """Each question's answered rate under `kind`, in the order of `questions` (None if any is missing)."""
    got: dict[str, list[bool]] = defaultdict(list)
    for r in rows:
        if r["kind"] == kind:
            got[str(r["q"])].append(bool(r["answered"]))
    if not all(got.get(q) for q in questions):
        return None
    return [sum(got[q]) / len(got[q]) for q in questions]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("answers", type=Path)
    ap.add_argument("--probes", type=Path, default=None, help="default: the shipped probe set")
    args = ap.parse_args(argv)
    questions = [p.question for p in load_probes(args.probes)]
    rows = [json.loads(line) for line in args.answers.read_text().splitlines() if line.strip()]
    plain = per_question(rows, "probe, plain", questions)
    hinted = per_question(rows, "probe, hinted", questions)
    for label, rates in (("plain", plain), ("hinted", hinted)):
        if rates is not None:
            print(f"{label:8s} {sum(rates) / len(rates):.1%} over {len(rates)} questions")
    if plain is not None and hinted is not None:
        mean, lo, hi = paired_interval(hinted, plain)  # plain − hinted: the points the preference costs
        print(f"price    {100 * mean:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}] (plain − hinted, paired by question)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
