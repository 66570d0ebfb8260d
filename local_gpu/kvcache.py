"""The KV cache as transformers holds it (a `DynamicCache`), read one way by the engine's decode
batches, prefills and prefix cache: its name as a forward argument and an output field, and each
layer's key and value tensors."""

from __future__ import annotations

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


def full_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers; every one must hold plain growing key/value tensors."""
    return list(cache.layers)


def layers_of(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), [B, kv_heads, L, head_dim]."""
    return [(layer.keys, layer.values) for layer in full_layers(cache)]


def pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` [B, H, L, D] with `n` zero columns before its first."""
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t
