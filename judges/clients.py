"""Judge clients: where judge completions come from. One small protocol, two implementations:

- `OpenAIJudgeClient`: any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, a cloud
  API), over httpx with retries on what is worth retrying (429, 5xx, timeouts, dropped
  connections) with exponential backoff, and none on other 4xx (a wrong key or model name does
  not fix itself).
- `BackendJudgeClient`: a model on the active backend, by default its frozen base (version 0),
  so the judge does not drift with the policy it judges.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import httpx
from clawbridge.backends.redact import Redactor
from clawbridge.chat.renderer import Renderer
from clawbridge.judges.types import Message
from clawbridge.protocol import Backend
from clawbridge.types import SamplingParams
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

log = logging.getLogger(__name__)


class JudgeError(Exception):
    """The judge endpoint refused the request (not worth retrying) or answered nonsense."""


class TransientJudgeError(JudgeError):
    """Worth retrying: rate limit, server error, timeout, dropped connection."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@runtime_checkable
class JudgeClient(Protocol):
    name: str  # recorded in every judgment ("http:<model>", "backend:<model>")

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        temperature: float,
        max_tokens: int,
        seed: int | None = None,
    ) -> str: ...


class OpenAIJudgeClient:
    """An OpenAI-compatible chat endpoint. `base_url` includes the version prefix
    (`http://host:8000/v1`, `https://api.openai.com/v1`)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        attempts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        client: httpx.AsyncClient | None = None,
        redactor: Redactor | None = None,
    ) -> None:
        self.name = f"http:{model}"
        self.redactor = redactor  # the same redaction as the cloud backends get, when asked for
        self.model = model
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), headers=headers)
        self._owns_client = client is None

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        temperature: float,
        max_tokens: int,
        seed: int | None = None,
    ) -> str:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.redactor.messages(messages) if self.redactor else [dict(m) for m in messages],
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        if seed is not None:
            body["seed"] = seed
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientJudgeError),
            stop=stop_after_attempt(self.attempts),
            wait=self._wait,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._post(body)
        raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover

    def _wait(self, state: RetryCallState) -> float:
        """Exponential backoff, but at least the server's Retry-After (capped)."""
        backoff = wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s)(state)
        error = state.outcome.exception() if state.outcome else None
        after = getattr(error, "retry_after", None)
        return max(backoff, min(after, self.max_backoff_s)) if after is not None else backoff

    async def _post(self, body: dict[str, Any]) -> str:
        try:
            response = await self._client.post(self.url, json=body)
        except (httpx.TimeoutException, httpx.TransportError) as e:
            log.warning("judge %s: %s, retrying", self.url, type(e).__name__)
            raise TransientJudgeError(f"{type(e).__name__} talking to {self.url}") from e
        status = response.status_code
        if status == 429 or status >= 500:
            log.warning("judge %s answered %d, retrying", self.url, status)
            raise TransientJudgeError(
                f"{self.url} answered {status}: {response.text[:200]}",
                retry_after=_retry_after(response),
            )
        if status >= 400:
            raise JudgeError(f"{self.url} answered {status}: {response.text[:500]}")
        try:
            message = response.json()["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeError(f"{self.url} answered without choices[0].message: {response.text[:200]}") from e
        # reasoning servers may put everything in reasoning_content and leave content empty
        return str(message.get("content") or message.get("reasoning_content") or "")

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


class BackendJudgeClient:
    """Samples the judge's answer from a model on the active backend.

    `version=0` is the frozen base model (Backend protocol); None is the newest policy. Prompts
    and answers go through the renderer of served traffic (the server's own, shared with its
    caches); a thinking model's answer is its content, or its reasoning if that is all."""

    def __init__(self, backend: Backend, renderer: Renderer, *, version: int | None = 0) -> None:
        self.backend = backend
        self.version = version
        self.renderer = renderer
        self.name = f"backend:{backend.model_name}@v{version if version is not None else 'latest'}"

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        temperature: float,
        max_tokens: int,
        seed: int | None = None,
    ) -> str:
        prompt = self.renderer.render(messages)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=self.renderer.stop_token_ids,
        )
        [completion] = await self.backend.sample(prompt, params, n=1, version=self.version, priority="background")
        answer = self.renderer.parse(completion.tokens, completion.finish_reason)
        return answer.content or answer.reasoning_content or ""
