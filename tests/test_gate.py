"""The gate's decisions on a seeded grid of inputs, pinned bit for bit (tests/golden/gate.json).

`Gate.evaluate` runs against a fake backend whose every answer is a seeded draw with a rate per
version and question: figures (p-values included, as exact floats), decision, reason and the
order of the backend's calls must come out as recorded. The pure `decide` and its early look
are pinned over a grid of figures and rules. Regenerate only for an intended change of the
gate's decisions: `python tests/test_gate.py` (then say so in the commit)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from clawbridge.learning.gate import Asked, Gate, GateProbe
from clawbridge.learning.gate_rules import Comparison, GroupRule, decide, needs_more_probes
from clawbridge.learning.stats import GroupFigures
from clawbridge.types import SamplingParams

GOLDEN = Path(__file__).parent / "golden" / "gate.json"
INSTRUCTION = "Answer in one short sentence."


@dataclass(frozen=True)
class _Completion:
    tokens: tuple[int, ...]
    finish_reason: str


class _Renderer:
    """Messages pass through as the prompt; an answer's one token is its text ("1" or "0")."""

    def render(self, messages: Any) -> Any:
        return list(messages)

    def parse(self, tokens: Any, finish_reason: Any) -> Any:
        return SimpleNamespace(content=str(tokens[0]))


class _Backend:
    """Answers right with a rate per (version, asked with the instruction, question): a seeded
    draw per answer. Records every call in order."""

    def __init__(self, rates: dict[tuple[int, bool], list[float]], questions: list[str]) -> None:
        self.rates = rates
        self.questions = questions
        self.calls: list[str] = []

    async def sample(self, prompt: Any, params: SamplingParams, n: int = 1, version: int | None = None,
                     priority: str = "user") -> Any:
        assert version is not None
        assert priority == "background"  # the gate's probes never go ahead of the user
        if prompt and isinstance(prompt[0], int):  # a recent prompt's ids (pairwise)
            self.calls.append(f"r{prompt[0]}@{version}/{params.seed}")
            return [_Completion((version,), "stop")]
        twin = prompt[0]["role"] == "system"
        q = self.questions.index(prompt[-1]["content"])
        self.calls.append(f"{version}{'t' if twin else ''}:{q}x{n}/{params.seed}")
        rate = self.rates[(version, twin)][q]
        out = []
        for j in range(n):
            u = random.Random(f"{params.seed}:{version}:{twin}:{q}:{j}").random()
            out.append(_Completion((int(u < rate),), "stop" if j % 3 else "length"))
        return out


class _Pairwise:
    def __init__(self, prefer: dict[int, float]) -> None:
        self.prefer_rate = prefer

    async def prefer(self, messages: Any, a: str, b: str) -> float:
        return self.prefer_rate[int(messages[0]["content"])]


def _score(text: str, _finish: str | None) -> float:
    return float(text == "1")


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(20240611)
    cases = []
    for i in range(160):
        cases.append({
            "first": rng.choice([4, 8, 12]), "reserve": rng.choice([0, 0, 6, 20]),
            "validation": rng.choice([0, 0, 3, 6]), "kept": rng.random() < 0.5,
            "validation_samples": rng.choice([None, 3]), "reference": rng.choice(["twin", "twin", "v0"]),
            "non_inferiority": rng.random() < 0.6, "asked": rng.choice([None, INSTRUCTION, INSTRUCTION]),
            "max_price": rng.choice([0.05, 0.15, 0.15, 1.0]), "margin": rng.choice([0.05, 0.05, 0.1]),
            "alpha": rng.choice([0.1, 0.05]), "alpha_base": rng.choice([None, 0.2]),
            "samples": rng.choice([1, 1, 2]), "reference_samples": rng.choice([1, 3]),
            "serving": rng.choice([0, 1]), "recent": rng.choice([0, 0, 4]),
            "price_shift": rng.choice([0.0, 0.05, 0.1, 0.2, 0.4]),
            "serving_shift": rng.choice([0.0, 0.05, -0.05]),
            "candidate_shift": rng.choice([-0.1, 0.0, 0.05, 0.12, 0.3, 0.6]),
            "validation_shift": rng.choice([-0.1, 0.0, 0.1, 0.3]), "seed": rng.choice([0, 7, None]), "case": i,
        })
    return cases


