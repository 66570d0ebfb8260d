"""Re-measure a finished demo run's versions on its held-out prompts with many answers each.

The demo reads each served version from 20 held-out prompts × `eval_samples` answers: enough to
show learning, too few to rank two versions a few points apart (one answer a prompt read seed
8's v3 at 65 % and its v5 at 30 %; this bench, eight a prompt, read them at 42 % and 35 %). This
loads the run's stored adapters (`DATA_DIR/adapters/vN`, the weights each version served or was
held back with) on the served base model, and asks every held-out prompt `--answers` times at
the scenario's temperature and max_tokens:

    .venv/bin/python bench/remeasure.py --data-dir /tmp/run/data                  # every version
    .venv/bin/python bench/remeasure.py --data-dir D1 --data-dir D2 --versions 0 last --answers 8

`last`: the version the run ended serving (the last its gate accepted). Prints per version the
share of answers that meet the preference, answer the question, and both (truly satisfied, the
demo's headline) with its 95 % interval over prompts. `--prompts validation` asks the gate's
validation split instead (what the gate judged each candidate's preference on). `--probe` asks the gate's general probe questions instead (the first `gate_probes_max` 100
the gate asks, `--answers` each at the gate's temperature 0.7 and 64 tokens), plain and, with
`--instruction TEXT`, asked for it as it is served (`chat.instructions.instructed`): what a
version answers with and without the instruction on top of its weights (a `clawbridge up` run's
data directory has the adapters too). Sampling is
transformers' own (not the engine's, so answers are not those the demo saw; the distribution is
the same model's), bf16 as the demo serves, the base with the served RoPE scaling
(`models.load_model`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from clawbridge.chat.renderer import Renderer
from clawbridge.demo import scenario as scenarios
from clawbridge.local_gpu import models
from clawbridge.store import Store


def served_last(data_dir: Path) -> int:
    """The version the run ended serving: the last the gate accepted (v0 when none was); a run
    without a gate served every version it trained."""
    with Store.open(f"sqlite:///{data_dir / 'clawbridge.db'}") as store:
        decisions = store.history().decisions
    if not decisions:
        return max((int(p.name[1:]) for p in (data_dir / "adapters").glob("v*") if p.name[1:].isdigit()), default=0)
    accepted = [d.candidate for d in decisions if d.decision == "accepted"]
    return accepted[-1] if accepted else 0


def interval(per_prompt: list[float]) -> tuple[float, float, float]:
    """Mean of per-prompt rates and its 95 % t-interval over prompts (the demo's, against zero)."""
    mean, lo, hi = scenarios.paired_interval([0.0] * len(per_prompt), per_prompt)
    return mean, max(0.0, lo), hi


def generate(model: Any, tok: Any, rows: list[list[int]], answers: int, seed: int, temperature: float,
             max_tokens: int) -> list[list[tuple[str, bool]]]:
    """`answers` sampled answers to each rendered prompt of `rows` (left-padded into one batch,
    seeded once): per row, each answer's text and whether it ended by itself."""
    import torch

    width = max(len(x) for x in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in rows])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in rows])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                             top_p=1.0, top_k=0, max_new_tokens=max_tokens, num_return_sequences=answers,
                             pad_token_id=pad, eos_token_id=tok.eos_token_id)
    texts: list[list[tuple[str, bool]]] = []
    for i in range(len(rows)):
        texts.append([])
        for j in range(answers):
            seq = out[i * answers + j, width:].tolist()
            finished = tok.eos_token_id in seq
            texts[-1].append((tok.decode(seq[: seq.index(tok.eos_token_id)] if finished else seq,
                                         skip_special_tokens=True), finished))
    return texts


def measure(model: Any, tok: Any, sc: scenarios.Scenario, answers: int, seed: int,
            prompts: list[str] | None = None) -> dict[str, Any]:
    r = sc.recipe
    renderer = Renderer(tok)
    prompts = sc.heldout_prompts if prompts is None else prompts
    drawn = generate(model, tok, [renderer.render(sc.messages(p)) for p in prompts], answers, seed,
                     r.temperature, r.max_tokens)
    per: dict[str, list[float]] = {"preferred": [], "answered": [], "truly": []}
    for p, texts in zip(prompts, drawn, strict=True):
        verdicts = [sc.rate(p, text, "stop" if finished else "length") for text, finished in texts]
        for k in per:
            per[k].append(sum(getattr(v, k) for v in verdicts) / answers)
    return {k: interval(v) for k, v in per.items()} | {"truly_per_prompt": per["truly"]}


