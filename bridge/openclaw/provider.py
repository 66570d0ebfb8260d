"""OpenClaw integration: make clawbridge an OpenClaw model provider and install our plug-in.

    clawbridge openclaw config             # print the provider entry
    clawbridge openclaw install            # merge it into openclaw.json (backed up), install the plug-in

OpenClaw reads `$OPENCLAW_HOME/.openclaw/openclaw.json` (OPENCLAW_HOME defaults to the home
directory). The plug-in (package data under `plugin/`) tags every request to the
clawbridge provider with `X-Session-Id` and `X-Turn-Type` and marks sessions done; it is copied to
`.openclaw/extensions/clawbridge` and loaded through `plugins.load.paths`.

`install` is idempotent: a second run with the same arguments changes nothing and makes no
backup; any run that changes the file first copies the old one to `openclaw.json.bak-<UTC time>`.
The merge touches only what clawbridge owns (`models.providers.clawbridge`, the plug-in's load path
and entry, and, unless asked not to, the default model), sets `gateway.mode` to `local` where no
mode is set (the Gateway refuses to start without one) and, with the default model, an agent run
timeout where none is set (OpenClaw's 600 s cut CPU turns); everything else is kept as it was.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

PROVIDER_ID = "clawbridge"
PLUGIN_ID = "clawbridge"
PLUGIN_FILES = ("package.json", "openclaw.plugin.json", "index.js")
KEY_ENV = "CLAWBRIDGE_API_KEY"


class OpenClawConfigError(Exception):
    """The existing openclaw.json cannot be merged safely (left untouched)."""


@dataclass(frozen=True)
class InstallResult:
    config_path: Path
    plugin_dir: Path
    changed: bool  # the config file was written
    backup: Path | None  # where the previous config went (None: nothing to back up or no change)
    plugin_changed: bool  # the plug-in files were (re)written


def state_dir(openclaw_home: Path) -> Path:
    return openclaw_home / ".openclaw"


def config_path(openclaw_home: Path) -> Path:
    return state_dir(openclaw_home) / "openclaw.json"


# OpenClaw gives a local model server 5 minutes to start answering (120 s idle for others);
# prefilling its ~13 K-token prompt on a busy 2-core CPU took longer than that. The provider's
# own timeout replaces those limits for its requests.
REQUEST_TIMEOUT_S = 1800
# A whole agent run (every model request of a turn: a tool call and the answer after its result
# are two) is cut at `agents.defaults.timeoutSeconds`, 600 s unless set, heartbeats too; one
# CPU request took 515-570 s on 2 busy cores. The provider timeout cannot extend a run.
RUN_TIMEOUT_S = 3600


def provider_entry(
    base_url: str,
    model: str,
    *,
    context_window: int = 32768,
    max_tokens: int = 512,
    keyed: bool = False,
) -> dict[str, Any]:
    """The `models.providers.clawbridge` entry. A keyed server's key is referenced, never
    written: OpenClaw substitutes `${CLAWBRIDGE_API_KEY}` from its environment."""
    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    return {
        "baseUrl": f"{root}/v1",
        "apiKey": f"${{{KEY_ENV}}}" if keyed else "clawbridge",
        "api": "openai-completions",
        "timeoutSeconds": REQUEST_TIMEOUT_S,
        "models": [
            {
                "id": model,
                "name": f"{model} (clawbridge)",
                "reasoning": False,
                "input": ["text"],
                "contextWindow": context_window,
                "maxTokens": max_tokens,
            }
        ],
    }


def fragment(
    provider: dict[str, Any], plugin_dir: Path | None, *, set_default: bool = True
) -> dict[str, Any]:
    """What clawbridge adds to openclaw.json (`clawbridge openclaw config` prints it)."""
    out: dict[str, Any] = {"models": {"providers": {PROVIDER_ID: provider}}}
    if set_default:
        model = provider["models"][0]["id"]
        out["agents"] = {"defaults": {"model": {"primary": f"{PROVIDER_ID}/{model}"}}}
    if plugin_dir is not None:
        out["plugins"] = {
            "load": {"paths": [str(plugin_dir)]},
            "entries": {PLUGIN_ID: {"enabled": True, "hooks": {"allowConversationAccess": True}}},
        }
    return out


def merge(config: dict[str, Any], frag: dict[str, Any]) -> dict[str, Any]:
    """A new config: `frag` merged into `config`. Objects merge key by key; the provider entry is
    replaced whole (it is ours); lists gain the missing items in order (load paths). Pure and
    idempotent: merge(merge(c, f), f) == merge(c, f)."""
    out = copy.deepcopy(config)
    _merge_into(out, frag, ())
    return out


def _merge_into(dst: dict[str, Any], src: dict[str, Any], path: tuple[str, ...]) -> None:
    for key, value in src.items():
        here = (*path, key)
        current = dst.get(key)
        if here == ("models", "providers", PROVIDER_ID):
            dst[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(current, dict):
            _merge_into(current, value, here)
        elif isinstance(value, list) and isinstance(current, list):
            current.extend(copy.deepcopy(v) for v in value if v not in current)
        elif current is not None and isinstance(value, dict) != isinstance(current, dict):
            raise OpenClawConfigError(
                f"openclaw.json has `{'.'.join(here)}` as {type(current).__name__}, expected "
                f"{type(value).__name__}; fix it by hand, then run install again"
            )
        else:
            dst[key] = copy.deepcopy(value)


def with_gateway_mode(config: dict[str, Any]) -> dict[str, Any]:
    """`gateway.mode: local` when the config names no mode: `openclaw gateway run` refuses to
    start without one ("missing gateway.mode"), and a home written by install alone has none.
    A config with no gateway at all also gets `bind: loopback`, as clawbridge binds: in a
    container OpenClaw otherwise binds 0.0.0.0 and refuses to start without auth. A mode or bind
    the user chose is kept."""
    gateway = config.get("gateway")
    if gateway is None:
        return {**config, "gateway": {"mode": "local", "bind": "loopback"}}
    if isinstance(gateway, dict) and "mode" not in gateway:
        return {**config, "gateway": {**gateway, "mode": "local"}}
    return config


def with_run_timeout(config: dict[str, Any]) -> dict[str, Any]:
    """`agents.defaults.timeoutSeconds: RUN_TIMEOUT_S` when the config sets none (OpenClaw's 600 s
    cut CPU turns short); a timeout the user chose is kept."""
    defaults = config.get("agents", {}).get("defaults")
    if not isinstance(defaults, dict) or "timeoutSeconds" in defaults:
        return config
    return {
        **config,
        "agents": {**config["agents"], "defaults": {**defaults, "timeoutSeconds": RUN_TIMEOUT_S}},
    }


def read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    text = path.read_text()
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # OpenClaw also accepts JSON5 (comments, trailing commas); rewriting it would drop them.
        raise OpenClawConfigError(
            f"{path} is not plain JSON ({e.msg} at line {e.lineno}); add this by hand instead "
            "(clawbridge openclaw config prints it)"
        ) from None
    if not isinstance(data, dict):
        raise OpenClawConfigError(f"{path} does not hold a JSON object")
    return data


def dumps(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"


def plugin_source() -> Path:
    """The plug-in shipped as package data."""
    return Path(str(resources.files("clawbridge.openclaw") / "plugin"))


def install_plugin(dest: Path) -> bool:
    """Copy the plug-in files to `dest`; True when anything changed."""
    src = plugin_source()
    dest.mkdir(parents=True, exist_ok=True)
    changed = False
    for name in PLUGIN_FILES:
        data = (src / name).read_bytes()
        target = dest / name
        if not target.exists() or _digest(target.read_bytes()) != _digest(data):
            _atomic_write(target, data)
            changed = True
    return changed


def install(
    openclaw_home: Path,
    provider: dict[str, Any],
    *,
    set_default: bool = True,
    with_plugin: bool = True,
    now: datetime | None = None,
) -> InstallResult:
    """Merge clawbridge into `openclaw_home`'s openclaw.json and install the plug-in."""
    path = config_path(openclaw_home)
    plugin_dir = state_dir(openclaw_home) / "extensions" / PLUGIN_ID
    old_text = path.read_text() if path.exists() else None
    config = read_config(path)  # refuses before anything is written
    plugin_changed = install_plugin(plugin_dir) if with_plugin else False
    merged = merge(
        config, fragment(provider, plugin_dir if with_plugin else None, set_default=set_default)
    )
    if set_default:  # clawbridge answers this agent's runs: give them time to finish on a CPU
        merged = with_run_timeout(merged)
    new_text = dumps(with_gateway_mode(merged))
    if old_text is not None and new_text == old_text:
        return InstallResult(path, plugin_dir, False, None, plugin_changed)
    backup = None
    if old_text is not None and old_text.strip():
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
        backup = path.with_name(f"{path.name}.bak-{stamp}")
        n = 1
        while backup.exists():  # two changing runs within a second keep both old files
            backup, n = path.with_name(f"{path.name}.bak-{stamp}-{n}"), n + 1
        shutil.copy2(path, backup)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, new_text.encode(), mode=path.stat().st_mode if path.exists() else 0o600)
    return InstallResult(path, plugin_dir, True, backup, plugin_changed)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.chmod(tmp, mode & 0o777)
    os.replace(tmp, path)
