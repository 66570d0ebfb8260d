"""The running decode batch: one left-padded KV cache shared by every active sequence.

New sequences are prefilled together (`Prefill`: one forward for the prompts admitted at once,
each continuing its cached prefix, laid out right-aligned with left padding the mask hides), then
merged: the shorter side is padded on the left with zeros that the attention mask hides. Rotary
positions are applied before keys are cached, so padding never shifts a sequence's positions; each
row carries its own position ids. Finished rows are dropped between steps and columns that have
become padding in every row are trimmed, so the cache stays as long as the longest live sequence.

One forward per step serves every row (one matmul per layer), which is where batching pays;
docs/engine.md has the measured figures.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

# What transformers calls the KV cache, as a forward argument and an output field: `cache` in the
# releases that deprecate `past_key_values` (5.24 warns on it; 5.40 removes it), the old name
# before (5.5). Read off the output type, so either release runs without a deprecation warning.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_of(out: Any) -> Any:
    """The KV cache of a model's output."""
    return getattr(out, CACHE)


def _full_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers; every one must hold plain growing key/value tensors."""
    return list(cache.layers)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in _full_layers(cache)]


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t


@dataclass
class KVBatch:
    """Row i of every tensor belongs to the i-th sequence the engine tracks."""

    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # [B, L] 1 = real token, 0 = left padding
    positions: list[int] = field(default_factory=list)  # position of each row's next input
    next_tokens: list[int] = field(default_factory=list)  # each row's next input token
    padded: bool = False  # some row has left padding: the model needs the mask

    @property
    def size(self) -> int:
        return len(self.positions)

    @property
    def length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def add_rows(
        self, cache: DynamicCache, mask: torch.Tensor, lengths: list[int], next_tokens: list[int]
    ) -> None:
        """Append prefilled sequences: `cache` [b, H, L, D] left-padded as `mask` [b, L] says
        (1 = real), row i holding `lengths[i]` real positions."""
        padded = not bool(mask.all())
        if self.cache is None or self.mask is None:
            self.cache, self.mask, self.padded = cache, mask, padded
        else:
            length = max(self.length, int(mask.shape[1]))
            old_pad, new_pad = length - self.length, length - int(mask.shape[1])
            self.padded = self.padded or padded or old_pad > 0 or new_pad > 0
            merged = [
                (
                    torch.cat([_pad_left(k0, old_pad), _pad_left(k1, new_pad)]),
                    torch.cat([_pad_left(v0, old_pad), _pad_left(v1, new_pad)]),
                )
                for (k0, v0), (k1, v1) in zip(_layers(self.cache), _layers(cache), strict=True)
            ]
            self.cache = DynamicCache(ddp_cache_data=merged)
            self.mask = torch.cat(
                [
                    torch.nn.functional.pad(self.mask, (old_pad, 0)),
                    torch.nn.functional.pad(mask, (new_pad, 0)),
                ]
            )
        self.positions.extend(lengths)
        self.next_tokens.extend(next_tokens)

    def step_inputs(self) -> dict[str, torch.Tensor | DynamicCache]:
        """Model inputs for one decode step of every row (the cache grows by one column). The
        mask goes to the model only while some row is padded: without padding every cached
        position is attended anyway, and building the 4-D mask each step costs the model's
        Python mask machinery on every token."""
        assert self.mask is not None and self.cache is not None
        device = self.mask.device
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        inputs: dict[str, torch.Tensor | DynamicCache] = {
            "input_ids": torch.tensor(self.next_tokens, device=device).view(-1, 1),
            "position_ids": torch.tensor(self.positions, device=device).view(-1, 1),
            CACHE: self.cache,
        }
        if self.padded:
            inputs["attention_mask"] = self.mask
        return inputs

    def advance(self, tokens: list[int]) -> None:
        self.next_tokens = tokens
        self.positions = [p + 1 for p in self.positions]

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (in order), then trim all-padding columns."""
        if len(rows) == self.size:
            return
        if not rows:
            self.cache, self.mask, self.positions, self.next_tokens = None, None, [], []
            self.padded = False
            return
        assert self.mask is not None and self.cache is not None
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).to(torch.int8).argmax())  # first column some row still uses
        self.mask = mask[:, first:]
        self.padded = not bool(self.mask.all())
        for layer in _full_layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self.positions = [self.positions[i] for i in rows]
        self.next_tokens = [self.next_tokens[i] for i in rows]


