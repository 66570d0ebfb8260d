"""`clawbridge doctor`: is this machine ready for the chosen backend? Checks installed extras and
credentials (present and well formed) and never calls a platform, so it costs nothing and works
offline. Credentials come from each platform's usual environment variables (and Modal's
`~/.modal.toml`); this module and the SDKs are the only readers of them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PINS = {"tinker": "0.38.0", "fireworks-ai": "1.2.28", "modal": "1.6.4"}
EXTRA_OF = {"tinker": "tinker", "fireworks": "fireworks-ai", "modal": "modal"}
MODULE_OF = {"tinker": "tinker", "fireworks-ai": "fireworks.training.sdk", "modal": "modal"}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    needed_by: tuple[str, ...] = ()  # backends that cannot run without it

    def blocks(self, backend: str) -> bool:
        return not self.ok and backend in self.needed_by


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def extra_check(backend: str) -> Check:
    dist = EXTRA_OF[backend]
    have = _installed(dist)
    name = f"{backend} SDK"
    if have is None or importlib.util.find_spec(MODULE_OF[dist].split(".")[0]) is None:
        return Check(name, False, f"not installed: pip install 'clawbridge[{backend}]'", (backend,))
    if have != PINS[dist]:
        return Check(name, True, f"{dist} {have} (tested with {PINS[dist]}; behaviour may differ)", (backend,))
    return Check(name, True, f"{dist} {have}", (backend,))


def _key(value: str | None, pattern: str, what: str, var: str, backend: str, hint: str) -> Check:
    if not value:
        return Check(f"{backend} credentials", False, f"{var} is not set ({hint})", (backend,))
    if value != value.strip():
        return Check(f"{backend} credentials", False, f"{var} has surrounding whitespace", (backend,))
    if not re.fullmatch(pattern, value):
        return Check(f"{backend} credentials", False, f"{var} does not look like {what}", (backend,))
    return Check(f"{backend} credentials", True, f"{var} set ({value[:4]}…{value[-2:]}, {len(value)} chars)", (backend,))


def credential_checks(env: Mapping[str, str], home: Path) -> list[Check]:
    checks = [
        _key(env.get("TINKER_API_KEY"), r"tml-[A-Za-z0-9_\-]{16,}", "a Tinker key (tml-…)",
             "TINKER_API_KEY", "tinker", "create one in the Tinker console"),
        _key(env.get("FIREWORKS_API_KEY"), r"[A-Za-z0-9_\-]{20,}", "a Fireworks API key",
             "FIREWORKS_API_KEY", "fireworks", "a Training-API-enabled key from fireworks.ai"),
    ]
    token_id, secret = env.get("MODAL_TOKEN_ID"), env.get("MODAL_TOKEN_SECRET")
    toml = Path(env.get("MODAL_CONFIG_PATH") or home / ".modal.toml")
    if token_id or secret:
        ok = bool(token_id and secret and token_id.startswith("ak-") and secret.startswith("as-"))
        detail = ("MODAL_TOKEN_ID / MODAL_TOKEN_SECRET set" if ok else
                  "MODAL_TOKEN_ID (ak-…) and MODAL_TOKEN_SECRET (as-…) must both be set")
        checks.append(Check("modal credentials", ok, detail, ("modal",)))
    elif toml.exists() and "token_id" in toml.read_text():
        checks.append(Check("modal credentials", True, f"token in {toml}", ("modal",)))
    else:
        checks.append(Check("modal credentials", False, "no token: run `modal token new`", ("modal",)))
    return checks


def run_checks(env: Mapping[str, str], home: Path, backend: str | None = None) -> list[Check]:
    """Every check for every cloud backend (or only `backend`'s)."""
    backends = [backend] if backend and backend != "local" else list(EXTRA_OF)
    checks = [extra_check(b) for b in backends]
    checks += [c for c in credential_checks(env, home) if any(b in c.needed_by for b in backends)]
    return checks


def ready(checks: list[Check], backend: str) -> bool:
    return not any(c.blocks(backend) for c in checks)


def report(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    return "\n".join(f"{'ok ' if c.ok else 'NO '} {c.name:<{width}}  {c.detail}" for c in checks)