def gate_questions() -> list[Any]:
    """The general probe questions the gate asks, in its order (`probes.gate_tiers` with the
    measured recipe's 16 first and 100 in all)."""
    from clawbridge.learning.probes import gate_tiers, general_probes

    first, rest = gate_tiers(general_probes(), 16, 100)
    return first + rest


def probe_rate(model: Any, tok: Any, answers: int, seed: int, instruction: str | None) -> tuple[float, list[str]]:
    """The share of the gate's probe answers that answer the question (the gate's scorer, at its
    temperature 0.7 and 64 tokens), and the first answer to each question."""
    from clawbridge.chat.instructions import instructed

    renderer = Renderer(tok)
    qs = gate_questions()
    rows = [renderer.render(instructed([{"role": "user", "content": p.question}], instruction)) for p in qs]
    drawn = generate(model, tok, rows, answers, seed, 0.7, 64)
    ok = sum(p.key.answered(text) for p, texts in zip(qs, drawn, strict=True) for text, _ in texts)
    return ok / (len(qs) * answers), [texts[0][0] for texts in drawn]


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, action="append", required=True, help="a demo run's --data-dir")
    ap.add_argument("--scenario", default=scenarios.DEFAULT_SCENARIO)
    ap.add_argument("--versions", nargs="*", default=None, help="version numbers, or last (default: every stored one)")
    ap.add_argument("--answers", type=int, default=8, help="answers per prompt")
    ap.add_argument("--prompts", choices=("heldout", "validation"), default="heldout",
                    help="the held-out prompts (the demo's headline) or the gate's validation split")
    ap.add_argument("--probe", action="store_true", help="the gate's general probe instead (plain, and with --instruction)")
    ap.add_argument("--instruction", default=None, help="with --probe: also asked with this instruction (lines: preferences)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    from peft import PeftModel

    sc = scenarios.load(args.scenario)
    spec = models.resolve(models.EMBEDDED)
    tok = models.load_tokenizer(spec)
    base = models.load_model(spec, dtype=torch.bfloat16)
    prompts = sc.heldout_prompts if args.prompts == "heldout" else sc.gate_prompts
    print(f"scenario {sc.name} · {len(prompts)} {args.prompts} prompts × {args.answers} answers"
          if not args.probe else f"the gate's general probe · {len(gate_questions())} questions × {args.answers} answers",
          flush=True)
    if args.probe:
        print(f"{'run':<28} {'version':>7}  {'answered the probe, plain · with the instruction':<48}  {'s':>4}")
    else:
        print(f"{'run':<28} {'version':>7}  {'preferred':>9}  {'answered':>8}  {'truly satisfied (95 %)':>24}  {'s':>4}")
    results: list[dict[str, Any]] = []
    for d in args.data_dir:
        stored = sorted(int(p.name[1:]) for p in (d / "adapters").glob("v*") if p.name[1:].isdigit())
        wanted = args.versions or ["0", *map(str, stored)]
        for v in dict.fromkeys(served_last(d) if w == "last" else int(w) for w in wanted):
            if v != 0 and v not in stored:
                print(f"{d!s:<28} {v:>7}  no adapter stored", file=sys.stderr)
                continue
            t0 = time.monotonic()
            model = base if v == 0 else PeftModel.from_pretrained(base, str(d / "adapters" / f"v{v}"))
            if args.probe:
                forms = {"plain": None} | ({"instructed": args.instruction} if args.instruction else {})
                rates = {k: probe_rate(model, tok, args.answers, args.seed, ins) for k, ins in forms.items()}
                print(f"{str(d)[-28:]:<28} {v:>7}  " + " · ".join(
                    f"{k} {r:.0%}" for k, (r, _) in rates.items()) + f"  {time.monotonic() - t0:>4.0f} s", flush=True)
                results.append({"data_dir": str(d), "version": v, "probe": {k: r for k, (r, _) in rates.items()},
                                "answers": {k: a for k, (_, a) in rates.items()}})
                if v != 0:
                    base = model.unload()
                continue
            fig = measure(model, tok, sc, args.answers, args.seed, prompts)
            if v != 0:
                base = model.unload()
            t, lo, hi = fig["truly"]
            print(f"{str(d)[-28:]:<28} {v:>7}  {fig['preferred'][0]:>9.0%}  {fig['answered'][0]:>8.0%}  "
                  f"{t:>8.0%} [{lo:.0%}, {hi:.0%}]  {time.monotonic() - t0:>4.0f}", flush=True)
            results.append({"data_dir": str(d), "version": v, "prompts": args.prompts, **fig})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
