"""One rank of the FSDP2 LoRA trainer, run by torchrun (`python -m torch.distributed.run ... -m
clawbridge.local_gpu.fsdp_worker`). Rank 0 answers the bridge's RPC (`clawbridge.local_gpu.fsdp`)
and broadcasts each command, so every rank runs the same collectives and the processes stay up
between steps.

The step is the CPU engine's (`clawbridge.local_gpu.engine`): PEFT LoRA on all linear layers with
the same seeded init, `clawbridge.loss.ppo_token_losses`, token-mean over the whole batch,
AdamW with the step's hyper-parameters, global grad-norm clipping. What FSDP2 adds: the base is
loaded in fp32 and sharded per decoder layer then at the root; on GPU the compute is bf16 with
fp32 gradient reduction; non-reentrant gradient checkpointing; logprobs are computed over the
vocabulary in chunks of positions (the [tokens, vocab] logits are never all alive at once), only
at completion positions. Samples are packed into rows without padding as in the engine
(`packing.py`: positions restart per sample, transformers' packed-sequence mask keeps samples
apart), and rows are stacked into [R, W] micro-batches of at most `--token-budget` tokens.

Data parallelism: datums are dealt round-robin to ranks; each rank's loss is its token-loss sum
over the WHOLE batch's token count, times the world size (FSDP averages gradients over ranks), so
the update equals the single-process one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from clawbridge.local_gpu import models
from clawbridge.local_gpu.packing import stack, stacked_micro_batches
from clawbridge.loss import batch_tokens, ppo_token_losses
from clawbridge.types import Datum, LossSpec, OptimSpec, StepMetrics
from torch import nn

log = logging.getLogger("clawbridge.fsdp_worker")

ADAPTER = "default"  # PEFT saves the default adapter flat, the layout SGLang loads
KEY_ENV = "CLAWBRIDGE_TRAINER_KEY"  # the RPC auth key travels by environment, never argv


def _peft_key(name: str) -> str:
    """A trainable parameter's name as PEFT saves it: `...lora_A.weight`, without the adapter."""
    return re.sub(
        rf"\.(lora_[AB]|lora_embedding_[AB])\.{ADAPTER}\.", r".\1.", name.removeprefix("peft.")
    )


class ChunkedLogprobs(nn.Module):
    """The FSDP root: runs the decoder, then log softmax(logits / T)[target] over chunks of
    positions, each chunk checkpointed so its [B, chunk, V] logits are recomputed in backward
    rather than stored."""

    def __init__(self, peft_model: nn.Module, chunk: int) -> None:
        super().__init__()
        self.peft: Any = peft_model
        self.chunk = chunk

    def causal_lm(self) -> Any:
        return self.peft.base_model.model

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        targets: torch.Tensor,
        temps: torch.Tensor,
    ) -> torch.Tensor:
        """logprobs [K] of `targets` at the flattened positions `keep` of packed rows `ids`
        [R, W] (`packing.stack`: positions restart per sample, so transformers' packed-sequence
        mask keeps samples apart; no attention mask). `temps` [K]: each target's temperature."""
        lm = self.causal_lm()
        hidden = lm.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])[keep]
        parts = []
        for s in range(0, hidden.shape[0], self.chunk):
            h, t, k = (
                hidden[s : s + self.chunk],
                targets[s : s + self.chunk],
                temps[s : s + self.chunk],
            )
            if torch.is_grad_enabled():
                parts.append(
                    torch.utils.checkpoint.checkpoint(
                        self._chunk_logprobs, h, t, k, use_reentrant=False
                    )
                )
            else:
                parts.append(self._chunk_logprobs(h, t, k))
        return torch.cat(parts)

    def _chunk_logprobs(
        self, h: torch.Tensor, t: torch.Tensor, temps: torch.Tensor
    ) -> torch.Tensor:
        logits = self.causal_lm().lm_head(h).float() / temps[:, None]
        return torch.log_softmax(logits, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def load_base(
    model: str, cache_dir: Path | None, device: torch.device, seed: int
) -> tuple[Any, str]:
    """The fp32 base. `random:CONFIG.json` builds a randomly initialised model of that
    architecture directly on the device (benchmarks: speed does not depend on the weights, and a
    4 B model need not be written to disk first)."""
    if model.startswith("random:"):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model.removeprefix("random:"))
        torch.manual_seed(seed)
        with device:
            base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return base, model
    spec = models.resolve(model, cache_dir)
    return models.load_model(spec, dtype=torch.float32, device="cpu", seed=seed), str(
        spec.path or spec.name
    )


