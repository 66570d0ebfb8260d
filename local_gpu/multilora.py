"""Many LoRA adapters over one base model in one forward: each row adds its own adapter's delta.

Every registered adapter lives in a slot of one stack per LoRA layer (`AdapterStack`: A as
[slots, rank, in], B as [slots, out, rank], the scale per slot). A forward names each row's slot
(`Plan`); a hook on every LoRA layer adds, to the base layer's output, each row's
`scale · B[slot] · A[slot] · x` — the adapters are never merged into the base weights, so rows on
different adapters share the base's one matmul per layer. The delta's math is in pure functions:
`single_delta` (every row on one slot: the plain product PEFT computes for one adapter),
`gathered_delta` (each row's A and B gathered by slot, once while the batch's rows stay the same,
and multiplied batched, as Punica's kernels do) and `grouped_delta` (each run of consecutive rows
on one slot through a plain product, no copy). Which of the last two
serves a mixed batch is `MIXED`, chosen by `bench/multi_adapter.py` (docs/engine.md).

The hooks are on only while a forward has rows on registered adapters (`engage`), so every other
forward runs exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

Strategy = Literal["gather", "group"]
MIXED: Strategy = "gather"
NONE = -1  # a row on no registered adapter (the base, or a version PEFT serves)


def single_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """Every row on one adapter: `B·A·x · scale`, as PEFT's LoRA layer computes it. x [n, L, in],
    a [rank, in], b [out, rank] -> [n, L, out]."""
    return F.linear(F.linear(x, a), b) * scale


Gathered = tuple[torch.Tensor, torch.Tensor]


def gather(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, index: torch.Tensor) -> Gathered:
    """Row i's adapter, slot `index[i]`, taken out of the stacks a [slots, rank, in], b [slots,
    out, rank] and scale [slots]: A as [n, in, rank] and scale·B as [n, rank, out], laid out for
    `gathered_delta`'s batched products (the scale folded into the copy of B once)."""
    return (
        a.index_select(0, index).transpose(1, 2).contiguous(),
        (b.index_select(0, index) * scale.index_select(0, index).view(-1, 1, 1)).transpose(1, 2).contiguous(),
    )