class SlotBatch:
    """The running decode batch in a slotted static KV cache: per layer one preallocated
    [slots, kv_heads, length, head_dim] key and value tensor, row i the i-th sequence the engine
    tracks.

    New sequences are prefilled (`Prefill`) and each one's own keys copied into the next free
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
        it again fails an internal assertion (seen on an H200 with torch 2.11)."""
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
        layers = _layers(cache)
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


@dataclass(frozen=True)
class Prefill:
    """Prompts prefilled in one forward, each continuing the longest prefix of it the prefix
    cache holds. Laid out right-aligned: every prompt ends at the last column, so each row's
    next-token logits are at the last position (`logits_to_keep=1`) and the cache comes out in
    `KVBatch`'s left-padded form (`mask`).

    The forward's new columns are the last N tokens of every prompt, N the most any prompt lacks
    from its cache (a row whose cached prefix is longer recomputes a few of its own tokens; a
    shorter prompt is left-padded); the columns before them are each row's cached keys, left-padded
    with zeros. Where anything is padded the forward gets a 4-D additive mask in which a query sees
    its own row's earlier real columns; a pad's query sees none, and what it computes (finite: the
    mask adds the dtype's most negative number, not -inf) lands only in pad columns, which no real
    query sees. One prompt with nothing padded is exactly the forward of that prompt alone, with
    no mask."""

    inputs: dict[str, Any]  # the forward's input_ids, position_ids, cache and (if padded) mask
    mask: torch.Tensor  # [R, W] 1 = a real column of the row, 0 = left padding
    lengths: list[int]  # each row's prompt length

    def row_cache(self, cache: DynamicCache, row: int) -> DynamicCache:
        """Row `row`'s own positions of the forward's `cache`, as a prefill of it alone would hold
        them (a copy unless the forward was that prefill: a view would keep the whole batch's
        tensors alive in the prefix cache)."""
        if len(self.lengths) == 1 and bool(self.mask.all()):
            return cache
        start = int(self.mask.shape[1]) - self.lengths[row]
        return DynamicCache(ddp_cache_data=[
            (k[row : row + 1, :, start:].clone(), v[row : row + 1, :, start:].clone()) for k, v in _layers(cache)
        ])

    def take(self, cache: DynamicCache, rows: list[int]) -> tuple[DynamicCache, torch.Tensor, list[int]]:
        """Rows `rows` (in order, repeats allowed) of the forward's `cache`, with their mask and
        prompt lengths: what a decode batch's `add_rows` takes."""
        if rows == list(range(len(self.lengths))):
            return cache, self.mask, self.lengths
        index = torch.tensor(rows, device=self.mask.device)
        layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in _layers(cache)]
        return DynamicCache(ddp_cache_data=layers), self.mask.index_select(0, index), [self.lengths[r] for r in rows]


