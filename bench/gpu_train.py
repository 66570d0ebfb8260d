"""FSDP2 LoRA trainer throughput and MFU on whatever GPU is here (random weights of a real
architecture; LoRA costs about 4·N FLOPs per token: forward 2N + input-gradient backward 2N).

    python bench/gpu_train.py --arch qwen3-4b --nproc 1 --batch 8 --prompt 512 --completion 512
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from clawbridge.local_gpu.fsdp import FSDPTrainer
from clawbridge.types import Datum, LossSpec, OptimSpec
from gpu_common import config_dir, device_name, n_params, peak_flops, write_result


def batch(n: int, prompt: int, completion: int, vocab: int, seed: int) -> list[Datum]:
    rng = random.Random(seed)
    return [Datum(tuple(rng.randrange(vocab) for _ in range(prompt)),
                  tuple(rng.randrange(vocab) for _ in range(completion)),
                  tuple(-rng.uniform(5, 15) for _ in range(completion)),
                  tuple(rng.choice((-1.0, 1.0)) for _ in range(completion)))
            for _ in range(n)]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-4b")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256, help="positions per logprob chunk")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cb-train-"))
    cfg = config_dir(args.arch, root)
    extra = ["--token-budget", str(args.token_budget), "--chunk", str(args.chunk)] + (["--no-checkpointing"] if args.no_checkpointing else [])
    trainer = FSDPTrainer(f"random:{cfg}", nproc=args.nproc, device=args.device, lora_rank=args.lora_rank,
                          lora_alpha=args.lora_rank, log_file=root / "trainer.log", extra_args=extra)
    t0 = time.perf_counter()
    await trainer.start()
    startup = time.perf_counter() - t0
    try:
        data = batch(args.batch, args.prompt, args.completion, 49152, 0)
        tokens = args.batch * (args.prompt + args.completion)
        times = []
        for i in range(args.steps + 1):  # the first step warms up kernels and the allocator
            t = time.perf_counter()
            m = await trainer.train_step(data, LossSpec(), OptimSpec())
            times.append(time.perf_counter() - t)
            print(f"step {i}: {times[-1]:.3f} s (worker {m.seconds:.3f} s) loss {m.loss:.4f}", flush=True)
        t = time.perf_counter()
        await trainer.save_adapter(root / "adapter")
        save_s = time.perf_counter() - t
        steady = sorted(times[1:])[len(times[1:]) // 2]
        n = n_params(args.arch)
        tps = tokens / steady
        peak = peak_flops(device_name())
        mfu = 4 * n * tps / (peak * args.nproc) if peak else None
        write_result("gpu_train", {
            "arch": args.arch, "params": n, "nproc": args.nproc, "lora_rank": args.lora_rank,
            "batch": args.batch, "seq": args.prompt + args.completion, "tokens_per_step": tokens,
            "checkpointing": not args.no_checkpointing, "startup_s": round(startup, 1),
            "step_s_median": round(steady, 3), "tokens_per_s": round(tps), "mfu_4N": round(mfu, 3) if mfu else None,
            "adapter_gather_and_write_s": round(save_s, 3), "step_times": [round(x, 3) for x in times],
        })
    finally:
        await trainer.close()


if __name__ == "__main__":
    asyncio.run(main())
