"""Random models of real architectures for GPU benchmarks (speed does not depend on weights),
the device's peak bf16 FLOP/s for MFU, and a JSON result writer."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

# dense bf16 tensor-core peaks (no sparsity), FLOP/s
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
# memory bandwidth, bytes/s (the decode limit: every token reads every weight once); the first
# name contained in the device's name wins
HBM = {
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H100": 3.35e12,
    "H200": 4.8e12,
    "A100": 2.0e12,
    "L40S": 0.864e12,
    "A10G": 0.6e12,
}

ARCHS: dict[str, dict[str, Any]] = {
    # Qwen3-4B's published config (hidden 2560, 36 layers, GQA 32/8, vocab 151936, tied)
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # plumbing only: runs the bench scripts end to end on a CPU box
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}


def config_dir(arch: str, root: Path) -> Path:
    """A folder with config.json for `arch` (for `random:DIR` in the FSDP worker)."""
    from transformers import AutoConfig

    folder = root / f"{arch}-config"
    folder.mkdir(parents=True, exist_ok=True)
    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.save_pretrained(str(folder))
    return folder


def model_dir(arch: str, root: Path, tokenizer_dir: Path | None, dtype: str = "bfloat16") -> Path:
    """A loadable HF folder: random weights of `arch` plus a tokenizer (the engine needs one)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / f"{arch}-random"
    if (folder / "config.json").exists():
        return folder
    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(folder))
    del model
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, folder / f.name)
    return folder


def n_params(arch: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def device_name() -> str:
    import torch

    return (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or 'unknown'}, {os.cpu_count()} cores)"
    )


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def hbm_bandwidth(name: str) -> float | None:
    return next((v for k, v in HBM.items() if k in name), None)


def write_result(name: str, result: dict[str, Any]) -> None:
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": name,
        "device": device_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **result,
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
