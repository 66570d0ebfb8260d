"""The server side of a Tinker-shaped training platform, on the tiny model, for offline fakes.

What a platform does behind its SDK: a LoRA policy (peft) over a frozen base, sampling with
per-token logprobs, prompt logprobs, the platform's built-in losses as the platform documents
them (PPO SUMMED over tokens, clip thresholds given as ratios; cross entropy), an AdamW step with
global-norm clipping, named sampler snapshots and resumable state. Work runs on one worker
thread, like a request queue, and answers through `concurrent.futures.Future`s. Faults are
injected per operation: an exception, or a hang longer than the client's timeout.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from clawbridge.local_gpu import models
from peft import LoraConfig, get_peft_model

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Hang:
    """A fault: the call answers only after `seconds` (a timeout on the client side)."""

    seconds: float


class Faults:
    """Per-operation fault plan: each call of `op` consumes the next planned fault, if any."""

    def __init__(self) -> None:
        self._plan: dict[str, deque[BaseException | Hang]] = {}
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, op: str, *faults: BaseException | Hang) -> None:
        with self._lock:
            self._plan.setdefault(op, deque()).extend(faults)

    def take(self, op: str) -> BaseException | Hang | None:
        with self._lock:
            self.calls[op] += 1
            queue = self._plan.get(op)
            return queue.popleft() if queue else None


@dataclass(frozen=True)
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class Run:
    """One training run's own state (a training client's, on Tinker), kept aside while another
    run holds the model: its weights (None: a fresh adapter's), optimizer and pending gradients."""

    weights: Weights | None = None
    optimizer: torch.optim.AdamW | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    grad_tokens: int = 0


class TinyPlatform:
    """The training runs (one model; the active run's weights in it, the others' kept aside), the
    active run's optimizer, and the snapshots they have published."""

    def __init__(self, *, rank: int = 8, alpha: int = 16, seed: int = 0, eos_id: int = 2) -> None:
        torch.manual_seed(seed)
        base = models.load_model(models.resolve(models.TINY), seed=seed)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0)
        self.model = get_peft_model(base, config)
        self.model.eval()  # no dropout anywhere: training and sampling see the same function
        self.eos_id = eos_id
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.initial = self.current_weights()  # what a new LoRA run starts from (B = 0)
        self.optimizer: torch.optim.AdamW | None = None
        self.active: Run | None = None  # the run whose weights, optimizer and gradients are the model's
        self.snapshots: dict[str, Weights] = {}
        self.states: dict[str, tuple[Weights, dict[str, Any] | None]] = {}
        self.faults = Faults()
        self.lock = threading.RLock()
        self.steps = 0
        self.last_grad_norm = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-platform")
        self._grad_tokens = 0
        self.seen: list[list[int]] = []  # every token sequence that reached the platform

    # --- the request queue ------------------------------------------------------------------
    def submit(self, op: str, work: Callable[[], Any]) -> Future[Any]:
        fault = self.faults.take(op)

        def run() -> Any:
            if isinstance(fault, Hang):
                time.sleep(fault.seconds)
            elif fault is not None:
                raise fault
            with self.lock:
                return work()

        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- weights ----------------------------------------------------------------------------
    def current_weights(self) -> Weights:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def new_run(self) -> Run:
        """A new LoRA training run, now the active one: fresh adapter weights (the base model's
        function), fresh optimizer. Other runs, snapshots and saved states stay."""
        run = Run()
        with self.lock:
            self.activate(run)
        return run

    def activate(self, run: Run) -> None:
        """Make `run` the model's (its work comes next): the active run's state is set aside."""
        if run is self.active:
            return
        if self.active is not None:
            left = self.active
            left.weights, left.optimizer, left.grad_tokens = self.current_weights(), self.optimizer, self._grad_tokens
            left.grads = {n: p.grad for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_((run.weights or self.initial)[n])
                p.grad = run.grads.get(n)
        self.optimizer, self._grad_tokens, self.active = run.optimizer, run.grad_tokens, run

    @contextmanager
    def using(self, weights: Weights | None) -> Iterator[None]:
        """Run with a snapshot's adapter (None: the base model, adapter disabled)."""
        if weights is None:
            with self.model.disable_adapter():
                yield
            return
        saved = self.current_weights()
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(weights[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])

    # --- model math -------------------------------------------------------------------------
    def target_logprobs(self, input_ids: Sequence[int], targets: Sequence[int]) -> torch.Tensor:
        """log p(targets[i] | input_ids[: i + 1]) at temperature 1, with gradients."""
        self.seen.append(list(input_ids))
        logits = self.model(input_ids=torch.tensor([list(input_ids)])).logits[0].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(targets)).unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def prompt_logprobs(self, tokens: Sequence[int], weights: Weights | None) -> list[float | None]:
        with self.using(weights):
            lp = self.target_logprobs(tokens[:-1], tokens[1:])
        return [None, *lp.tolist()]

    @torch.no_grad()
    def sample(
        self, prompt: Sequence[int], n: int, *, max_tokens: int, temperature: float, top_p: float,
        top_k: int, stop_ids: Sequence[int] | None, seed: int | None, weights: Weights | None,
        top_logprobs: int = 0,
    ) -> list[SampledSeq]:
        stops = set(stop_ids) if stop_ids is not None else {self.eos_id}
        gen = torch.Generator().manual_seed(seed if seed is not None else 1234 + self.steps)
        out = []
        self.seen.append(list(prompt))
        with self.using(weights):
            for _ in range(n):
                ids = list(prompt)
                toks: list[int] = []
                lps: list[float] = []
                tops: list[list[tuple[int, float]]] = []
                reason = "length"
                for _ in range(max_tokens):
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits / max(temperature, 1e-6), -1)
                    probs = _truncate(logp.exp(), top_p, top_k)
                    tok = int(torch.multinomial(probs, 1, generator=gen))
                    toks.append(tok)
                    lps.append(float(logp[tok]))  # before truncation: the PPO ratio is 1 on-policy
                    if top_logprobs:
                        v, i = logp.topk(top_logprobs)
                        tops.append(list(zip(i.tolist(), v.tolist(), strict=True)))
                    ids.append(tok)
                    if tok in stops:
                        reason = "stop"
                        break
                out.append(SampledSeq(toks, lps, reason, tops if top_logprobs else None))
        return out

    def forward_backward(
        self, items: Sequence[tuple[list[int], list[int], dict[str, list[float]]]], loss_fn: str,
        config: dict[str, Any], *, backward: bool = True,
    ) -> tuple[list[list[float]], float]:
        """The platform's built-in loss on each datum, SUMMED over tokens and data; gradients
        accumulate until the next optimizer step. Returns per-datum target logprobs and the loss."""
        total = torch.zeros(())
        outs = []
        for input_ids, targets, inputs in items:
            with torch.set_grad_enabled(backward):
                lp = self.target_logprobs(input_ids, targets)
            if loss_fn == "ppo":
                low = float(config.get("clip_low_threshold", 0.8))
                high = float(config.get("clip_high_threshold", 1.2))
                adv = torch.tensor(inputs["advantages"])
                ratio = torch.exp(lp - torch.tensor(inputs["logprobs"]))
                objective = torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
                loss = -objective.sum()
                tokens = int((adv != 0).sum())
            elif loss_fn == "cross_entropy":
                w = torch.tensor(inputs.get("weights", [1.0] * len(targets)))
                loss = -(lp * w).sum()
                tokens = int((w != 0).sum())
            else:
                raise ValueError(f"fake platform: loss {loss_fn!r} is not implemented")
            total = total + loss
            outs.append(lp.detach().tolist())
            if backward:  # only gradients that accumulate count as loss tokens
                self._grad_tokens += tokens
        if backward:
            total.backward()
        return outs, float(total.detach())

    def optim_step(
        self, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
        grad_clip_norm: float, divide_by_loss_tokens: bool = False,
    ) -> dict[str, float]:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                self.params.values(), lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay
            )
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        grads = [p for p in self.params.values() if p.grad is not None]
        if divide_by_loss_tokens and self._grad_tokens:
            for p in grads:
                p.grad.div_(self._grad_tokens)  # type: ignore[union-attr]
        norm = torch.nn.utils.clip_grad_norm_(grads, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._grad_tokens = 0
        self.steps += 1
        self.last_grad_norm = float(norm)
        return {"grad_norm": float(norm)}

    # --- persistence ------------------------------------------------------------------------
    def save_state(self, name: str) -> None:
        opt = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer else None
        self.states[name] = (self.current_weights(), opt)

    def load_state(self, name: str, *, with_optimizer: bool) -> None:
        weights, opt = self.states[name]
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(weights[n])
        self.optimizer = None
        if with_optimizer and opt is not None:
            self.optimizer = torch.optim.AdamW(self.params.values())
            self.optimizer.load_state_dict(copy.deepcopy(opt))


def _truncate(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    if top_k > 0:
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return probs / probs.sum()
