"""The redaction hook: personal data and secrets are masked before conversation text leaves the
machine for a cloud platform (sampling, judging, training).

Redaction works on text, before rendering to tokens: the tokens recorded for training are the
tokens the platform saw, so redacting never breaks the exactness of the record. Defaults mask
emails, phone numbers and API-key-like strings; callers add their own patterns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![\w-])")

# Known key shapes first (exact prefixes), then long mixed tokens that look like secrets.
API_KEY = re.compile(
    r"(?<![\w-])(?:"
    r"sk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}"  # OpenAI / Anthropic
    r"|tml-[A-Za-z0-9_-]{16,}"  # Tinker
    r"|fw_[A-Za-z0-9]{16,}"  # Fireworks
    r"|(?:ak|as)-[A-Za-z0-9]{16,}"  # Modal token id / secret
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|AIza[0-9A-Za-z_-]{35}"  # Google
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"  # JWT
    r")(?![\w-])"
)
BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/-]{16,}=*")
# A long run of letters and digits with both present: most secrets, few words.
GENERIC_SECRET = re.compile(r"(?<![\w/.-])(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9_-]{32,}(?![\w/.-])")
# Hex digests and ids (git SHAs, sha256 digests, UUIDs) are what coding agents pass around: they
# name things, they grant nothing: a git SHA (40 hex), a sha256 or sha512 digest (64, 128 hex) or
# a UUID is never taken for a secret (other long hex runs still are).
HEX_ID = re.compile(r"[0-9a-fA-F]{40}|[0-9a-fA-F]{64}|[0-9a-fA-F]{128}"
                    r"|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _generic_secret(match: re.Match[str]) -> str:
    text = match.group(0)
    return text if HEX_ID.fullmatch(text) else "[SECRET]"
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{1,4}\)[\s.-]?)?\d{2,4}(?:[\s.-]\d{2,4}){1,4}(?![\w-])"
    r"|(?<![\w+])\+\d{7,15}(?!\w)"
)
MIN_PHONE_DIGITS = 7


def _phone(match: re.Match[str]) -> str:
    text = match.group(0)
    digits = sum(c.isdigit() for c in text)
    # Dates (2026-11-22), times and versions are short digit groups: leave them alone.
    if digits < MIN_PHONE_DIGITS or re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        return text
    return "[PHONE]"


@dataclass(frozen=True)
class Redactor:
    """Applies its rules in order; each rule is a pattern and its replacement."""

    rules: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = field(
        default_factory=lambda: DEFAULT_RULES
    )

    def text(self, text: str) -> str:
        for pattern, repl in self.rules:
            text = pattern.sub(repl, text)
        return text

    def with_patterns(self, patterns: Mapping[str, str]) -> Redactor:
        """A redactor with extra rules: {regex: replacement}."""
        extra = tuple((re.compile(p), r) for p, r in patterns.items())
        return Redactor(self.rules + extra)

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """OpenAI chat messages with every text field redacted (content strings, text parts,
        tool-call arguments); the structure and every other key are kept."""
        return [self._message(m) for m in messages]

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(message)
        content = out.get("content")
        if isinstance(content, str):
            out["content"] = self.text(content)
        elif isinstance(content, list):
            out["content"] = [self._part(p) for p in content]
        for key in ("reasoning_content", "reasoning"):
            if isinstance(out.get(key), str):
                out[key] = self.text(out[key])
        if isinstance(out.get("tool_calls"), list):
            out["tool_calls"] = [self._tool_call(c) for c in out["tool_calls"]]
        return out

    def _part(self, part: Any) -> Any:
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            return {**part, "text": self.text(part["text"])}
        return part

    def _tool_call(self, call: Any) -> Any:
        if not isinstance(call, Mapping):
            return call
        fn = call.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            return {**call, "function": {**fn, "arguments": self.text(fn["arguments"])}}
        return call


DEFAULT_RULES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    (EMAIL, "[EMAIL]"),
    (API_KEY, "[SECRET]"),
    (BEARER, r"\1[SECRET]"),
    (GENERIC_SECRET, _generic_secret),
    (PHONE, _phone),
)

DEFAULT = Redactor()


def redact(text: str) -> str:
    """Mask emails, phone numbers and key-like strings with the default rules."""
    return DEFAULT.text(text)


def for_backend(backend_name: str, enabled: bool) -> Redactor | None:
    """The redactor to run before data leaves for `backend_name` (None: nothing leaves, or the
    user did not ask for redaction: the `redact` setting is off by default, because redacting a
    sampling prompt changes what the model sees). Local backends keep everything on the machine."""
    if not enabled or backend_name == "local":
        return None
    return DEFAULT


class RedactingBackend:
    """A cloud backend whose prompts are redacted before they leave the machine.

    The same function f(prompt ids) = encode(redact(decode(ids))) is applied to every prompt the
    platform sees: when sampling, scoring (the OPD teacher's hinted prompt too) and training. The
    completion was sampled under f(prompt) and its logprobs were recorded there, so training on
    (f(prompt), completion) keeps the PPO ratio exact. Prompts without anything to redact go out
    token for token unchanged.
    """

    def __init__(self, inner: Any, redactor: Redactor = DEFAULT) -> None:
        self.inner = inner
        self.redactor = redactor
        self.redacted_prompts = 0

    def __getattr__(self, name: str) -> Any:  # name, model_name, meter, ... of the platform
        return getattr(self.inner, name)

    @property
    def version(self) -> int:
        return int(self.inner.version)

    def tokenizer(self) -> Any:
        return self.inner.tokenizer()

    def prompt(self, ids: Sequence[int]) -> tuple[int, ...]:
        tok = self.inner.tokenizer()
        text = tok.decode(list(ids), skip_special_tokens=False)
        clean = self.redactor.text(text)
        if clean == text:
            return tuple(ids)
        self.redacted_prompts += 1
        return tuple(tok.encode(clean, add_special_tokens=False))

    async def start(self) -> None:
        await self.inner.start()

    async def sample(self, prompt_ids: Sequence[int], params: Any, *, n: int = 1, version: int | None = None,
                     priority: Any = "user") -> Any:
        return await self.inner.sample(self.prompt(prompt_ids), params, n=n, version=version, priority=priority)

    def sample_stream(self, prompt_ids: Sequence[int], params: Any, *, version: int | None = None,
                      priority: Any = "user") -> Any:
        return self.inner.sample_stream(self.prompt(prompt_ids), params, version=version, priority=priority)

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], **kw: Any) -> Any:
        return await self.inner.score(self.prompt(prompt_ids), completion_ids, **kw)

    async def train_step(self, batch: Sequence[Any], *args: Any, **kw: Any) -> Any:
        from dataclasses import replace

        return await self.inner.train_step([replace(d, prompt_ids=self.prompt(d.prompt_ids)) for d in batch], *args, **kw)

    async def publish(self) -> Any:
        return await self.inner.publish()

    async def save_state(self, name: str) -> str:
        return str(await self.inner.save_state(name))

    async def load_state(self, name: str) -> None:
        await self.inner.load_state(name)

    async def close(self) -> None:
        await self.inner.close()


def protect(backend: Any, enabled: bool) -> Any:
    """The backend `clawbridge up` serves: cloud backends behind the redaction hook when
    `--redact` is on (the default), everything else as is."""
    redactor = for_backend(getattr(backend, "name", "local"), enabled)
    return backend if redactor is None else RedactingBackend(backend, redactor)
