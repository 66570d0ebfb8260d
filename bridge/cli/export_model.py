"""`clawbridge export-model`: a policy version as a model that runs without clawbridge.

Local versions (the CPU engine, the GPU stack, a PEFT folder given with `--adapter`) are merged
and written by `clawbridge.local_gpu.export`. Cloud versions live on the platform: Tinker's are
downloaded with Tinker's own `checkpoint download`; Modal's sit on a Modal Volume (the commands
are printed); Fireworks' cannot be downloaded by clawbridge (docs/export.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

if TYPE_CHECKING:
    from clawbridge.config import Settings

FORMATS = ("hf", "gguf", "both")


class CannotExport(Exception):
    """The version's weights are not on this machine, or not downloadable; `code` is the exit
    status (2: the request was wrong, 1: the platform does not allow it)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Where:
    """Where version K's weights are: `local` (a PEFT folder or, for v0, none), or a platform."""

    version: int
    kind: str  # local | tinker | fireworks | modal
    path: str | None


def parse_version(text: str) -> int:
    value = text.strip().lower().removeprefix("v")
    if not value.isdigit():
        raise CannotExport(f"--version must be a number like 3 or v3, not {text!r}")
    return int(value)


def locate(data_dir: Path, rows: dict[int, str | None], version: int | None) -> Where:
    """Find version K (default: the newest published) from the store's policy versions and the
    data directory. `rows` maps each recorded version to its recorded weights path."""
    newest = max([0, *rows])
    local = data_dir / "adapters"
    if local.is_dir():
        newest = max([newest, *(int(p.name[1:]) for p in local.glob("v*") if p.name[1:].isdigit())])
    k = newest if version is None else version
    if k == 0:
        return Where(0, "local", None)
    folder = local / f"v{k}"
    if (folder / "adapter_config.json").exists():
        return Where(k, "local", str(folder))
    recorded = rows.get(k)
    tinker_state = _state_path(data_dir / "tinker_states.json", k)
    if tinker_state or (recorded or "").startswith("tinker://"):
        return Where(k, "tinker", tinker_state or recorded)
    fireworks_state = _state_path(data_dir / "fireworks_states.json", k)
    if fireworks_state:
        return Where(k, "fireworks", fireworks_state)
    if recorded and recorded.startswith("/state/"):
        return Where(k, "modal", recorded)
    if k > newest:
        raise CannotExport(f"unknown version v{k}: the newest in {data_dir} is v{newest} (see `clawbridge versions`)")
    raise CannotExport(
        f"policy@v{k}'s weights are not in {data_dir}: {folder} is missing"
        + (f" (the store recorded {recorded})" if recorded else "")
    )


def _state_path(index: Path, version: int) -> str | None:
    """The training-state path a cloud backend kept for version K (its `policy-vK` entry)."""
    if not index.exists():
        return None
    from clawbridge.backends.tinker import version_state  # Fireworks' index uses the same names

    entry = json.loads(index.read_text()).get(version_state(version))
    return None if entry is None else str(entry["path"])


# --- cloud versions ------------------------------------------------------------------------------


def tinker_download_command(path: str, out: Path) -> list[str]:
    """Tinker's own CLI (tinker 0.38): a training checkpoint (`tinker://run/weights/name`) is
    exported by the service as external weights, a PEFT LoRA adapter, and downloaded; sampler
    checkpoints (`.../sampler_weights/...`) cannot be downloaded."""
    return [sys.executable, "-m", "tinker.cli", "checkpoint", "download", path, "--output", str(out)]


def export_cloud(where: Where, out: Path, settings: Settings, run: Any = subprocess.run) -> None:
    echo = _progress
    if where.kind == "tinker":
        path = where.path or ""
        if "/weights/" not in path:
            raise CannotExport(
                f"policy@v{where.version} on Tinker has only sampler weights ({path}), which Tinker "
                "does not let anyone download; versions published since clawbridge keeps a "
                "training state per version (tinker_states.json) can be downloaded", code=1)
        from clawbridge.backends.tinker import require_credentials

        try:
            require_credentials("tinker")
        except Exception as e:
            raise CannotExport(f"downloading from Tinker needs its key: {e}", code=1) from None
        cmd = tinker_download_command(path, out)
        echo(f"downloading policy@v{where.version} from Tinker: {' '.join(cmd[2:])}")
        echo("(Tinker starts a session on the base model to export the LoRA; this takes minutes)")
        done = run(cmd, check=False)
        if done.returncode != 0:
            raise CannotExport(f"tinker checkpoint download failed (exit {done.returncode})", code=1)
        echo(f"the LoRA adapter is in {out}/<run>_weights_policy-v{where.version}/. To merge it "
             f"into a model you can run elsewhere: clawbridge export-model --adapter THAT_FOLDER "
             f"--model A_LOCAL_HF_COPY_OF_{settings.cloud.tinker_base_model.replace('/', '_')}")
        return
    if where.kind == "modal":
        from clawbridge.backends.modal_app import STATE_DIR, VOLUME_NAME

        remote = str(Path(where.path or "").relative_to(STATE_DIR))
        raise CannotExport(
            f"policy@v{where.version} lives on the Modal Volume {VOLUME_NAME!r}. Download it, then "
            f"export the folder:\n  modal volume get {VOLUME_NAME} {remote} {out}\n"
            f"  clawbridge export-model --adapter {out}/v{where.version} --model {settings.model}", code=1)
    raise CannotExport(
        f"policy@v{where.version} is a Fireworks checkpoint ({where.path}). clawbridge cannot "
        "download Fireworks weights: its training SDK's snapshots are served, not handed out, and "
        "Fireworks' model download endpoint applies to models in its registry, which clawbridge "
        "does not create (not verified here). See docs/export.md.", code=1)


