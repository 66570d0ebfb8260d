"""Tokens/s of the engine's PPO `train_step` against a plain hand-written PEFT + torch loop.

Same model, same LoRA config (all linear layers), same batch, same loss (`clawbridge.loss`), same
AdamW + grad clipping. The two alternate, repeat by repeat, so a busy shared machine slows both
alike; medians are reported with their ratio (engine / plain: above 1 means the engine is faster).

    .venv/bin/python bench/train_step.py --model smollm2-135m-instruct --tokens 512 --repeats 5
    .venv/bin/python bench/train_step.py --mixed --samples 8 --tokens 2048 --json   # mixed lengths

With `--mixed` the samples' lengths grow 1 : 2 : ... : n (what a batch of real turns looks like),
so a padded batch computes `n × longest` tokens for `Σ lengths`: the engine packs them instead.
`--json` prints one object with the medians and `ratio` (engine / plain).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.engine import Engine
from clawbridge.loss import ppo_loss, token_logprobs
from clawbridge.types import Datum, LossSpec, OptimSpec


def make_batch(
    tokens: int, samples: int, completion_frac: float, seed: int = 0, mixed: bool = False
) -> list[Datum]:
    """`samples` sequences of about `tokens` tokens in all (equal lengths, or growing 1 : 2 : ... :
    n with `mixed`), the last `completion_frac` of each the completion, with recorded logprobs
    near the policy's and advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    weights = [i + 1 if mixed else 1 for i in range(samples)]
    batch = []
    for i in range(samples):
        per = max(2, tokens * weights[i] // sum(weights))
        n_completion = max(1, int(per * completion_frac))
        ids = torch.randint(100, 40000, (per,), generator=g).tolist()
        old = (-10.8 + 0.1 * torch.randn(n_completion, generator=g)).tolist()
        batch.append(
            Datum(
                prompt_ids=tuple(ids[: per - n_completion]),
                completion_ids=tuple(ids[per - n_completion :]),
                logprobs=tuple(old),
                advantages=(1.0 if i % 2 == 0 else -1.0,) * n_completion,
            )
        )
    return batch


class PlainLoop:
    """What one would write by hand: pad the batch, full logits, mask, loss, backward, step."""

    def __init__(self, spec: models.ModelSpec, rank: int, alpha: int) -> None:
        from peft import LoraConfig, get_peft_model

        base = models.load_model(spec)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0)
        self.model = get_peft_model(base, config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)

    def step(self, batch: list[Datum], loss: LossSpec, optim: OptimSpec) -> float:
        width = max(len(d.prompt_ids) + len(d.completion_ids) for d in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        targets = torch.zeros(len(batch), width - 1, dtype=torch.long)
        mask = torch.zeros(len(batch), width - 1)
        old = torch.zeros(len(batch), width - 1)
        adv = torch.zeros(len(batch), width - 1)
        for i, d in enumerate(batch):
            full = torch.tensor(d.prompt_ids + d.completion_ids)
            ids[i, : len(full)] = full
            attention[i, : len(full)] = 1
            targets[i, : len(full) - 1] = full[1:]
            start, end = len(d.prompt_ids) - 1, len(full) - 1
            mask[i, start:end] = 1
            old[i, start:end] = torch.tensor(d.logprobs)
            adv[i, start:end] = torch.tensor(d.advantages)
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        new = token_logprobs(logits, targets)
        ppo_loss(new, old, adv, mask, loss).backward()
        torch.nn.utils.clip_grad_norm_(self.params, optim.grad_clip_norm)
        self.optimizer.step()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.EMBEDDED)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per batch (prompt + completion)")
    parser.add_argument("--samples", type=int, default=4, help="sequences per batch")
    parser.add_argument("--completion-frac", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--mixed", action="store_true", help="lengths 1 : 2 : ... : n instead of equal")
    parser.add_argument("--json", action="store_true", help="print one JSON object (key `ratio`)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = models.resolve(args.model)
    batch = make_batch(args.tokens, args.samples, args.completion_frac, mixed=args.mixed)
    loss, optim = LossSpec(), OptimSpec()
    total = sum(len(d.prompt_ids) + len(d.completion_ids) for d in batch)
    plain = PlainLoop(spec, args.rank, args.alpha)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(spec, data_dir=Path(tmp), lora_rank=args.rank, lora_alpha=args.alpha, threads=args.threads)
        engine.start()
        try:
            ours, theirs = [], []
            for i in range(args.repeats + 1):  # the first round warms both up and is dropped
                metrics = asyncio.run(engine.train_step(batch, loss, optim))
                plain_s = plain.step(batch, loss, optim)
                if i:
                    ours.append(metrics.seconds)
                    theirs.append(plain_s)
        finally:
            engine.close()
    ours_tps, theirs_tps = total / statistics.median(ours), total / statistics.median(theirs)
    if args.json:
        longest = max(len(d.prompt_ids) + len(d.completion_ids) for d in batch)
        print(json.dumps({
            "model": spec.name, "samples": len(batch), "tokens": total,
            "padded_tokens": longest * len(batch), "mixed": args.mixed, "threads": torch.get_num_threads(),
            "repeats": args.repeats, "engine_s": statistics.median(ours), "plain_s": statistics.median(theirs),
            "engine_tokens_per_s": ours_tps, "plain_tokens_per_s": theirs_tps, "ratio": ours_tps / theirs_tps,
        }))
        return
    print(f"model {spec.name}, {args.samples} x {total // args.samples} tokens "
          f"({sum(len(d.completion_ids) for d in batch)} completion), LoRA r={args.rank} "
          f"alpha={args.alpha}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"engine train_step : {ours_tps:8.1f} tokens/s  ({statistics.median(ours):.3f} s/step)")
    print(f"plain PEFT loop   : {theirs_tps:8.1f} tokens/s  ({statistics.median(theirs):.3f} s/step)")
    print(f"ratio engine/plain: {ours_tps / theirs_tps:.2f}")


if __name__ == "__main__":
    main()
