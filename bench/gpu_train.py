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
from gpu_common import ARCHS, config_dir, device_name, n_params, peak_flops, write_result


def batch(n: int, prompt: int, completion: int, vocab: int, seed: int) -> list[Datum]:
    rng = random.Random(seed)
    return [
        Datum(
            tuple(rng.randrange(vocab) for _ in range(prompt)),
            tuple(rng.randrange(vocab) for _ in range(completion)),
            tuple(-rng.uniform(5, 15) for _ in range(completion)),
            tuple(rng.choice((-1.0, 1.0)) for _ in range(completion)),
        )
        for _ in range(n)
    ]


def plain_reference(
    arch: str, data: list[Datum], steps: int, rank: int, checkpointing: bool
) -> dict[str, float]:
    """The same step by a plain loop on one GPU: Transformers + PEFT in bf16 (no FSDP, no packing,
    no chunked logprobs), the batch as one padded [B, T] forward, `clawbridge.loss.ppo_loss`,
    AdamW. The trainer's ratio to this is what its machinery adds or costs."""
    import torch
    from clawbridge.loss import ppo_loss, token_logprobs
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("cuda"):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", lora_dropout=0.0)
    )
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    width = max(len(d.prompt_ids) + len(d.completion_ids) for d in data)
    ids = torch.zeros((len(data), width), dtype=torch.long, device="cuda")
    for i, d in enumerate(data):
        ids[i, : len(d.prompt_ids) + len(d.completion_ids)] = torch.tensor(
            d.prompt_ids + d.completion_ids
        )
    times = []
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = model(input_ids=ids).logits
        new = torch.cat(
            [
                token_logprobs(
                    logits[
                        i, len(d.prompt_ids) - 1 : len(d.prompt_ids) + len(d.completion_ids) - 1
                    ],
                    ids[i, len(d.prompt_ids) : len(d.prompt_ids) + len(d.completion_ids)],
                )
                for i, d in enumerate(data)
            ]
        )
        old = torch.tensor([x for d in data for x in d.logprobs], device="cuda")
        adv = torch.tensor([x for d in data for x in d.advantages], device="cuda")
        ppo_loss(new, old, adv, torch.ones_like(new), LossSpec()).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        del logits, new
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, base, optimizer
    torch.cuda.empty_cache()
    steady = sorted(times[1:])[len(times[1:]) // 2]
    return {
        "step_s_median": round(steady, 3),
        "tokens_per_s": round(
            sum(len(d.prompt_ids) + len(d.completion_ids) for d in data) / steady
        ),
        "peak_memory_gib": round(peak, 1),
        "checkpointing": checkpointing,
    }


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
    ap.add_argument("--no-reference", action="store_true", help="skip the plain PEFT loop")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cb-train-"))
    cfg = config_dir(args.arch, root)
    extra = ["--token-budget", str(args.token_budget), "--chunk", str(args.chunk)] + (
        ["--no-checkpointing"] if args.no_checkpointing else []
    )
    trainer = FSDPTrainer(
        f"random:{cfg}",
        nproc=args.nproc,
        device=args.device,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_rank,
        log_file=root / "trainer.log",
        extra_args=extra,
    )
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
            print(
                f"step {i}: {times[-1]:.3f} s (worker {m.seconds:.3f} s) loss {m.loss:.4f}",
                flush=True,
            )
        t = time.perf_counter()
        await trainer.save_adapter(root / "adapter")
        save_s = time.perf_counter() - t
        steady = sorted(times[1:])[len(times[1:]) // 2]
        n = n_params(args.arch)
        tps = tokens / steady
        peak = peak_flops(device_name())
        mfu = 4 * n * tps / (peak * args.nproc) if peak else None
        result = {
            "arch": args.arch,
            "params": n,
            "nproc": args.nproc,
            "lora_rank": args.lora_rank,
            "batch": args.batch,
            "seq": args.prompt + args.completion,
            "tokens_per_step": tokens,
            "checkpointing": not args.no_checkpointing,
            "startup_s": round(startup, 1),
            "step_s_median": round(steady, 3),
            "tokens_per_s": round(tps),
            "mfu_4N": round(mfu, 3) if mfu else None,
            "adapter_gather_and_write_s": round(save_s, 3),
            "step_times": [round(x, 3) for x in times],
            "peak_memory_gib": (await trainer.info()).get("peak_memory_gib"),
        }
    finally:
        await trainer.close()
    if args.device == "cuda" and not args.no_reference:
        try:
            ref = plain_reference(
                args.arch, data, args.steps, args.lora_rank, not args.no_checkpointing
            )
        except Exception as e:  # an out-of-memory reference is a result too
            ref = {"error": f"{type(e).__name__}: {e}"[:300]}
        result["reference_plain_peft"] = ref
        if "tokens_per_s" in ref:
            result["ratio_vs_plain_peft"] = round(tps / ref["tokens_per_s"], 2)
    write_result("gpu_train", result)


if __name__ == "__main__":
    asyncio.run(main())