# --- the command -------------------------------------------------------------------------------


def _progress(message: str) -> None:
    typer.echo(f"clawbridge export-model: {message}", err=True)


def run_export_model(
    *, data_dir: str | None, db: str | None, version: str | None, out: str | None, fmt: str,
    model: str | None, gguf_type: str, adapter: str | None, seed: int | None,
) -> None:
    try:
        _export(data_dir=data_dir, db=db, version=version, out=out, fmt=fmt, model=model,
                gguf_type=gguf_type, adapter=adapter, seed=seed)
    except CannotExport as e:
        typer.echo(f"clawbridge export-model: {e}", err=True)
        raise typer.Exit(e.code) from None


def _export(
    *, data_dir: str | None, db: str | None, version: str | None, out: str | None, fmt: str,
    model: str | None, gguf_type: str, adapter: str | None, seed: int | None,
) -> None:
    from clawbridge.config import Settings
    from clawbridge.local_gpu import export

    if fmt not in FORMATS:
        raise CannotExport(f"--format must be one of {list(FORMATS)}, not {fmt!r}")
    if gguf_type not in export.GGUF_TYPES:
        raise CannotExport(f"--gguf-type must be one of {list(export.GGUF_TYPES)}, not {gguf_type!r}")
    settings = Settings.load(data_dir=data_dir, db=db, model=model, seed=seed)
    if adapter is not None:
        if version is not None:
            raise CannotExport("--adapter and --version name two different things: pass one")
        folder = Path(adapter).expanduser()
        where = Where(-1, "local", str(folder))
    else:
        where = locate(settings.data_dir, _recorded_versions(settings),
                       None if version is None else parse_version(version))
    label = folder.name if adapter is not None else f"v{where.version}"
    target = Path(out) if out else Path(f"{Path(settings.model).name}-{label}")
    if where.kind != "local":
        export_cloud(where, target, settings)
        return
    if target.exists():
        raise CannotExport(f"{target} already exists: choose another --out or remove it")
    try:
        _export_local(settings, where, target, fmt, gguf_type, label)
    except export.ExportError as e:
        raise CannotExport(str(e)) from None


def _recorded_versions(settings: Settings) -> dict[int, str | None]:
    from clawbridge.store import Store

    if settings.db is None and not (settings.data_dir / "clawbridge.db").exists():
        if not (settings.data_dir / "adapters").is_dir():
            raise CannotExport(f"no clawbridge data in {settings.data_dir} (pass --data-dir)")
        return {}
    with Store.open(settings.db_url) as store:
        return {r.version: r.path for r in store.versions()}


def _export_local(settings: Settings, where: Where, target: Path, fmt: str, gguf_type: str,
                  label: str) -> None:
    from clawbridge.local_gpu import export, models

    started = time.monotonic()
    adapter = Path(where.path) if where.path else None
    spec = models.resolve(settings.model, settings.cache_dir)
    warning = export.base_mismatch(spec, adapter)
    if warning:
        _progress(f"warning: {warning}")
    what = f"{spec.name} + {adapter}" if adapter else f"{spec.name} (v0: the base model)"
    _progress(f"merging {what}")
    merged = export.merged_model(spec, adapter, seed=settings.seed)
    tokenizer = models.load_tokenizer(spec)
    target.mkdir(parents=True)
    manifest: dict[str, Any] = {"model": spec.name, "version": where.version if where.version >= 0 else None,
                                "adapter": str(adapter) if adapter else None, "files": {}}
    if fmt in ("hf", "both"):
        _progress(f"writing the Hugging Face folder {target / 'hf'}")
        hf = export.save_hf(merged, tokenizer, target / "hf")
        manifest["files"]["hf"] = _done(hf, target)
    if fmt in ("gguf", "both"):
        folder = target / "gguf"
        folder.mkdir()
        name = f"{Path(spec.name).name}-{label}.{gguf_type}.gguf"
        gguf = export.write_gguf(merged, tokenizer, folder / name, dtype=cast(export.GGUFType, gguf_type),
                                 name=f"{spec.name} {label} (clawbridge)", progress=_progress)
        (folder / "Modelfile").write_text(export.modelfile(name, tokenizer))
        manifest["files"]["gguf"] = _done(gguf, target)
    (target / "export.json").write_text(json.dumps(manifest, indent=2) + "\n")
    _progress(f"done in {time.monotonic() - started:.1f} s: {target}")
    typer.echo(str(target))


def _done(result: Any, target: Path) -> dict[str, Any]:
    _progress(f"  {result.path}: {result.bytes / 1e6:.1f} MB in {result.seconds:.1f} s")
    return {"path": str(result.path.relative_to(target)), "bytes": result.bytes,
            "seconds": round(result.seconds, 2)}
