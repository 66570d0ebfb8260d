"""The model registry: offline materialisation, the cached tokenizer, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clawbridge.local_gpu import models


def test_cached_tokenizer_is_identical_to_the_one_built_from_the_gguf(tmp_path: Path) -> None:
    built = models.tokenizer_from_gguf(models.gguf_path())
    first = models.embedded_tokenizer(tmp_path)  # builds and writes the cache
    second = models.embedded_tokenizer(tmp_path)  # reads the cache
    assert (tmp_path / "tokenizers" / models.EMBEDDED / "tokenizer.json").exists()
    text = 'héllo 😀 世界 <tool_call>{"a": 1}</tool_call><|im_end|>'
    messages = [{"role": "user", "content": text}]
    for tok in (first, second):
        assert tok.encode(text) == built.encode(text)
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
            built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
        assert tok.all_special_ids == built.all_special_ids
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)


def test_tiny_random_is_deterministic_and_has_a_long_context(tiny_spec: models.ModelSpec) -> None:
    a, b = models.load_model(tiny_spec), models.load_model(tiny_spec)
    assert tiny_spec.context_length == 32768
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert models.load_tokenizer(tiny_spec).model_max_length == 32768


def test_the_embedded_model_serves_32k_with_yarn_and_no_attention_temperature() -> None:
    # trained on 8 K; OpenClaw's prompt alone is ~13 K tokens (bench/long_context.py measured it)
    default = models.resolve(models.EMBEDDED)
    assert default.context_length == 32768
    config = models.model_config(default)
    assert config.max_position_embeddings == 32768
    assert config.rope_parameters == {
        "rope_theta": 100000.0,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
        "attention_factor": 1.0,
    }
    assert models.load_tokenizer(default).model_max_length == 32768
    trained = models.resolve(models.EMBEDDED_8K)
    assert (
        trained.context_length == 8192
        and trained.rope_scaling is None
        and trained.path == default.path
    )
    assert models.model_config(trained).rope_parameters.get("rope_type", "default") == "default"
    assert models.resolve("smollm2-135m-instruct-32k") == default  # the earlier name still starts


def test_embedded_model_loads_from_the_cache_and_answers(embedded_spec: models.ModelSpec) -> None:
    # the default: YaRN x4 at 32 K, whose attention temperature (x1.14) cost this answer
    tok = models.load_tokenizer(embedded_spec)
    model = models.load_model(embedded_spec)
    assert model.model.rotary_emb.attention_scaling == 1.0
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0][len(ids) :])


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(models.ModelNotFound, match="smollm2-135m-instruct"):
        models.resolve("no-such-model")


def test_the_package_installs_only_the_clawbridge_namespace(tmp_path: Path) -> None:
    probe = "import importlib.util as u; print(u.find_spec('bridge'), u.find_spec('clawbridge.judges') is not None)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["None", "True"]
