"""The GPU plan: which process runs on which GPUs and ports, and what memory each may use.

Pure functions of the GPU count and the role sizes, so `clawbridge plan --gpus 8` (and `up --plan`)
prints the same plan on a laptop as on the GPU node. Roles:

- actor: the FSDP2 LoRA trainer (torchrun, one rank per GPU);
- rollout: the policy SGLang server (LoRA enabled, serves `policy@vK`);
- prm: the judge SGLang server (frozen base; empty: the judge shares the policy server's base
  model, or an external `--judge-url`).

Modes: `split` (every role on its own GPUs: 8 = 4/2/2 by default), `colocated` (one GPU: SGLang
with a static memory fraction beside the trainer) and `cpu` (no GPU: the torch engine on CPU).
"""

from __future__ import annotations

import json as _json
from dataclasses import asdict, dataclass, field
from typing import Literal

Mode = Literal["split", "colocated", "cpu"]
ROLES = ("actor", "rollout", "prm")

PROXY_PORT = 30000
POLICY_PORT = 30010
JUDGE_PORT = 30020
TRAINER_RPC_PORT = 30030
TRAINER_MASTER_PORT = 30040

# SGLang's --mem-fraction-static: the share of GPU memory it takes for weights + KV cache.
DEDICATED_FRACTION = 0.85
COLOCATED_FRACTION = 0.40


class LayoutError(ValueError):
    """The requested split cannot run on the GPUs given (the message says what to change)."""


@dataclass(frozen=True)
class Process:
    name: str  # "proxy", "policy-sglang", "judge-sglang", "trainer"
    role: str  # "proxy", "rollout", "prm", "actor"
    gpus: tuple[int, ...]
    port: int
    detail: str  # how it is launched, in words


@dataclass(frozen=True)
class GpuBudget:
    gpu: int
    uses: tuple[tuple[str, float], ...]  # (process name, GiB it may use)

    @property
    def total_gib(self) -> float:
        return sum(g for _, g in self.uses)


@dataclass(frozen=True)
class Plan:
    num_gpus: int
    mode: Mode
    roles: dict[str, tuple[int, ...]]
    processes: tuple[Process, ...]
    memory: tuple[GpuBudget, ...]
    gpu_memory_gib: float
    model_params_b: float
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, object]:
        return {
            "num_gpus": self.num_gpus,
            "mode": self.mode,
            "roles": {r: list(self.roles[r]) for r in ROLES},
            "processes": [
                {**asdict(p), "gpus": list(p.gpus)} for p in self.processes
            ],
            "memory_gib": [
                {"gpu": b.gpu, "uses": {n: round(g, 1) for n, g in b.uses}, "total": round(b.total_gib, 1)}
                for b in self.memory
            ],
            "gpu_memory_gib": self.gpu_memory_gib,
            "model_params_b": self.model_params_b,
            "notes": list(self.notes),
        }


