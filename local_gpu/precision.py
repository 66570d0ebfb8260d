"""The engine's compute dtype: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere.

A CPU with AVX512-BF16 (or AMX) multiplies bf16 matrices at 2.0-2.4x its fp32 rate
(bench/cpu_dtype.py measures both); one without it would emulate bf16 and gain nothing, so
`auto` keeps fp32 there and the engine behaves exactly as before. The choice is a pure function
of the CPU's flags so that both answers are testable on any machine.

What stays fp32 in a bf16 engine, because precision matters more there than speed: the LoRA
adapter being trained and its optimizer state (PEFT keeps a trainable adapter in fp32 on a bf16
base), and the output head (`to_compute_dtype`): the last hidden state is cast up and the logits, from
which every recorded logprob and the loss's log-softmax come, are fp32 products of the fp32 head
weights. bf16 logits would round a logit of 20 to a multiple of 0.125; the fp32 head measured
under 5 % of a decode step against a bf16 one. On a CPU a bf16 model's decode steps attend
through `decode_attention` (torch's CPU SDPA is slow on one bf16 query).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

EngineDtype = Literal["auto", "bf16", "fp32"]
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where the kernel does not list them."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16(flags: frozenset[str]) -> bool:
    """The CPU multiplies bf16 in hardware (not emulated through fp32)."""
    return bool(flags & NATIVE_BF16_FLAGS)


def choose(setting: EngineDtype, device: str, flags: frozenset[str]) -> torch.dtype:
    """The engine's compute dtype for `setting` on `device`. `auto` is bf16 on a CPU with native
    bf16 and fp32 on any other CPU; on a GPU `auto` is fp32, as it always was (a GPU caller
    names its dtype)."""
    if setting != "auto":
        return DTYPES[setting]
    if str(device).startswith("cpu") and native_bf16(flags):
        return torch.bfloat16
    return torch.float32


def name(dtype: torch.dtype) -> str:
    """What the banner, /v1/models and status show: bf16, fp32 or torch's own name."""
    for key, value in DTYPES.items():
        if value == dtype:
            return key
    return str(dtype).removeprefix("torch.")


def to_compute_dtype(model: Any, dtype: torch.dtype) -> None:
    """Cast `model` (loaded in fp32) to `dtype`, all but its output head: the head gets its own
    fp32 copy of the checkpoint's weights (untied from the input embeddings, which go to `dtype`
    with the rest) and its input, the last hidden state, is cast up, so the logits are fp32."""
    if dtype == torch.float32:
        return
    head = model.get_output_embeddings()
    if head is None:
        model.to(dtype)
        return
    weight = head.weight.detach().to(torch.float32, copy=True)
    bias = None if head.bias is None else head.bias.detach().to(torch.float32, copy=True)
    model.config.tie_word_embeddings = False  # nothing may tie them back
    model.to(dtype)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        head.bias = torch.nn.Parameter(bias, requires_grad=False)
    head.register_forward_pre_hook(_cast_up)


def _cast_up(_head: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0].float(), *args[1:])


# --- attention in a decode step ---------------------------------------------------------------

BF16_ATTENTION = "clawbridge_bf16"


def decode_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a bf16 model: a decode step (one query per row) as two batched matmuls with
    the softmax in fp32; anything longer (a prefill, a score, a training step) through SDPA.
    torch's CPU SDPA kernel takes 3.3x longer on one bf16 query than on fp32 (16 rows x 1,000
    keys: 30.5 vs 9.2 ms, 1 thread) and 4.5x longer than these matmuls (6.8 ms); prefill is
    fast in bf16 and stays with it. The query heads that share a key head are the rows of one
    matmul (grouped-query attention without repeating the keys)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * (scaling or dim**-0.5)
    if attention_mask is not None:  # [rows, 1, 1, >= length]: True or 0 where a key is seen
        mask = attention_mask[..., :length]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [rows, kv_heads, group, dim]
    return out.reshape(rows, 1, heads, dim), None


def use_decode_attention(model: Any) -> None:
    """Route `model`'s attention through `decode_attention` (masks built as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(BF16_ATTENTION, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(BF16_ATTENTION, sdpa_mask)
    model.set_attn_implementation(BF16_ATTENTION)
