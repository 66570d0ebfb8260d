"""Shared fixtures. Tests never reach a model hub, and use the tiny random model unless they need
real language behaviour (then the embedded model, materialised once into the user cache)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The gate samples every candidate on probes before it serves: tens of seconds per step on a
# random tiny model, which knows no answers anyway. Tests that train for other reasons run
# without it; the gate's own tests (test_gate_live, test_demo) switch it on explicitly.
os.environ.setdefault("CLAWBRIDGE_GATE", "off")

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from clawbridge.local_gpu import models
from clawbridge.store import Store
from pg import PgCluster, find_pg_bin


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run tests/gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_spec() -> models.ModelSpec:
    return models.resolve(models.TINY)


@pytest.fixture(scope="session")
def embedded_spec() -> models.ModelSpec:
    return models.resolve(models.EMBEDDED)


@pytest.fixture(scope="session")
def tokenizer(tiny_spec: models.ModelSpec):  # the embedded model's tokenizer (shared by tiny)
    return models.load_tokenizer(tiny_spec)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def api_live(tmp_path_factory: pytest.TempPathFactory):
    """One live server (tiny model, a key required) for the three API-surface test files,
    tests/test_api_*.py: starting one costs ~15 s here."""
    from api_backend import KEY, MODEL, RecordingBackend
    from clawbridge.config import Settings
    from clawbridge.server import build_backend
    from live_server import LiveServer

    settings = Settings(model=MODEL, port=0, data_dir=tmp_path_factory.mktemp("api"), train=False,
                        default_max_tokens=16, default_temperature=0.5, api_key=KEY)
    server = LiveServer(settings, RecordingBackend(build_backend(settings))).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """A throwaway PostgreSQL server for the whole run (tests/pg.py), skipped where none can run."""
    bin_dir = find_pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not found; set CLAWBRIDGE_PG_BIN")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg 3 is not installed (pip install 'clawbridge[postgres]')")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: initdb refuses root")
    cluster = PgCluster(bin_dir)
    try:
        cluster.start()
    except subprocess.CalledProcessError as e:
        cluster.stop()
        pytest.skip(f"could not start PostgreSQL: {e.stderr.decode(errors='replace')[-500:]}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store's URL on each backend: SQLite in the test's folder, a schema on the throwaway
    PostgreSQL (tests that need another layout define their own)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'clawbridge.db'}"
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    return cluster.create_schema()


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store.open(db_url)
    try:
        yield s
    finally:
        s.close()
