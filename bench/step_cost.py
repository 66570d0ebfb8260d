"""What does a training step cost the general probe, and what does it buy? A controlled A/B of
training recipes on the SAME data.

    .venv/bin/python bench/step_cost.py --conversations 32 --variants base lr3e-4 big-batch

1. Collect once: the demo's simulated user has `--conversations` conversations with policy@v0
   through the real stack (judge, hints, rewrites), with the gate off; the judged samples are
   read back from the store.
2. For every variant: start from v0's weights with a fresh optimizer, train `--steps` steps on
   those samples (batch_size each, in collection order), and after every step measure the
   general probe's on-topic rate (all 50 questions) and the held-out truly-satisfied rate,
   every version with the same seed per prompt (paired, common random numbers).

Prints per variant and step: probe, truly satisfied, preference met, answered; and the probe
questions lost and gained against v0 (paired). The variants differ only in the optimizer (and
how many optimizer steps a step takes: `micro4*`), the batch, the LoRA targets or the targets
trained (rewrites or the turns' own answers), so a difference between them is the recipe's, not
the data's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawbridge.backends.local import LocalBackend
from clawbridge.chat.renderer import Renderer
from clawbridge.config import TrainingSettings
from clawbridge.demo import scenario as scenarios
from clawbridge.demo.runner import demo_settings, eval_seed, run_demo
from clawbridge.learning.distillation import to_datums
from clawbridge.learning.probes import general_probes
from clawbridge.store import Sample, Store
from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams


@dataclass(frozen=True)
class Variant:
    name: str
    lr: float
    batch: int
    eps: float = 1e-8
    beta2: float = 0.999
    warmup: int = 0  # steps of linear lr warmup after the fresh optimizer
    own: bool = False  # train the turns' own answers (+1 on every token) instead of their rewrites
    # train the turns' own answers cut after their first sentence, with the end-of-turn token
    # added: "all" +1 on every token, "end" +1 on the added end token only (0 elsewhere)
    cut: str = ""
    targets: tuple[str, ...] = ()  # LoRA target modules (default: every linear layer)
    # optimizer steps per step, each on a slice of the batch; with `prime` the first is taken at
    # lr 0: it only fills Adam's moments, so that no step is a fresh Adam's sign-like first one
    micro: int = 1
    prime: bool = False


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def variants(training: TrainingSettings) -> dict[str, Variant]:
    lr, b = training.learning_rate, training.batch_size
    return {
        "base": Variant("base", lr, b),
        "lr3e-4": Variant("lr3e-4", 3e-4, b),
        "lr1e-4": Variant("lr1e-4", 1e-4, b),
        "big-batch": Variant("big-batch", lr, 4 * b),
        "warmup3": Variant("warmup3", lr, b, warmup=3),
        "eps1e-5": Variant("eps1e-5", lr, b, eps=1e-5),
        "eps1e-4": Variant("eps1e-4", lr, b, eps=1e-4),
        "beta2-0.99": Variant("beta2-0.99", lr, b, beta2=0.99),
        "eps1e-3": Variant("eps1e-3", lr, b, eps=1e-3),
        "own": Variant("own", lr, b, own=True),
        "attn": Variant("attn", lr, b, targets=ATTENTION),
        "attn-lr2e-3": Variant("attn-lr2e-3", 2 * lr, b, targets=ATTENTION),
        "micro4": Variant("micro4", lr / 4, b, micro=4),
        "micro4-prime": Variant("micro4-prime", lr / 3, b, micro=4, prime=True),
        "micro4-prime-lr": Variant("micro4-prime-lr", lr, b, micro=4, prime=True),
        "micro4-lr": Variant("micro4-lr", lr, b, micro=4),
        "cut": Variant("cut", lr, b, cut="all"),
        "cut-end": Variant("cut-end", lr, b, cut="end"),
    }


async def collect(sc: scenarios.Scenario, conversations: int, seed: int) -> tuple[Path, list[Sample]]:
    data = Path(tempfile.mkdtemp(prefix="cb-stepcost-"))
    one_round = sc.model_copy(update={"recipe": sc.recipe.updated(rounds=1, batch_size=conversations, gate="off")})
    settings = demo_settings(one_round, data, seed=seed)
    t0 = time.monotonic()
    await run_demo(one_round, settings)
    print(f"collected {conversations} conversations in {time.monotonic() - t0:.0f} s ({data})", file=sys.stderr)
    return data, read_samples(sc, data)


def read_samples(sc: scenarios.Scenario, data: Path) -> list[Sample]:
    """The collection's samples with advantages (trained or waiting), oldest first."""
    with Store.open(demo_settings(sc, data).db_url) as store:
        rows = [*store.pending_samples(state="trained"), *store.pending_samples(state="judged")]
    return sorted(rows, key=lambda s: s.id)