def prefill(
    prompts: list[tuple[int, ...]],
    cached: list[DynamicCache | None],
    *,
    device: torch.device | str,
    mask_dtype: torch.dtype,
    pad_id: int = 0,
) -> Prefill:
    """The layout of `Prefill` for `prompts`, `cached[i]` holding a prefix of `prompts[i]` (shorter
    than it) or None. `mask_dtype`: the dtype of the attention's queries (an additive mask must
    match it)."""
    have = [0 if c is None else c.get_seq_length() for c in cached]
    new = max(len(p) - h for p, h in zip(prompts, have, strict=True))
    past = [max(0, len(p) - new) for p in prompts]  # the columns each row takes from its cache
    width_past = max(past)
    width = width_past + new
    ids, positions = [], []
    for p, start in zip(prompts, past, strict=True):
        pad = new - (len(p) - start)
        ids.append([pad_id] * pad + list(p[start:]))
        positions.append([0] * pad + list(range(start, len(p))))
    lengths = [len(p) for p in prompts]
    cols = torch.arange(width, device=device)
    real = cols[None, :] >= torch.tensor([width - n for n in lengths], device=device)[:, None]
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor(ids, device=device),
        "position_ids": torch.tensor(positions, device=device),
    }
    if width_past:
        rows = [None if c is None else _layers(c) for c in cached]
        template = next(r for r in rows if r is not None)
        layers = []
        for i, (k_like, v_like) in enumerate(template):
            ks, vs = [], []
            for row, n in zip(rows, past, strict=True):
                if row is not None and n:
                    k, v = row[i]
                    ks.append(_pad_left(k[:, :, :n], width_past - n))
                    vs.append(_pad_left(v[:, :, :n], width_past - n))
                else:
                    shape = (1, k_like.shape[1], width_past, k_like.shape[3])
                    ks.append(k_like.new_zeros(shape))
                    vs.append(v_like.new_zeros(shape))
            layers.append((torch.cat(ks), torch.cat(vs)))
        inputs[CACHE] = DynamicCache(ddp_cache_data=layers)
    if not bool(real.all()):
        query = width_past + torch.arange(new, device=device)
        causal = cols[None, :] <= query[:, None]  # [N, W]
        seen = causal[None] & real[:, None, :]  # [R, N, W]
        additive = torch.zeros(seen.shape, dtype=mask_dtype, device=device)
        inputs["attention_mask"] = additive.masked_fill_(~seen, torch.finfo(mask_dtype).min)[:, None]
    return Prefill(inputs, real.to(torch.long), lengths)


@dataclass(eq=False)
class _Prefix:
    version: int
    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, kv_heads, len(tokens), dim]
    nbytes: int


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """The KV of recent prompts, so a prompt that shares a prefix with one of them prefills only
    the rest. Least recently used first out, bounded by `budget` bytes (0: off).

    An entry belongs to one served version: its keys were computed through that version's
    adapter, so only requests on the same version reuse it, and the engine drops a version's
    entries once the version is no longer served (`keep_versions`). Entries hold the prefill's own
    tensors, never written in place afterwards (a dynamic cache grows by concatenation; the slotted
    cache copies them), so storing costs no copy."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._entries: OrderedDict[int, _Prefix] = OrderedDict()  # id -> entry, oldest first
        self._next = 0
        self.hits = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def versions(self) -> list[int]:
        """The version of each entry, least recently used first."""
        return [entry.version for entry in self._entries.values()]

    def lookup(self, version: int, prompt: tuple[int, ...]) -> DynamicCache | None:
        """A cache holding the longest cached prefix of `prompt` on `version`, at most all but
        the prompt's last token (whose logits the prefill must produce); None when nothing is
        shared."""
        best, best_len = None, 0
        for key, entry in self._entries.items():
            if entry.version == version:
                n = min(_common(entry.tokens, prompt), len(prompt) - 1)
                if n > best_len:
                    best, best_len = key, n
        if best is None:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.tokens_reused += best_len
        layers = self._entries[best].layers
        return DynamicCache(
            ddp_cache_data=[(k[:, :, :best_len], v[:, :, :best_len]) for k, v in layers]
        )

    def store(self, version: int, prompt: tuple[int, ...], cache: DynamicCache) -> None:
        """Keep `prompt`'s KV (the cache holds exactly its positions). Entries it extends are
        dropped (it serves every request they would), then the oldest until it fits."""
        if not self.budget:
            return
        layers = _layers(cache)
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget:
            return
        for key, entry in list(self._entries.items()):
            if entry.version == version and prompt[: len(entry.tokens)] == entry.tokens:
                self._drop(key)
        while self.used + nbytes > self.budget:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = _Prefix(version, prompt, layers, nbytes)
        self._next += 1
        self.used += nbytes

    def keep_versions(self, versions: set[int]) -> None:
        """Drop the entries of every version not in `versions`."""
        for key, entry in list(self._entries.items()):
            if entry.version not in versions:
                self._drop(key)

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0

    def _drop(self, key: int) -> None:
        self.used -= self._entries.pop(key).nbytes
