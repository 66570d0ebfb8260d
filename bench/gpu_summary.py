"""Issue 17's table from one `bench/gpu_run.sh` run: every row as its figure, the reference
measured in the same run, their ratio and the goal. Reads the JSON results in $OUT.

    python bench/gpu_summary.py [OUT]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def row(measure: str, figure: str, reference: str, ratio: str, goal: str, met: bool | None) -> str:
    mark = "" if met is None else (" MET" if met else " not met")
    return f"| {measure} | {figure} | {reference} | {ratio} | {goal}{mark} |"


def trainer_row(r: dict[str, Any] | None) -> str:
    measure = "FSDP2 LoRA trainer, one rank, 8 x 1,024 tokens"
    if r is None:
        return row(measure, "not run", "", "", ">= 45 % MFU", None)
    ref = r.get("reference_plain_peft", {})
    mfu = r.get("mfu_4N")
    ref_text = (
        f"plain PEFT loop {ref['tokens_per_s']} tok/s"
        if "tokens_per_s" in ref
        else f"plain PEFT loop: {ref.get('error', 'not run')}"
    )
    ratio = f"{r['ratio_vs_plain_peft']:.2f}x" if "ratio_vs_plain_peft" in r else "-"
    figure = (
        f"{r['tokens_per_s']} tok/s, {mfu:.1%} MFU (4N), peak {r.get('peak_memory_gib')} GiB"
        if mfu
        else f"{r['tokens_per_s']} tok/s"
    )
    return row(measure, figure, ref_text, ratio, ">= 45 % MFU", bool(mfu and mfu >= 0.45))


def decode_rows(r: dict[str, Any] | None) -> list[str]:
    if r is None:
        return [row("torch engine decode", "not run", "", "", "", None)]
    out, ratios = [], r.get("ratios", {})
    limit = r.get("bandwidth_limit_tokens_per_s")
    concurrency = [run["concurrency"] for run in r["reference_hf_eager"]["runs"]]
    for mode in ("dynamic", "static", "graphs"):
        if f"{mode}_error" in r:
            out.append(
                row(
                    f"torch engine ({mode})",
                    "failed: " + r[f"{mode}_error"][:120],
                    "",
                    "",
                    "",
                    False,
                )
            )
        if mode not in r:
            continue
        for i, c in enumerate(concurrency):
            tps = r[mode]["adapter"]["runs"][i]["tokens_per_s"]
            eager = r["reference_hf_eager"]["runs"][i]["tokens_per_s"]
            ratio = ratios.get(f"{mode}_c{c}_vs_eager", tps / eager)
            if c == 1:
                share = ratios.get(f"{mode}_c1_of_bandwidth_limit")
                goal = f">= 40 % of {limit} tok/s limit, >= 2x eager"
                met = share is not None and share >= 0.4 and ratio >= 2
                figure = f"{tps} tok/s" + (
                    f" ({share:.0%} of the limit)" if share is not None else ""
                )
            elif c == max(concurrency):
                goal, met, figure = ">= 1.5x eager", ratio >= 1.5, f"{tps} tok/s"
            else:
                goal, met, figure = "", None, f"{tps} tok/s"
            out.append(
                row(
                    f"torch engine ({mode}), {c} client(s), adapter",
                    figure,
                    f"plain eager {eager} tok/s",
                    f"{ratio:.2f}x",
                    goal,
                    met,
                )
            )
    return out


def publish_row(r: dict[str, Any] | None) -> str:
    measure = "publish, save -> first token on the new version"
    if r is None:
        return row(measure, "not run", "", "", "<= 200 ms", None)
    s = r["save_to_first_token_s_median"]
    return row(
        measure,
        f"{s * 1000:.0f} ms (durable {r['durable_publish_s_median'] * 1000:.0f} ms)",
        f"previous publish {r['reference_save_to_first_token_s_median'] * 1000:.0f} ms",
        f"{r['ratio']:.1f}x",
        "<= 200 ms",
        s <= 0.2,
    )


def cpu_row(r: dict[str, Any] | None) -> str:
    measure = "CPU train_step vs a plain PEFT loop, mixed lengths"
    if r is None:
        return row(
            measure,
            "not in this run (measured on the CPU machine: bench/train_step.py --mixed "
            "--samples 8 --tokens 2048 --json)",
            "",
            "",
            ">= 1.5x",
            None,
        )
    return row(
        measure,
        f"{r['engine_tokens_per_s']:.1f} tok/s",
        f"plain PEFT loop {r['plain_tokens_per_s']:.1f} tok/s",
        f"{r['ratio']:.2f}x",
        ">= 1.5x",
        r["ratio"] >= 1.5,
    )


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "bench/results"))
    lines = [
        "| measure | this run | reference, same run | ratio | goal |",
        "| --- | --- | --- | --- | --- |",
        trainer_row(load(out, "gpu_train")),
        *decode_rows(load(out, "gpu_sample")),
        publish_row(load(out, "publish_latency")),
        cpu_row(load(out, "train_step")),
    ]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
