"""Calling a cloud platform: a timeout on every call, retries with backoff on transient errors
only, and errors mapped onto the Backend protocol's exceptions.

The platforms' SDKs retry some errors themselves (Tinker: 408/409/429/5xx); what they surface
after that still deserves a few patient retries here, because a training loop that lives for
days should survive a flaky hour. Permanent errors (bad request, auth, billing) are never
retried: retrying them only delays the message the user has to read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from clawbridge.protocol import BackendError, TransientBackendError
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_STATUS = frozenset({408, 409, 425, 429})
# Class names (any SDK) that mean "try again": timeouts, dropped connections, server trouble.
TRANSIENT_NAMES = frozenset({
    "TimeoutError", "APITimeoutError", "APIConnectionError", "ConnectionError",
    "RateLimitError", "InternalServerError", "InternalFailure", "FunctionTimeoutError",
    "DeploymentSamplerTimeoutError", "ConnectionResetError", "TransientBackendError",
})


class PermanentBackendError(BackendError):
    """The platform refused the call for a reason retrying cannot fix."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    initial_s: float = 1.0
    max_s: float = 30.0
    timeout_s: float = 600.0  # each attempt


def status_of(exc: BaseException) -> int | None:
    code = getattr(exc, "status_code", None)
    if code is None:  # Fireworks' DeploymentSampler reports the last status it saw
        code = getattr(exc, "final_status", None)
    if code is None:
        code = getattr(getattr(exc, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


def is_transient(exc: BaseException) -> bool:
    status = status_of(exc)
    if status is not None:
        return status in TRANSIENT_STATUS or status >= 500
    return any(cls.__name__ in TRANSIENT_NAMES for cls in type(exc).__mro__)


async def await_any(x: Any) -> Any:
    """Await an SDK result: an awaitable (Tinker APIFuture, coroutine), a concurrent future
    (Fireworks samplers), or a plain value."""
    import concurrent.futures

    if isinstance(x, concurrent.futures.Future):
        return await asyncio.wrap_future(x)
    if hasattr(x, "__await__"):
        return await x
    return x


async def call(
    what: str,
    submit: Callable[[], Any],
    policy: RetryPolicy,
    *,
    retry: bool = True,
    transient: Callable[[BaseException], bool] = is_transient,
) -> Any:
    """Run `submit()` (which returns an SDK future or awaitable) and await it under a timeout,
    retrying transient failures with exponential backoff and jitter."""

    async def once() -> Any:
        try:
            return await asyncio.wait_for(await_any(submit()), policy.timeout_s)
        except TimeoutError as e:
            raise TransientBackendError(f"{what}: no answer within {policy.timeout_s:.0f} s") from e

    if not retry:
        return await _mapped(what, once, transient)
    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.attempts),
        wait=wait_exponential_jitter(multiplier=policy.initial_s, max=policy.max_s),
        retry=retry_if_exception(transient),
        before_sleep=lambda s: log.warning(
            "%s failed (%s), retry %d/%d", what, s.outcome and s.outcome.exception(),
            s.attempt_number, policy.attempts - 1,
        ),
        reraise=True,
    )
    try:
        return await _mapped(what, lambda: retrying(once), transient)
    except RetryError as e:  # pragma: no cover - reraise=True surfaces the last error
        raise TransientBackendError(f"{what}: gave up after {policy.attempts} attempts") from e


async def _mapped(what: str, run: Callable[[], Awaitable[T]], transient: Callable[[BaseException], bool]) -> T:
    try:
        return await run()
    except BackendError:
        raise
    except Exception as e:
        if transient(e):
            raise TransientBackendError(f"{what}: {type(e).__name__}: {e}") from e
        raise PermanentBackendError(f"{what}: {type(e).__name__}: {e}") from e