def default_split(num_gpus: int) -> tuple[int, int, int]:
    """actor/rollout/prm counts: half trains, a quarter serves, a quarter judges (8 = 4/2/2).
    Two GPUs: one trains, one serves and judges with the base model. One GPU: all colocated."""
    if num_gpus <= 0:
        return (0, 0, 0)
    if num_gpus == 1:
        return (1, 1, 1)
    if num_gpus == 2:
        return (1, 1, 0)
    side = max(1, num_gpus // 4)
    return (num_gpus - 2 * side, side, side)


def plan(
    num_gpus: int,
    actor: int | None = None,
    rollout: int | None = None,
    prm: int | None = None,
    *,
    gpu_memory_gib: float = 80.0,
    model_params_b: float = 4.0,
    lora_rank: int = 32,
) -> Plan:
    """The plan for `num_gpus` GPUs; role sizes default to `default_split`. Raises LayoutError
    for splits that cannot run (more GPUs than given, a role with none on a GPU machine)."""
    if num_gpus < 0:
        raise LayoutError("the GPU count cannot be negative")
    da, dr, dp = default_split(num_gpus)
    a = da if actor is None else actor
    r = dr if rollout is None else rollout
    p = dp if prm is None else prm
    if min(a, r, p) < 0:
        raise LayoutError("GPU counts per role cannot be negative")
    if num_gpus == 0:
        if a or r or p:
            raise LayoutError(f"{a}/{r}/{p} GPUs requested for actor/rollout/prm but none are available")
        return _cpu_plan(gpu_memory_gib, model_params_b)
    if num_gpus == 1 and a <= 1 and r <= 1 and p <= 1:
        if a == 0 or r == 0:
            raise LayoutError("one GPU runs the trainer and the policy server together: ACTOR_GPUS=1 ROLLOUT_GPUS=1")
        return _colocated_plan(p == 1, gpu_memory_gib, model_params_b, lora_rank)
    if a < 1 or r < 1:
        raise LayoutError(f"the trainer (actor) and the policy server (rollout) need at least one GPU each; got {a}/{r}")
    if a + r + p > num_gpus:
        raise LayoutError(
            f"ACTOR_GPUS+ROLLOUT_GPUS+PRM_GPUS = {a}+{r}+{p} = {a + r + p} exceeds NUM_GPUS={num_gpus}: "
            f"lower a role or use the default split {da}/{dr}/{dp}"
        )
    return _split_plan(num_gpus, a, r, p, gpu_memory_gib, model_params_b, lora_rank)


def _cpu_plan(gpu_memory_gib: float, model_params_b: float) -> Plan:
    procs = (
        Process("proxy", "proxy", (), PROXY_PORT, "OpenAI-compatible proxy; the torch engine samples and trains in process on CPU"),
    )
    return Plan(
        0, "cpu", {r: () for r in ROLES}, procs, (), gpu_memory_gib, model_params_b,
        ("no GPU: the local backend serves and trains with the torch engine on CPU",),
    )


def trainer_gib(model_params_b: float, ranks: int, lora_rank: int) -> float:
    """Per-rank memory of the FSDP2 LoRA trainer: fp32 base sharded over the ranks, one gathered
    bf16 layer at a time, LoRA params with fp32 Adam state, and an activation allowance
    (checkpointed layers, chunked logprobs)."""
    base = 4.0 * model_params_b / ranks
    lora = 16.0 * model_params_b * lora_rank / 4096 / ranks  # ~r/d of the params, x4 fp32 states
    activations = 6.0 + 1.5 * model_params_b / 4
    return base + lora + activations


def _colocated_plan(judge_on_gpu: bool, mem: float, params_b: float, lora_rank: int) -> Plan:
    train = trainer_gib(params_b, 1, lora_rank)
    sglang = COLOCATED_FRACTION * mem
    procs = [
        Process("proxy", "proxy", (), PROXY_PORT, "OpenAI-compatible proxy"),
        Process("policy-sglang", "rollout", (0,), POLICY_PORT,
                f"sglang --enable-lora --mem-fraction-static {COLOCATED_FRACTION} --tp 1"
                + ("; also serves the judge with the base model" if judge_on_gpu else "")),
        Process("trainer", "actor", (0,), TRAINER_RPC_PORT, "torchrun --nproc-per-node 1 (FSDP2 LoRA)"),
    ]
    notes = [f"colocated: SGLang takes {COLOCATED_FRACTION:.0%} of GPU 0, the trainer the rest"]
    if train + sglang > mem:
        notes.append(f"warning: estimated {train + sglang:.0f} GiB exceeds {mem:.0f} GiB; use a smaller model")
    return Plan(
        1, "colocated", {"actor": (0,), "rollout": (0,), "prm": (0,) if judge_on_gpu else ()},
        tuple(procs), (GpuBudget(0, (("policy-sglang", sglang), ("trainer", train))),),
        mem, params_b, tuple(notes),
    )


def _split_plan(n: int, a: int, r: int, p: int, mem: float, params_b: float, lora_rank: int) -> Plan:
    actor = tuple(range(a))
    rollout = tuple(range(a, a + r))
    prm = tuple(range(a + r, a + r + p))
    procs = [
        Process("proxy", "proxy", (), PROXY_PORT, "OpenAI-compatible proxy"),
        Process("policy-sglang", "rollout", rollout, POLICY_PORT,
                f"sglang --enable-lora --tp {r} --mem-fraction-static {DEDICATED_FRACTION}"
                + ("" if p else "; also serves the judge with the base model")),
    ]
    if p:
        procs.append(Process("judge-sglang", "prm", prm, JUDGE_PORT,
                             f"sglang --tp {p} --mem-fraction-static {DEDICATED_FRACTION} (frozen base)"))
    procs.append(Process("trainer", "actor", actor, TRAINER_RPC_PORT,
                         f"torchrun --nproc-per-node {a} --master-port {TRAINER_MASTER_PORT} (FSDP2 LoRA)"))
    train = trainer_gib(params_b, a, lora_rank)
    budgets = [GpuBudget(g, (("trainer", train),)) for g in actor]
    budgets += [GpuBudget(g, (("policy-sglang", DEDICATED_FRACTION * mem),)) for g in rollout]
    budgets += [GpuBudget(g, (("judge-sglang", DEDICATED_FRACTION * mem),)) for g in prm]
    notes = []
    unused = n - a - r - p
    if unused:
        notes.append(f"{unused} GPU(s) unused: {tuple(range(a + r + p, n))}")
    if train > mem:
        notes.append(f"warning: the trainer needs about {train:.0f} GiB per GPU; add actor GPUs")
    return Plan(
        n, "split", {"actor": actor, "rollout": rollout, "prm": prm}, tuple(procs),
        tuple(budgets), mem, params_b, tuple(notes),
    )


def render_plan(p: Plan, json: bool = False) -> str:
    if json:
        return _json.dumps(p.to_json(), indent=2)
    lines = [f"clawbridge local plan: {p.num_gpus} GPU(s), mode {p.mode}, model ~{p.model_params_b:g}B params"]
    for role in ROLES:
        gpus = p.roles[role]
        lines.append(f"  {role:<8} GPUs {list(gpus) if gpus else '-'}")
    lines.append("processes:")
    for proc in p.processes:
        where = f"GPUs {list(proc.gpus)}" if proc.gpus else "CPU"
        lines.append(f"  {proc.name:<14} {where:<16} port {proc.port:<6} {proc.detail}")
    if p.memory:
        lines.append(f"memory per GPU (of {p.gpu_memory_gib:g} GiB, estimates):")
        for b in p.memory:
            uses = ", ".join(f"{n} {g:.1f}" for n, g in b.uses)
            lines.append(f"  GPU {b.gpu}: {uses} -> {b.total_gib:.1f} GiB")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def visible_gpus() -> int:
    """GPUs this process can see (0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install means no usable GPU
        return 0


def validate_visible(p: Plan, visible: int) -> None:
    if p.num_gpus > visible:
        raise LayoutError(
            f"NUM_GPUS={p.num_gpus} but only {visible} GPU(s) are visible "
            "(check CUDA_VISIBLE_DEVICES, or lower --gpus)"
        )
