"""How the embedded model reads prompts longer than its trained 8 K: RoPE scaling choices compared.

    .venv/bin/python bench/long_context.py --tokens 16384 --scalings none yarn llama3 linear dynamic

One forward pass per scaling over a long document (this repository's docs, markdown like an
agent's system prompt) that hides a pass key near its start and asks for it at its end:

- NLL per token in position buckets: the short buckets show what the scaling costs prompts that
  already fit (0 for a scaling that leaves them alone), the long ones whether text past 8 K is
  still read as language (the unscaled model falls apart there);
- the pass key's NLL and whether each of its digits is the greedy choice, ~N tokens after it was
  given: does anything survive the distance.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from clawbridge.local_gpu import models

ROOT = Path(__file__).resolve().parent.parent
KEY = "48213"
TRAINED = 8192
SCALINGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED},
    # YaRN without its attention temperature (0.1 ln 4 + 1 = 1.14 on q and k): short prompts
    # keep their answers (greedy "capital of France": "Paris" here, not with the temperature)
    "yarn-t1": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED,
                "attention_factor": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": TRAINED},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


def document(tok: Any, n_tokens: int) -> tuple[list[int], list[int]]:
    """(ids, positions of the pass key's digits in the question at the end)."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    head = tok.encode(f"Important: the pass key is {KEY}. Remember it, you will be asked for it.\n\n")
    question = tok.encode("\n\nWhat was the pass key given at the very beginning? The pass key is")
    answer = tok.encode(f" {KEY}")
    body = tok.encode(text)[: n_tokens - len(head) - len(question) - len(answer)]
    ids = head + body + question + answer
    return ids, list(range(len(ids) - len(answer), len(ids)))


def nll_per_token(model: Any, ids: list[int], chunk: int = 1024) -> torch.Tensor:
    """-log p(ids[t] | ids[:t]) for t >= 1, the lm head applied in chunks (16 K x 49 K logits
    would be 3 GB)."""
    with torch.inference_mode():
        x = torch.tensor([ids])
        hidden = model.model(input_ids=x).last_hidden_state[0]
        out = []
        for s in range(0, len(ids) - 1, chunk):
            logits = model.lm_head(hidden[s : min(s + chunk, len(ids) - 1)]).float()
            target = x[0, s + 1 : s + 1 + logits.shape[0]]
            out.append(torch.nn.functional.cross_entropy(logits, target, reduction="none"))
            if s + chunk >= len(ids) - 1:  # the greedy digits of the answer
                greedy = logits.argmax(-1)
        return torch.cat(out), greedy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--scalings", nargs="+", default=list(SCALINGS))
    ap.add_argument("--buckets", type=int, nargs="+", default=[0, 2048, 4096, 8192, 12288, 16384, 32768])
    args = ap.parse_args()
    torch.manual_seed(0)
    spec = models.resolve(models.EMBEDDED)
    tok = models.load_tokenizer(spec)
    ids, key_pos = document(tok, args.tokens)
    results = {}
    for name in args.scalings:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(spec.path), local_files_only=True)
        if SCALINGS[name] is not None:
            config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **SCALINGS[name]}
            config.max_position_embeddings = TRAINED * 4
        model = AutoModelForCausalLM.from_pretrained(str(spec.path), config=config, dtype=torch.float32,
                                                     local_files_only=True).eval()
        t0 = time.perf_counter()
        nll, greedy = nll_per_token(model, ids)
        took = time.perf_counter() - t0
        buckets = {}
        for lo, hi in zip(args.buckets, args.buckets[1:], strict=False):
            part = nll[lo : min(hi, len(ids) - len(key_pos) - 1)]
            if len(part):
                buckets[f"{lo // 1024}-{hi // 1024}K"] = round(float(part.mean()), 3)
        key_nll = [float(nll[p - 1]) for p in key_pos]
        hits = [int(greedy[p - 1 - (len(ids) - 1 - greedy.shape[0])]) == ids[p] for p in key_pos]
        results[name] = {"nll_by_position": buckets, "key_nll": round(sum(key_nll), 2),
                         "key_digits_greedy": f"{sum(hits)}/{len(hits)}", "forward_s": round(took, 1)}
        print(json.dumps({name: results[name]}), flush=True)
        del model
    print(json.dumps({"tokens": len(ids), "results": results}, indent=1))


if __name__ == "__main__":
    main()
