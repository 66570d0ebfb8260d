"""The running decode batch in a slotted static KV cache (`SlotBatch`), the engine's batch with
`static_cache` on: preallocated rows written in place, optionally replayed as CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from clawbridge.local_gpu.kvcache import CACHE, layers_of
from transformers import DynamicCache


class SlotBatch:
    """The running decode batch in a slotted static KV cache: per layer one preallocated
    [slots, kv_heads, length, head_dim] key and value tensor, row i the i-th sequence the engine
    tracks.

    New sequences are prefilled (`prefill.Prefill`) and each one's own keys copied into the next free
    row from column 0; each decode step writes every row's new key at that row's own position
    (`update`, called by the model's attention layers) and attends through a 4-D additive mask
    that hides each row's columns past its position. Finished rows are dropped by moving the live
    rows down, so rows [0, size) stay live and a step runs on a view of them. The cache is
    reallocated only when the longest sequence outgrows it (doubling).

    `bucketed`: a step runs on a power-of-two number of rows (free rows ride along at position 0
    and are ignored) over every allocated column, from inputs in fixed buffers, so each
    (adapter, rows, length) shape has fixed tensor addresses; with `capture` (CUDA only) the step
    is recorded once per shape as a CUDA graph and replayed, which removes the per-kernel launch
    cost that bounds decode on a GPU. Unbucketed, a step runs on exactly the live rows and
    columns (cheapest where launches cost nothing, as on a CPU).
    """

    MIN_LENGTH = 256

    def __init__(
        self, slots: int, max_length: int, *, bucketed: bool = False, capture: bool = False
    ) -> None:
        self.slots, self.max_length = slots, max_length
        self.bucketed, self.capture = bucketed, capture and bucketed
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: list[int] = []  # position of each row's next input (= its cached length)
        self.next_tokens: list[int] = []
        # the step's inputs, at fixed addresses
        self._ids = self._pos = self._rows = torch.zeros(0, dtype=torch.long)
        self._steps: dict[tuple[str, int, int], tuple[Any, torch.Tensor]] = {}  # captured graphs
        self._pool: Any = None
        self._write = torch.zeros(0, dtype=torch.long)  # the column each running row writes
        self._attend = 0  # columns a step attends over

    @property
    def size(self) -> int:
        return len(self.positions)

    @property
    def capacity(self) -> int:
        return 0 if not self.keys else int(self.keys[0].shape[2])

    def invalidate(self) -> None:
        """Forget captured steps, and their memory pool (the adapters' layers were rebuilt, or the
        cache was reallocated: the graphs read old tensors). The pool goes with the graphs: once
        the last graph sharing a pool is freed, torch retires the pool, and a capture that names
        it again fails an internal assertion."""
        self._steps.clear()
        self._pool = None

    def _reserve(
        self, length: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> None:
        """Make every row hold at least `length` columns (keeping what is cached)."""
        if length <= self.capacity:
            return
        new = max(length, min(self.max_length, max(self.MIN_LENGTH, 2 * self.capacity)))
        template = like if like is not None else list(zip(self.keys, self.values, strict=True))
        keys, values = [], []
        for i, (k, v) in enumerate(template):
            nk = k.new_zeros((self.slots, k.shape[1], new, k.shape[3]))
            nv = v.new_zeros((self.slots, v.shape[1], new, v.shape[3]))
            if self.keys:
                old = self.capacity
                nk[:, :, :old] = self.keys[i]
                nv[:, :, :old] = self.values[i]
            keys.append(nk)
            values.append(nv)
        self.keys, self.values = keys, values
        device = keys[0].device
        if self._ids.device != device or not self._ids.numel():
            self._ids = torch.zeros(self.slots, dtype=torch.long, device=device)
            self._pos = torch.zeros(self.slots, dtype=torch.long, device=device)
            self._rows = torch.arange(self.slots, device=device)
        self.invalidate()  # captured steps read the old tensors

    def add_rows(
        self, cache: DynamicCache, mask: torch.Tensor | None, lengths: list[int], next_tokens: list[int]
    ) -> None:
        """Append prefilled sequences: `cache` [b, H, L, D] left-padded (row i's `lengths[i]` real
        positions are its last; `mask` is not needed), each copied into its row from column 0."""
        layers = layers_of(cache)
        self._reserve(max(lengths) + 1, layers if not self.keys else None)
        width = int(layers[0][0].shape[2])
        for j, n in enumerate(lengths):
            row = self.size
            for i, (k, v) in enumerate(layers):
                self.keys[i][row, :, :n] = k[j, :, width - n :]
                self.values[i][row, :, :n] = v[j, :, width - n :]
            self.positions.append(n)
            self.next_tokens.append(next_tokens[j])

    def _rows_for_step(self) -> int:
        if not self.bucketed:
            return self.size
        return min(self.slots, 1 << (self.size - 1).bit_length())

    def _inputs(self, rows: int) -> dict[str, Any]:
        """The model's inputs for `rows` rows, read from the fixed buffers (graph-safe)."""
        pos = self._pos[:rows]
        self._write = pos
        seen = torch.arange(self._attend, device=pos.device)[None, :] <= pos[:, None]
        dtype = self.keys[0].dtype  # additive, as every attention implementation reads a 4-D mask
        mask = torch.zeros(seen.shape, dtype=dtype, device=pos.device).masked_fill_(
            ~seen, torch.finfo(dtype).min
        )
        return {
            "input_ids": self._ids[:rows].view(-1, 1),
            "position_ids": pos.view(-1, 1),
            CACHE: self,
            "attention_mask": mask[:, None, None, :],
        }

    def step(
        self, forward: Callable[[dict[str, Any]], torch.Tensor], adapter: str | None
    ) -> torch.Tensor:
        """One decode step of every row: `forward(inputs)` -> last-position logits [rows, V]; the
        live rows' logits come back. `adapter`: the one adapter every row runs on (None: several,
        which is never captured: the mixed-batch path is not graph-safe)."""
        self._reserve(max(self.positions) + 1)
        rows = self._rows_for_step()
        self._attend = self.capacity if self.bucketed else max(self.positions) + 1
        device = self._ids.device
        self._ids[: self.size] = torch.tensor(self.next_tokens, device=device)
        self._pos[: self.size] = torch.tensor(self.positions, device=device)
        if rows > self.size:  # free rows ride along at column 0 of their own row
            self._ids[self.size : rows] = 0
            self._pos[self.size : rows] = 0
        if not self.capture or adapter is None:
            return forward(self._inputs(rows))[: self.size]
        key = (adapter, rows, self._attend)
        if key not in self._steps:
            self._steps[key] = self._record(forward, rows)
        graph, logits = self._steps[key]
        graph.replay()
        return logits[: self.size]

    def _record(
        self, forward: Callable[[dict[str, Any]], torch.Tensor], rows: int
    ) -> tuple[Any, torch.Tensor]:
        """Capture one step as a CUDA graph. The warm-up runs are real steps on the same inputs:
        they write the same keys the replay writes."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(self._inputs(rows))
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward(self._inputs(rows))
        return graph, logits

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by attention layer `layer` with the step's new keys and values [rows, H, 1, D]:
        each row's are written at its own column; the rows' attended columns come back. What
        else the layer passes (positional cache kwargs up to transformers 5.23, `kwargs=` from
        5.24) is not needed."""
        rows = key.shape[0]
        k, v = self.keys[layer], self.values[layer]
        k[self._rows[:rows], :, self._write] = key[:, :, 0]
        v[self._rows[:rows], :, self._write] = value[:, :, 0]
        return k[:rows, :, : self._attend], v[:rows, :, : self._attend]

    def advance(self, tokens: list[int]) -> None:
        self.next_tokens = tokens
        self.positions = [p + 1 for p in self.positions]

    def keep(self, rows: list[int]) -> None:
        """Keep `rows` (in order) as rows 0..len(rows)-1, moving a row's columns only when its
        index changes."""
        for new, old in enumerate(rows):
            if new != old:
                n = self.positions[old]
                for k, v in zip(self.keys, self.values, strict=True):
                    k[new, :, :n] = k[old, :, :n]
                    v[new, :, :n] = v[old, :, :n]
        self.positions = [self.positions[i] for i in rows]
        self.next_tokens = [self.next_tokens[i] for i in rows]

