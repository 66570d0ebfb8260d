"""The cloud backends' test constants: the base model each fake serves, and retry policies fast
enough for tests (the fakes answer at once; only injected faults are retried)."""

from __future__ import annotations

from clawbridge.backends.remote import RetryPolicy

FAST = RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02, timeout_s=60.0)  # Tinker, Fireworks
MODAL_FAST = RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02, timeout_s=120.0)
TINKER_BASE = "Qwen/Qwen3-4B-Instruct-2507"
FIREWORKS_BASE = "accounts/fireworks/models/qwen3-4b"
