"""Prompts admitted together, laid out for one prefill forward (`prefill` -> `Prefill`), each
continuing the prefix of it the prefix cache holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from clawbridge.local_gpu.kvcache import CACHE, layers_of, pad_left
from transformers import DynamicCache


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
            (k[row : row + 1, :, start:].clone(), v[row : row + 1, :, start:].clone()) for k, v in layers_of(cache)
        ])

    def take(self, cache: DynamicCache, rows: list[int]) -> tuple[DynamicCache, torch.Tensor, list[int]]:
        """Rows `rows` (in order, repeats allowed) of the forward's `cache`, with their mask and
        prompt lengths: what a decode batch's `add_rows` takes."""
        if rows == list(range(len(self.lengths))):
            return cache, self.mask, self.lengths
        index = torch.tensor(rows, device=self.mask.device)
        layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in layers_of(cache)]
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
        rows = [None if c is None else layers_of(c) for c in cached]
        template = next(r for r in rows if r is not None)
        layers = []
        for i, (k_like, v_like) in enumerate(template):
            ks, vs = [], []
            for row, n in zip(rows, past, strict=True):
                if row is not None and n:
                    k, v = row[i]
                    ks.append(pad_left(k[:, :, :n], width_past - n))
                    vs.append(pad_left(v[:, :, :n], width_past - n))
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