def gathered_delta(x: torch.Tensor, rows: Gathered, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row through its own gathered adapter in one batched product per factor (as Punica's
    kernels do): x [n, L, in] -> [n, L, out]; with `out`, `out` plus it in one kernel."""
    a, b = rows
    h = torch.bmm(x, a)
    return torch.bmm(h, b) if out is None else torch.baddbmm(out, h, b)


def grouped_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: Sequence[float], runs: Sequence[tuple[int, int, int]]
) -> torch.Tensor:
    """Each run of consecutive rows on one slot, `(start, end, slot)`, through that slot's adapter
    in one plain product (no copy of the weights), the runs' results laid end to end. Same
    shapes as `gathered_delta`."""
    parts = [single_delta(x[start:end], a[slot], b[slot], scales[slot]) for start, end, slot in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def runs_of(slots: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """`slots` as runs of consecutive equal entries: (start, end, slot)."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][2] == s:
            runs[-1] = (runs[-1][0], i + 1, s)
        else:
            runs.append((i, i + 1, s))
    return tuple(runs)


@dataclass(frozen=True, eq=False)
class Plan:
    """Which slot each row of a forward runs on, laid out once for every layer of the forward
    (and kept while the rows stay the same: a decode batch between admissions)."""

    slots: tuple[int, ...]
    single: int | None  # every row on this slot
    live: torch.Tensor | None  # the rows on some slot (None: every row)
    index: torch.Tensor  # the slot of each live row
    runs: tuple[tuple[int, int, int], ...]  # runs of live rows on one slot (positions among the live rows)
    gathered: dict[int, Gathered] = field(default_factory=dict)  # each layer's `gather`, made on first use

    @staticmethod
    def of(slots: Sequence[int], device: torch.device | str = "cpu") -> Plan:
        """The plan for rows on `slots` (NONE: a row on no registered adapter; at least one is on
        a slot)."""
        live = [i for i, s in enumerate(slots) if s != NONE]
        assert live, "a plan needs a row on a registered adapter"
        on = [slots[i] for i in live]
        every = len(live) == len(slots)
        return Plan(
            slots=tuple(slots),
            single=on[0] if every and len(set(on)) == 1 else None,
            live=None if every else torch.tensor(live, device=device),
            index=torch.tensor(on, device=device),
            runs=runs_of(on),
        )


def slot_bytes(shapes: Sequence[tuple[int, int]], rank: int, dtype: torch.dtype) -> int:
    """The memory of one slot: rank × (in + out) numbers for each adapted layer."""
    return rank * sum(i + o for i, o in shapes) * torch.tensor([], dtype=dtype).element_size()


class AdapterStack:
    """Slots of LoRA weights for `layers` (PEFT LoRA layers, keyed by their module names), each
    adapter's A and B zero-padded to `rank`, in `dtype` on `device`. The tensors are allocated
    empty: a slot's pages are taken when it is first filled."""

    def __init__(
        self,
        layers: Mapping[str, Any],
        *,
        rank: int,
        slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        strategy: Strategy = MIXED,
    ) -> None:
        self.layers = dict(layers)
        self.rank, self.slots, self.dtype, self.device = rank, slots, dtype, device
        self.strategy: Strategy = strategy
        shapes = [(layer.in_features, layer.out_features) for layer in self.layers.values()]
        self.slot_bytes = slot_bytes(shapes, rank, dtype)
        self.a = [torch.empty(slots, rank, i, dtype=dtype, device=device) for i, _ in shapes]
        self.b = [torch.empty(slots, o, rank, dtype=dtype, device=device) for _, o in shapes]
        self.scale = torch.zeros(slots, dtype=dtype, device=device)
        self.scales = [0.0] * slots
        self.plan: Plan | None = None
        self._hooks: list[Any] = []

    def keys(self) -> set[str]:
        """The weight keys an adapter may carry (PEFT's state-dict keys, adapter name removed)."""
        return {f"{name}.lora_{m}.weight" for name in self.layers for m in "AB"}

    def check(self, weights: Mapping[str, torch.Tensor]) -> None:
        """ValueError unless every weight fits a LoRA layer's slots (rank at most the stack's)."""
        unknown = sorted(weights.keys() - self.keys())
        if unknown:
            raise ValueError(f"adapter weights do not fit the model's LoRA layers: unexpected {unknown[:3]}")
        for name, a, b in zip(self.layers, self.a, self.b, strict=True):
            wa, wb = weights.get(f"{name}.lora_A.weight"), weights.get(f"{name}.lora_B.weight")
            if (wa is None) != (wb is None):
                raise ValueError(f"{name}: an adapter needs both lora_A and lora_B")
            if wa is None or wb is None:
                continue
            r = wa.shape[0]
            if r > self.rank or wa.shape[1] != a.shape[2] or tuple(wb.shape) != (b.shape[1], r):
                raise ValueError(
                    f"{name}: an adapter of A {tuple(wa.shape)}, B {tuple(wb.shape)} does not fit slots of "
                    f"rank {self.rank} for a layer {a.shape[2]} -> {b.shape[1]}"
                )

    def fill(self, slot: int, weights: Mapping[str, torch.Tensor], scale: float) -> None:
        """Copy an adapter into `slot` (`check`ed first): a layer it does not adapt gets zeros."""
        self.check(weights)
        with torch.no_grad():
            for name, a, b in zip(self.layers, self.a, self.b, strict=True):
                wa, wb = weights.get(f"{name}.lora_A.weight"), weights.get(f"{name}.lora_B.weight")
                if wa is None or wb is None:
                    a[slot].zero_()
                    b[slot].zero_()
                    continue
                r = wa.shape[0]
                a[slot, :r].copy_(wa)
                a[slot, r:].zero_()
                b[slot, :, :r].copy_(wb)
                b[slot, :, r:].zero_()
        self.scale[slot] = scale
        self.scales[slot] = scale
        self.plan = None  # a plan may hold this slot's old weights, gathered

    def weights(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of `slot`'s weights, keyed as `fill` takes them (at the stack's rank)."""
        out: dict[str, torch.Tensor] = {}
        for name, a, b in zip(self.layers, self.a, self.b, strict=True):
            out[f"{name}.lora_A.weight"] = a[slot].clone()
            out[f"{name}.lora_B.weight"] = b[slot].clone()
        return out

    # --- the forward's hooks -----------------------------------------------------------------

    def engage(self, slots: Sequence[int]) -> None:
        """The next forwards' rows run on `slots` (NONE: no registered adapter for that row)."""
        if self.plan is None or self.plan.slots != tuple(slots):
            self.plan = Plan.of(slots, self.device)
        if not self._hooks:
            self._hooks = [
                layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers.values())
            ]

    def disengage(self) -> None:
        """No registered adapter in the next forwards: the layers run as PEFT set them."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self.plan = [], None

    def _hook(self, i: int) -> Any:
        a, b = self.a[i], self.b[i]

        def add_delta(_layer: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            plan = self.plan
            assert plan is not None
            x = args[0].to(self.dtype)
            if plan.single is not None:
                return output + single_delta(x, a[plan.single], b[plan.single], self.scales[plan.single]).to(output.dtype)
            rows = x if plan.live is None else x.index_select(0, plan.live)
            if self.strategy == "gather":
                if i not in plan.gathered:
                    plan.gathered[i] = gather(a, b, self.scale, plan.index)
                if plan.live is None and output.dtype == self.dtype:
                    return gathered_delta(rows, plan.gathered[i], output)
                delta = gathered_delta(rows, plan.gathered[i])
            else:
                delta = grouped_delta(rows, a, b, self.scales, plan.runs)
            if plan.live is None:
                return output + delta.to(output.dtype)
            return output.index_add(0, plan.live, delta.to(output.dtype))

        return add_delta
