"""The engine's compute dtype: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere.

A CPU with AVX512-BF16 (or AMX) multiplies bf16 matrices faster than fp32 (bench/cpu_dtype.py
measures both; docs/measurements.md has the rates); one without it would emulate bf16 and gain
nothing, so `auto` keeps fp32 there. The choice is a pure function
of the CPU's flags so that both answers are testable on any machine.

On a CPU, bf16 means **bf16 matmuls in an fp32 model** (`bf16_matmuls`): the decoder's linear
layers hold bf16 weights and multiply a bf16 copy of their fp32 input, and everything else (the
residual stream, the norms, attention and its KV cache, the output head, the LoRA adapters and
their optimizer) stays fp32. The matmuls are where the time and the bytes go; the rest is where
the rounding would pile up: a model cast to bf16 whole rounds the residual stream at every layer,
and its scores differed from the sampled logprobs by 0.036 on average (0.33 at most) against 0.014
(0.10) for bf16 matmuls alone, on the embedded model (docs/engine.md). Without a grad the weights
are used pre-packed for oneDNN (bit-equal to the unpacked product, without re-packing the weight
on every call, which made a one-row bf16 product slower than fp32).

On a GPU (a caller that names `dtype=torch.bfloat16`) the model is cast whole (`to_compute_dtype`)
as GPU serving does, all but the output head: the last hidden state is cast up and the logits, from
which every recorded logprob and the loss's log-softmax come, are fp32 products of the fp32 head.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

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


def resolve(setting: EngineDtype, device: str) -> torch.dtype:
    """`choose` on this machine's own CPU flags: what an engine started here computes in."""
    return choose(setting, device, cpu_flags())


def name(dtype: torch.dtype) -> str:
    """What the banner, /v1/models and status show: bf16, fp32 or torch's own name."""
    for key, value in DTYPES.items():
        if value == dtype:
            return key
    return str(dtype).removeprefix("torch.")


def prepare(model: Any, dtype: torch.dtype, device: str) -> None:
    """Put `model` (loaded in fp32) into the engine's arithmetic for `dtype` on `device`: nothing
    for fp32, bf16 matmuls on a CPU, the whole model but its head cast on a GPU."""
    if dtype == torch.float32:
        return
    if str(device).startswith("cpu") and dtype == torch.bfloat16:
        bf16_matmuls(model)
    else:
        to_compute_dtype(model, dtype)


# --- a CPU: bf16 matmuls in an fp32 model -------------------------------------------------------


def _packs() -> bool:
    """This torch build can pre-pack bf16 weights for oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Bf16Linear(torch.nn.Linear):
    """A frozen linear layer with bf16 weights in an fp32 model: its input is rounded to bf16,
    multiplied (fp32 accumulation, as oneDNN does), and the product returned in the input's dtype.
    Without a grad the weight is used as packed for oneDNN once (`packed`): bit-equal to
    `F.linear` on the same bf16 operands, without re-packing the weight on every call."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = x.to(self.weight.dtype)
        if self.packed is not None and not torch.is_grad_enabled():
            y = torch.ops.mkldnn._linear_pointwise(low, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(low, self.weight, self.bias)
        return y.to(x.dtype)


def bf16_matmuls(model: Any) -> int:
    """Every linear layer of `model` but its output head becomes a `Bf16Linear` (bf16 weights,
    packed where oneDNN can); the rest of the model stays as loaded (fp32). Returns how many.
    Run before the LoRA adapters are added: PEFT wraps these layers as it wraps any Linear."""
    head = model.get_output_embeddings()
    packs = _packs()
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module is head:
            continue
        module.weight.data = module.weight.data.to(torch.bfloat16)
        if module.bias is not None:
            module.bias.data = module.bias.data.to(torch.bfloat16)
        module.__class__ = Bf16Linear
        if packs:
            module.packed = pack(module.weight.detach())
        count += 1
    return count


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (bf16) laid out for oneDNN's linear once, as `Bf16Linear.packed` uses it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def round_stochastically(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`x` (fp32) to bf16, each entry rounded up or down with the probabilities that keep its
    expected value: the low 16 bits of its fp32 pattern plus a uniform 16-bit draw carry into the
    kept bits or not. Round-to-nearest would drop every change smaller than half a bf16 step of
    the weight it is added to (for a weight of 0.05, 1.2e-4): most of what a few LoRA steps move."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=gen)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class MergedAdapters:
    """Served adapters folded into the packed bf16 weights of the layers they adapt.

    A forward whose rows all run on one served adapter would otherwise pay, in every adapted
    layer, two small fp32 products and PEFT's bookkeeping beside the packed product, a cost
    docs/engine.md measures. Here that adapter's weights are merged once, `W + scale·B·A` rounded to bf16
    and packed, and the layers' packed weights are swapped for them while the LoRA layers point at
    no adapter. Rows on several adapters (PEFT's mixed batch), the trainable adapter and anything
    with a grad use the base's own packed weights and the adapters beside them, as before. The
    merged weights are rounded stochastically (`round_stochastically`), so none of the adapter's
    small changes is lost to the rounding.

    `layers` are the LoRA layers; `keep` adapters stay merged (each a copy of the adapted
    weights in bf16: ~210 MB for the embedded model), the least recently used dropped first.
    The caller forgets an adapter whose weights change (a slot refilled with a new version)."""

    def __init__(self, layers: list[Any], keep: int = 2) -> None:
        self.layers = layers
        self.bases: list[Bf16Linear] = [layer.get_base_layer() for layer in layers]
        self.base_packed = [b.packed for b in self.bases]
        self.keep = keep
        self.cache: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
        self.in_place: str | None = None  # whose weights the base layers hold (None: the base's own)

    @staticmethod
    def possible(layers: list[Any]) -> bool:
        """Every adapted layer is a packed `Bf16Linear` (a CPU's bf16 matmuls where oneDNN packs)."""
        bases = [layer.get_base_layer() for layer in layers]
        return bool(bases) and all(isinstance(b, Bf16Linear) and b.packed is not None for b in bases)

    def use(self, name: str | None) -> None:
        """Put adapter `name`'s merged weights in the base layers (None: the base's own)."""
        if name == self.in_place:
            return
        weights = self.base_packed if name is None else self._merged(name)
        for base, packed in zip(self.bases, weights, strict=True):
            base.packed = packed
        self.in_place = name

    def forget(self, name: str) -> None:
        """`name`'s weights changed or are gone: drop its merged copy (and take it out of the layers)."""
        if self.in_place == name:
            self.use(None)
        self.cache.pop(name, None)

    def _merged(self, name: str) -> list[torch.Tensor]:
        if name in self.cache:
            self.cache.move_to_end(name)
            return self.cache[name]
        gen = torch.Generator().manual_seed(0)  # a version's merged weights are the same every time
        with torch.no_grad():
            merged = [pack(round_stochastically(base.weight.float() + layer.get_delta_weight(name).float(), gen))
                      for layer, base in zip(self.layers, self.bases, strict=True)]
        self.cache[name] = merged
        while len(self.cache) > self.keep:  # the layers keep their own reference to what is in place
            self.cache.popitem(last=False)
        return merged


# --- a GPU: the whole model in its dtype, the head fp32 -----------------------------------------


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