def _run(case: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(case["case"])
    n_probe = case["first"] + case["reserve"]
    questions = [f"question {i}?" for i in range(n_probe + case["validation"])]
    base_rate = [rng.uniform(0.2, 0.95) for _ in questions]
    candidate = 2

    def shifted(shift: float, validation_shift: float = 0.0) -> list[float]:
        return [min(1.0, max(0.0, r - (validation_shift if i >= n_probe else shift))) for i, r in enumerate(base_rate)]

    rates = {(0, False): shifted(0.0), (0, True): shifted(case["price_shift"]),
             (1, False): shifted(case["serving_shift"]),
             (candidate, False): shifted(case["candidate_shift"], case["validation_shift"])}
    backend = _Backend(rates, questions)

    def probe(i: int) -> GateProbe:
        if i >= n_probe:
            return GateProbe("validation", ({"role": "user", "content": questions[i]},), _score,
                             case["validation_samples"], measures_preference=case["kept"])
        return GateProbe("probe", ({"role": "user", "content": questions[i]},), _score)

    first = [probe(i) for i in range(case["first"])] + [probe(i) for i in range(n_probe, len(questions))]
    reserve = [probe(i) for i in range(case["first"], n_probe)]
    recent = [([k, 5, 9], [{"role": "user", "content": str(k)}]) for k in range(case["recent"])]
    pairwise = _Pairwise({k: rng.choice([0.0, 0.2, 0.5, 0.8, 1.0]) for k in range(case["recent"])}) if recent else None
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=case["seed"])
    gate = Gate(backend, _Renderer(), first, params=params, samples=case["samples"],  # type: ignore[arg-type]
                reference_samples=case["reference_samples"], margin=case["margin"], alpha=case["alpha"],
                alpha_base=case["alpha_base"], reference=case["reference"], max_price=case["max_price"],
                non_inferiority=case["non_inferiority"], pairwise=pairwise, reserve=reserve)  # type: ignore[arg-type]
    d = asyncio.run(gate.evaluate(candidate, case["serving"], recent=recent, asked=Asked(case["asked"])))
    record = d.record()
    record["figures"] = {k: v for k, v in d.figures.items() if k != "seconds"}
    record["calls"] = hashlib.sha256("\n".join(backend.calls).encode()).hexdigest()[:16]
    return record


def _decide_grid() -> list[dict[str, Any]]:
    rng = random.Random(99)
    out = []
    for _ in range(300):
        comparisons = {}
        for k in range(rng.choice([1, 1, 2, 3])):
            delta = rng.choice([-0.3, -0.12, -0.06, -0.05, -0.04, 0.0, 0.05])
            reference = rng.choice([0.5, 0.62, 0.9])
            g = GroupFigures(reference + delta, reference, delta, rng.choice([0.001, 0.02, 0.08, 0.3, 1.0]),
                             rng.choice([0.0, 0.03, 0.15, 0.6, 0.995]))
            rule, margin, alpha = rng.choice(["harm", "proof", "within"]), rng.choice([0.05, 0.15]), rng.choice([0.1, 0.2])
            label, against = rng.choice(["", "the prompted twin"]), rng.choice(["serving", "v0", "twin"])
            row = GroupRule(f"g{k}", against, rule, margin, alpha, label)  # type: ignore[arg-type]
            comparisons[row.name] = Comparison(row, g)
        share = rng.choice([1 / 3, 0.32, 0.5, 1.0])
        out.append({"final": list(decide(comparisons)), "early": list(decide(comparisons, share=share)),
                    "doubtful": needs_more_probes(comparisons, share)})
    return out


def _golden() -> dict[str, Any]:
    return {"evaluate": [_run(c) for c in _cases()], "decide": _decide_grid()}


def test_the_gates_decisions_are_as_recorded():
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(_golden()))
    for i, (w, g) in enumerate(zip(want["evaluate"], got["evaluate"], strict=True)):
        assert g == w, (i, _cases()[i])
        assert list(g["figures"]) == list(w["figures"]), i  # in the order they are recorded
    for i, (w, g) in enumerate(zip(want["decide"], got["decide"], strict=True)):
        assert g == w, i


def test_the_grid_reaches_every_kind_of_decision():
    want = json.loads(GOLDEN.read_text())
    reasons = {r["reason"].split(":")[0].split(" (")[0] for r in want["evaluate"]}
    decisions = [r["decision"] for r in want["evaluate"]]
    assert 0.2 < decisions.count("accepted") / len(decisions) < 0.8, reasons
    assert any("gate_max_price (" in r["reason"] for r in want["evaluate"])  # the price
    assert any("v0 (gate_max_price)" in r["reason"] for r in want["evaluate"])  # the cap
    assert any("below the serving version" in r["reason"] for r in want["evaluate"])  # a preference group
    assert any("not shown within" in r["reason"] for r in want["evaluate"])  # proof
    assert any(r["reason"].startswith("recent vs serving") for r in want["evaluate"])
    assert any(r["figures"].get("probes_asked", 0) > 20 for r in want["evaluate"])  # the reserve asked


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(_golden(), indent=0) + "\n")