class ShardedLoRATrainer:
    def __init__(
        self,
        model: str,
        *,
        lora_rank: int,
        lora_alpha: int,
        seed: int,
        device: str,
        cache_dir: Path | None,
        chunk: int = 1024,
        token_budget: int = 8192,
        checkpointing: bool = True,
        compute_dtype: str = "auto",
    ) -> None:
        from peft import LoraConfig, get_peft_model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)
        self.token_budget = token_budget
        base, self.base_name = load_base(model, cache_dir, self.device, seed)
        config = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear", lora_dropout=0.0
        )
        with torch.random.fork_rng(devices=[]):  # the engine's init: same seed, same adapter
            torch.manual_seed(seed)
            peft_model: Any = get_peft_model(base, config, adapter_name=ADAPTER)
        self.peft_config = peft_model.peft_config[ADAPTER]  # target_modules resolved
        if checkpointing:
            peft_model.base_model.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        peft_model.to(self.device)
        peft_model.train()  # checkpointing is active in train mode; LoRA dropout is 0
        mesh = init_device_mesh(self.device.type, (self.world,))
        bf16 = compute_dtype == "bf16" or (compute_dtype == "auto" and self.device.type == "cuda")
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        for layer in peft_model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        self.model: Any = ChunkedLogprobs(peft_model, chunk)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._fresh_optimizer()
        self.steps = 0
        # this rank's shards of the initial adapter (B = 0): version 0's weights, for rollback
        self.initial = [p.detach().clone() for p in self.params]

    # --- one step ---------------------------------------------------------------------------

    def _logprobs(self, rows: list[list[Datum]]) -> torch.Tensor:
        """New logprobs of every completion token of `rows`, concatenated (row by row, datum by
        datum): each row packed without padding as the CPU engine packs it, the rows stacked."""
        packed = stack(rows)
        temps = [
            d.temperature if d.temperature > 0 else 1.0
            for row in rows
            for d in row
            for _ in d.completion_ids
        ]
        dev = self.device
        return self.model(
            torch.tensor(packed.ids, device=dev),
            torch.tensor(packed.positions, device=dev),
            torch.tensor(packed.keep, device=dev),
            torch.tensor(packed.targets, device=dev),
            torch.tensor(temps, device=dev),
        )

    def train_step(self, batch: list[Datum], loss: LossSpec, optim: OptimSpec) -> dict[str, Any]:
        started = time.perf_counter()
        total = batch_tokens(batch)
        mine = batch[self.rank :: self.world]
        groups = stacked_micro_batches(mine, self.token_budget)
        # every rank must run the same number of forward/backward passes (FSDP collectives):
        # ranks with fewer micro-batches run zero-weight ones on the batch's first datum
        count = torch.tensor([len(groups)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        weights = [1.0] * len(groups) + [0.0] * (int(count) - len(groups))
        groups += [[[batch[0]]]] * (int(count) - len(groups))
        for g in self.optimizer.param_groups:
            g.update(
                lr=optim.learning_rate,
                betas=(optim.beta1, optim.beta2),
                eps=optim.eps,
                weight_decay=optim.weight_decay,
            )
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, clipped, kl
        for group, w in zip(groups, weights, strict=True):
            base = None
            if loss.kl_coef:
                with torch.no_grad(), self.model.peft.disable_adapter():
                    base = self._logprobs(group)
            new = self._logprobs(group)
            datums = [d for row in group for d in row]
            old = torch.tensor(
                [x for d in datums for x in d.logprobs], device=new.device, dtype=new.dtype
            )
            adv = torch.tensor(
                [x for d in datums for x in d.advantages], device=new.device, dtype=new.dtype
            )
            terms = ppo_token_losses(new, old, adv, torch.ones_like(new), loss, base)
            part = terms.loss.sum() / total
            (part * (w * self.world)).backward()
            sums += w * torch.stack(
                [
                    part.detach().double(),
                    terms.clipped.sum().double(),
                    terms.approx_kl.sum().double(),
                ]
            )
        dist.all_reduce(sums)
        max_norm = optim.grad_clip_norm if optim.grad_clip_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        loss_sum, clipped, kl = (float(x) for x in sums.tolist())
        return asdict(
            StepMetrics(
                loss=loss_sum,
                clip_fraction=clipped / total,
                approx_kl=kl / total,
                grad_norm=grad_norm,
                tokens=total,
                samples=len(batch),
                seconds=time.perf_counter() - started,
                extra={"world_size": float(self.world)},
            )
        )

    # --- adapters and checkpoints -----------------------------------------------------------

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA weights gathered to full tensors (collective: every rank calls it), keyed as
        PEFT saves them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            self.model,
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
            ),
        )
        out = {}
        for key, value in full.items():
            if "lora_" not in key:  # a tied (frozen) lm_head can slip through ignore_frozen_params
                continue
            assert isinstance(value, torch.Tensor)
            out[_peft_key(key)] = value.detach().float().contiguous()
        return out

    def _fresh_optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(self.params, lr=1e-4)  # each step sets its own lr

    def save_adapter(self, path: str) -> None:
        from safetensors.torch import save_file

        state = self.adapter_state()
        if self.rank == 0:
            folder = Path(path)
            folder.mkdir(parents=True, exist_ok=True)
            save_file(state, str(folder / "adapter_model.safetensors"))
            self.peft_config.base_model_name_or_path = self.base_name
            self.peft_config.save_pretrained(str(folder))  # adapter_config.json, PEFT's own
        dist.barrier()

    def load_adapter(self, path: str | None) -> None:
        """Make the trainable weights those of a PEFT adapter folder (`save_adapter`'s layout;
        None: the initial adapter) and start a fresh optimizer. Every rank reads the file and
        takes its own shards (collective: every rank calls it)."""
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor, distribute_tensor

        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if path is None:
            values = self.initial
        else:
            saved = load_file(str(Path(path) / "adapter_model.safetensors"))
            keys = {n: _peft_key(n) for n in names}
            missing = sorted(k for k in keys.values() if k not in saved)
            if missing:
                raise KeyError(f"{path} lacks {len(missing)} LoRA tensors, e.g. {missing[0]}")
            values = [saved[keys[n]] for n in names]
        with torch.no_grad():
            for p, value in zip(self.params, values, strict=True):
                if isinstance(p, DTensor) and not isinstance(value, DTensor):
                    value = distribute_tensor(
                        value.to(p.device_mesh.device_type, p.dtype), p.device_mesh, p.placements
                    )
                p.copy_(value)
        self.optimizer = self._fresh_optimizer()

    def save_state(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=True)
        )
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        if self.rank == 0:
            (Path(path) / "trainer.json").write_text(json.dumps({"steps": self.steps}))
        dist.barrier()

    def load_state(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        if not (
            Path(path) / "trainer.json"
        ).exists():  # checked by every rank, before any collective
            raise FileNotFoundError(f"no trainer checkpoint at {path}")
        options = StateDictOptions(ignore_frozen_params=True)
        msd, osd = get_state_dict(self.model, self.optimizer, options=options)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        # strict=False: the checkpoint holds the LoRA weights only; the frozen base is the model's
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
        self.steps = int(json.loads((Path(path) / "trainer.json").read_text())["steps"])

    def info(self) -> dict[str, Any]:
        n = sum(p.numel() for p in self.model.parameters())  # sharded: local numel of DTensors
        peak = (
            torch.cuda.max_memory_allocated(self.device) / 2**30
            if self.device.type == "cuda"
            else None
        )
        return {
            "world_size": self.world,
            "device": str(self.device),
            "steps": self.steps,
            "trainable": sum(p.numel() for p in self.params),
            "local_params": n,
            "peak_memory_gib": round(peak, 2) if peak is not None else None,
        }


def serve(trainer: ShardedLoRATrainer, rpc_port: int) -> None:
    """Rank 0 receives (command, kwargs) from the bridge and broadcasts it; every rank runs it;
    errors on any rank are gathered so a failure never leaves the others in a collective."""
    conn = None
    if trainer.rank == 0:
        key = os.environ.get(KEY_ENV, "").encode()
        listener = Listener(("127.0.0.1", rpc_port), authkey=key or None)
        conn = listener.accept()
    while True:
        box: list[Any] = [conn.recv() if conn is not None else None]
        dist.broadcast_object_list(box, src=0)
        name, kwargs = box[0]
        result: Any = None
        error = ""
        if name != "shutdown":
            try:
                result = getattr(trainer, name)(**kwargs)
            except Exception:
                error = traceback.format_exc()
        errors: list[Any] = [None] * trainer.world
        dist.all_gather_object(errors, error)
        if conn is not None:
            failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
            conn.send(("error", "\n".join(failed)) if failed else ("ok", result))
        if name == "shutdown":
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rpc-port", type=int, required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        trainer = ShardedLoRATrainer(
            args.model,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            seed=args.seed,
            device="cuda" if args.device == "cuda" else "cpu",
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            chunk=args.chunk,
            token_budget=args.token_budget,
            checkpointing=not args.no_checkpointing,
            compute_dtype=args.compute_dtype,
        )
        serve(trainer, args.rpc_port)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
