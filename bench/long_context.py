"""How the embedded model reads prompts longer than its trained 8 K: RoPE scaling choices compared.

    .venv/bin/python bench/long_context.py --tokens 16384 --scalings none yarn llama3 linear dynamic
    .venv/bin/python bench/long_context.py --checks short --scalings none yarn yarn-t1

`long`: one forward pass per scaling over a long document (this repository's docs, markdown like
an agent's system prompt) that hides a pass key near its start and asks for it at its end:

- NLL per token in position buckets: the short buckets show what the scaling costs prompts that
  already fit (0 for a scaling that leaves them alone), the long ones whether text past 8 K is
  still read as language (the unscaled model falls apart there);
- the pass key's NLL and whether each of its digits is the greedy choice, ~N tokens after it was
  given: does anything survive the distance.

`short`: simple questions in the chat template (a static scaling also rotates short prompts;
YaRN's attention temperature cost the 135 M model such answers): how many greedy answers have the
expected word in their first sentence, how many are the unscaled model's answer word for word, the
NLL per token of a right answer, and the answers themselves.
"""

from __future__ import annotations

import argparse
import itertools
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
    # YaRN without its attention temperature (0.1 ln 4 + 1 = 1.14 on q and k), what the embedded
    # model is served with: short prompts keep their answers
    "yarn-t1": models.EMBEDDED_ROPE,
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": TRAINED,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


# (question, a right answer, words any of which makes the greedy answer right), lower case words
QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris.", ("paris",)),
    ("What is the capital of France? Answer in one word.", "Paris", ("paris",)),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", ("tokyo",)),
    ("What is the capital of Italy?", "The capital of Italy is Rome.", ("rome",)),
    ("How many days are in a week?", "There are seven days in a week.", ("seven", "7")),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day.", ("blue",)),
    ("What is 2 + 2?", "2 + 2 = 4.", ("4", "four")),
    (
        "What is the largest planet in our solar system?",
        "Jupiter is the largest planet in our solar system.",
        ("jupiter",),
    ),
    (
        "Who wrote Romeo and Juliet?",
        "William Shakespeare wrote Romeo and Juliet.",
        ("shakespeare",),
    ),
    ("What is the chemical symbol for water?", "The chemical symbol for water is H2O.", ("h2o",)),
    ("How many legs does a spider have?", "A spider has eight legs.", ("eight", "8")),
    ("What language is spoken in Spain?", "Spanish is spoken in Spain.", ("spanish",)),
    ("What is the opposite of hot?", "The opposite of hot is cold.", ("cold",)),
    (
        "What gas do plants absorb from the air?",
        "Plants absorb carbon dioxide from the air.",
        ("carbon dioxide", "co2"),
    ),
]


def short_answers(model: Any, tok: Any, max_new_tokens: int = 24) -> dict[str, Any]:
    """Greedy answers (right: an expected word in the first sentence) and the NLL per token of a
    right answer given the question, teacher-forced."""
    right, answers, nll, n_tokens = 0, {}, 0.0, 0
    for question, reference, words in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        ref = [*tok.encode(reference), tok.convert_tokens_to_ids("<|im_end|>")]
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
            )
            logits = model(torch.tensor([ids + ref])).logits[0, len(ids) - 1 : -1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ref), reduction="sum"))
        n_tokens += len(ref)
        answer = tok.decode(out[0][len(ids) :], skip_special_tokens=True).strip()
        first = answer.replace("\n", ". ").split(". ")[0].lower()
        right += any(w in first for w in words)
        answers[question] = answer
    return {
        "short_right": f"{right}/{len(QUESTIONS)}",
        "reference_nll": round(nll / n_tokens, 3),
        "answers": answers,
    }


def document(tok: Any, n_tokens: int) -> tuple[list[int], list[int]]:
    """(ids, positions of the pass key's digits in the question at the end)."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    head = tok.encode(
        f"Important: the pass key is {KEY}. Remember it, you will be asked for it.\n\n"
    )
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


def long_document(
    model: Any, ids: list[int], key_pos: list[int], bucket_edges: list[int]
) -> dict[str, Any]:
    t0 = time.perf_counter()
    nll, greedy = nll_per_token(model, ids)
    took = time.perf_counter() - t0
    buckets = {}
    for lo, hi in itertools.pairwise(bucket_edges):
        part = nll[lo : min(hi, len(ids) - len(key_pos) - 1)]
        if len(part):
            buckets[f"{lo // 1024}-{hi // 1024}K"] = round(float(part.mean()), 3)
    key_nll = [float(nll[p - 1]) for p in key_pos]
    hits = [int(greedy[p - 1 - (len(ids) - 1 - greedy.shape[0])]) == ids[p] for p in key_pos]
    return {
        "nll_by_position": buckets,
        "key_nll": round(sum(key_nll), 2),
        "key_digits_greedy": f"{sum(hits)}/{len(hits)}",
        "forward_s": round(took, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--scalings", nargs="+", default=list(SCALINGS))
    ap.add_argument(
        "--buckets", type=int, nargs="+", default=[0, 2048, 4096, 8192, 12288, 16384, 32768]
    )
    ap.add_argument("--checks", nargs="+", choices=["long", "short"], default=["long", "short"])
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
            config.rope_parameters = {
                "rope_theta": config.rope_parameters["rope_theta"],
                **SCALINGS[name],
            }
            config.max_position_embeddings = TRAINED * 4
        model = AutoModelForCausalLM.from_pretrained(
            str(spec.path), config=config, dtype=torch.float32, local_files_only=True
        ).eval()
        results[name] = {}
        if "long" in args.checks:
            results[name] |= long_document(model, ids, key_pos, args.buckets)
        if "short" in args.checks:
            results[name] |= short_answers(model, tok)
        if "short" in args.checks and "none" in results and name != "none":
            same = [a == results["none"]["answers"][q] for q, a in results[name]["answers"].items()]
            results[name]["same_greedy_as_trained"] = f"{sum(same)}/{len(same)}"
        print(json.dumps({name: results[name]}), flush=True)
        del model
    print(json.dumps({"tokens": len(ids), "results": results}, indent=1))


if __name__ == "__main__":
    main()
