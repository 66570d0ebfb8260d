"""Adapter publish latency: from "save" to the first token served by the new version, before and
after publishing from memory (issue 17), in the same run on the same engine.

- after: `Engine.publish(durable=False)` (the trainable weights copied into a serving slot, the
  write left to the engine's writer thread), then the first token of a request admitted on the new
  version. `durable_s` is a whole `publish()`, which returns once the weights are on disk (when the
  trainer records the version).
- before (the reference): the engine's previous publish, reproduced as a job on its thread: PEFT
  `save_pretrained` of the trainable adapter to a folder, renamed, `load_adapter` of that folder
  (new LoRA layers, weights read back) and the previous copy deleted; then the first token of a
  request on the newest version (a LoRA prefill of the same cost).

The FSDP2 side of an SGLang publish (gathering the sharded adapter and writing it) is measured by
bench/gpu_train.py (`adapter_gather_and_write_s`); SGLang's own /load_lora_adapter time is not
measured (no SGLang on the bench machines).

    python bench/publish_latency.py --engine-model DIR_OR_NAME --rank 32 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch
from clawbridge.local_gpu import models
from clawbridge.local_gpu.adapters import STALE, TRAIN
from clawbridge.local_gpu.engine import Engine
from clawbridge.types import SamplingParams
from gpu_common import model_dir, write_result


async def first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    async for chunk in engine.sample_stream(
        prompt, SamplingParams(max_tokens=1, stop_token_ids=())
    ):
        return time.perf_counter() - t, chunk.version
    raise RuntimeError("no token")


def previous_publish(engine: Engine, folder: Path, n: int) -> None:
    """What `Engine._publish` did before issue 17, on the engine's thread (as its job ran)."""
    model: Any = engine._model
    tmp = folder.with_name(f".{folder.name}.tmp")
    model.save_pretrained(str(tmp), selected_adapters=[TRAIN])
    tmp.rename(folder)
    model.load_adapter(str(folder), adapter_name=f"reference{n}", autocast_adapter_dtype=False)
    if n:
        model.delete_adapter(f"reference{n - 1}")
    engine._pointed = STALE  # PEFT re-pointed the layers


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


async def measure(spec: models.ModelSpec, rank: int, repeat: int, device: str) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cb-pub-"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = Engine(
        spec, data_dir=root, lora_rank=rank, lora_alpha=rank, device=device, dtype=dtype
    )
    engine.start()
    prompt = list(range(100, 164))
    before: dict[str, list[float]] = {"publish": [], "first": [], "total": []}
    after: dict[str, list[float]] = {"publish": [], "first": [], "total": []}
    durable: list[float] = []
    try:
        await first_token(engine, prompt)  # warm-up
        await engine.publish()  # the first publish fills the slot made at start; the next makes one
        await engine.publish()
        for i in range(repeat):
            t = time.perf_counter()
            await engine._call(previous_publish, engine, root / "reference" / f"r{i}", i)
            p = time.perf_counter() - t
            f, _ = await first_token(engine, prompt)
            before["publish"].append(p)
            before["first"].append(f)
            before["total"].append(p + f)

            t = time.perf_counter()
            v = await engine.publish(durable=False)
            p = time.perf_counter() - t
            f, served = await first_token(engine, prompt)
            assert served == v.version, (served, v.version)
            after["publish"].append(p)
            after["first"].append(f)
            after["total"].append(p + f)
            # let the writer finish before the next round (it shares the cores)
            await engine.publish()

            t = time.perf_counter()
            await engine.publish()
            durable.append(time.perf_counter() - t)
    finally:
        engine.close()
    ratio = statistics.median(before["total"]) / statistics.median(after["total"])
    return {
        "save_to_first_token_s_median": med(after["total"]),
        "publish_s_median": med(after["publish"]),
        "first_token_s_median": med(after["first"]),
        "durable_publish_s_median": med(durable),
        "reference_save_to_first_token_s_median": med(before["total"]),
        "reference_publish_s_median": med(before["publish"]),
        "reference_first_token_s_median": med(before["first"]),
        "ratio": round(ratio, 1),
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--engine-model", default=models.TINY, help="registry name, HF folder, or arch:NAME"
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="for arch:NAME models")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = args.engine_model
    if model.startswith("arch:"):
        model = str(
            model_dir(
                model.removeprefix("arch:"),
                Path(tempfile.gettempdir()) / "cb-models",
                args.tokenizer,
            )
        )
    spec = models.resolve(model)
    result = await measure(spec, args.rank, args.repeat, device)
    write_result(
        "publish_latency",
        {
            "path": "torch engine",
            "model": args.engine_model,
            "engine_device": device,
            "lora_rank": args.rank,
            **result,
        },
    )


if __name__ == "__main__":
    asyncio.run(main())
