"""Fixtures of the GPU suite (skipped without CUDA)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from clawbridge.local_gpu import models


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """tiny-random as a folder (fp32 weights + tokenizer), loadable without the GGUF package."""
    folder = tmp_path_factory.mktemp("tiny")
    try:
        tok = models.load_tokenizer(models.resolve(models.TINY))
        tok.save_pretrained(str(folder))
    except models.ModelNotFound:
        src = Path(os.environ.get("CLAWBRIDGE_TOKENIZER_DIR", "build/gpu_assets/tokenizer"))
        for f in src.iterdir():
            shutil.copy(f, folder / f.name)
    models.load_model(models.ModelSpec("tiny", None, 4096), seed=0).save_pretrained(str(folder))
    return str(folder)