async def measure(backend: LocalBackend, renderer: Renderer, sc: scenarios.Scenario, repeats: int = 1) -> dict[str, Any]:
    """Every probe and held-out prompt answered `repeats` times, draw k with seed seed(prompt)+k."""
    r = sc.recipe
    version = backend.version

    async def answer(messages: list[dict[str, str]], prompt: str, k: int) -> tuple[str, str | None]:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=eval_seed(prompt) + k)
        [c] = await backend.sample(renderer.render(messages), params, n=1, version=version)
        return renderer.parse(c.tokens, c.finish_reason).content or "", c.finish_reason

    probes = [p for p in general_probes() for _ in range(repeats)]
    held_prompts = [p for p in sc.heldout_prompts for _ in range(repeats)]
    probe_answers = await asyncio.gather(*(answer([{"role": "user", "content": p.question}], p.question, i % repeats)
                                           for i, p in enumerate(probes)))
    held = await asyncio.gather(*(answer(sc.messages(p), p, i % repeats) for i, p in enumerate(held_prompts)))
    verdicts = [sc.rate(p, t, f) for p, (t, f) in zip(held_prompts, held, strict=True)]
    probe_ok = [p.key.answered(t) for p, (t, _) in zip(probes, probe_answers, strict=True)]
    n = len(verdicts)
    return {
        "probe": probe_ok,
        "probe_failed": [(p.question, t) for p, (t, _), ok in zip(probes, probe_answers, probe_ok, strict=True) if not ok],
        "truly": sum(v.truly for v in verdicts) / n,
        "preferred": sum(v.preferred for v in verdicts) / n,
        "answered": sum(v.answered for v in verdicts) / n,
        "heldout": [t for t, _ in held],
    }


def first_sentence(tokenizer: Any, ids: tuple[int, ...]) -> int | None:
    """How many tokens of `ids` make its first sentence (its text ends with . ! or ? there and more
    follows); None when the answer is one sentence already."""
    for k in range(1, len(ids) - 1):
        if tokenizer.decode(list(ids[:k])).rstrip().endswith((".", "!", "?")) and tokenizer.decode(
                list(ids[k:k + 1])).startswith((" ", "\n")):
            return k
    return None


async def first_sentences(backend: LocalBackend, samples: list[Sample]) -> dict[str, list[list[Datum]]]:
    """Each turn's own answer cut after its first sentence, the end-of-turn token added, scored by
    v0 (the recorded logprobs do not cover the added token): "all" +1 on every token, "end" +1 on
    the end token only. Turns whose answer is one sentence already keep their whole answer."""
    tok = backend.tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(end, int)
    out: dict[str, list[list[Datum]]] = {"all": [], "end": []}
    for s in samples:
        k = first_sentence(tok, s.completion_ids)
        ids: tuple[int, ...] = (*s.completion_ids[:k], end) if k is not None else s.completion_ids
        lps = tuple(await backend.score(s.prompt_ids, ids, temperature=s.temperature))
        n = len(ids)
        out["all"].append([Datum(s.prompt_ids, ids, lps, (1.0,) * n, s.temperature)])
        out["end"].append([Datum(s.prompt_ids, ids, lps, (0.0,) * (n - 1) + (1.0,), s.temperature)])
    return out


async def run_variant(v: Variant, sc: scenarios.Scenario, data: Path, datums_of: list[list[Datum]],
                      own_of: list[list[Datum]], cut_of: dict[str, list[list[Datum]]], steps: int,
                      base: dict[str, Any], show: int,
                      repeats: int = 1) -> list[dict[str, Any]]:
    settings = demo_settings(sc, data / f"v-{v.name}", seed=0)
    backend = LocalBackend.from_settings(settings)
    if v.targets:
        backend.engine.target_modules = list(v.targets)
    await backend.start()
    renderer = Renderer(backend.tokenizer())
    rows = []
    try:
        at = 0
        for k in range(steps):
            chunk = (cut_of[v.cut] if v.cut else own_of if v.own else datums_of)[at: at + v.batch]
            at += v.batch
            if len(chunk) < v.batch:
                break
            lr = v.lr * min(1.0, (k + 1) / (v.warmup + 1)) if v.warmup else v.lr
            size = -(-len(chunk) // v.micro)
            norms = []  # one per optimizer step; the row reports the largest
            for j in range(0, len(chunk), size):
                step_lr = 0.0 if v.prime and j == 0 else lr
                optim = OptimSpec(learning_rate=step_lr, eps=v.eps, beta2=v.beta2)
                m = await backend.train_step([d for ds in chunk[j: j + size] for d in ds], LossSpec(), optim)
                norms.append(m.grad_norm)
            await backend.publish()
            got = await measure(backend, renderer, sc, repeats)
            drop = [b - a for a, b in zip(got["probe"], base["probe"], strict=True)]
            row = {"variant": v.name, "step": k + 1, "lr": lr, "grad_norm": max(norms),
                   "probe": sum(got["probe"]) / len(got["probe"]), "probe_lost": sum(x > 0 for x in drop),
                   "probe_gained": sum(x < 0 for x in drop), "truly": got["truly"],
                   "preferred": got["preferred"], "answered": got["answered"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for q, t in got["probe_failed"][:show]:
                print(f"    probe ✗ {q!r} -> {t[:120]!r}", file=sys.stderr)
            for t in got["heldout"][:show]:
                print(f"    held-out: {t[:120]!r}", file=sys.stderr)
    finally:
        await backend.close()
    return rows


async def main_async(args: argparse.Namespace) -> int:
    sc = scenarios.load(args.scenario)
    table = variants(demo_settings(sc, Path(".")).training)
    chosen = [table[n] for n in args.variants]
    if args.samples:
        data = Path(args.samples)
        samples = read_samples(sc, data)
    else:
        data, samples = await collect(sc, args.conversations, args.seed)
    datums_of = [to_datums(s) for s in samples]
    own_of = [[Datum(s.prompt_ids, s.completion_ids, s.logprobs, (1.0,) * len(s.completion_ids), s.temperature)]
              for s in samples]
    print(f"{len(samples)} samples, {sum(len(d) for d in datums_of)} datums "
          f"({sum(s.rewrite is not None for s in samples)} with a rewrite)", file=sys.stderr)
    settings = demo_settings(sc, data / "v-base0", seed=0)
    backend = LocalBackend.from_settings(settings)
    await backend.start()
    base = await measure(backend, Renderer(backend.tokenizer()), sc, args.repeats)
    cut_of = await first_sentences(backend, samples) if any(v.cut for v in chosen) else {}
    await backend.close()
    print(json.dumps({"variant": "v0", "step": 0, "probe": sum(base["probe"]) / len(base["probe"]),
                      "truly": base["truly"], "preferred": base["preferred"], "answered": base["answered"]}), flush=True)
    for v in chosen:
        await run_variant(v, sc, data, datums_of, own_of, cut_of, args.steps, base, args.show, args.repeats)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=scenarios.DEFAULT_SCENARIO)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--samples", default=None, help="a data dir of an earlier collection (skips step 1)")
    ap.add_argument("--variants", nargs="+", default=["base", "lr3e-4", "big-batch"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="failed probe and held-out answers to print per step")
    ap.add_argument("--repeats", type=int, default=1, help="answers per probe and held-out prompt (seeds seed+k)")
    args = ap.parse_args(argv)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
