"""A backend for the API-surface tests: the real local backend on the tiny random model, which
records every completion it hands out (so a test can check the store holds exactly what was
sampled), with scripted answers where a random model would never act like an agent.

The script reads the rendered prompt: when tools are offered and the last message is not a tool
result, the answer is a Hermes-style call of the first tool; after a tool result, a short text;
asked to think first, a `<think>` block and then a short text.
Scripted tokens get their logprobs from the real backend's `score`, so captured turns stay exact.
Otherwise the tiny model samples for real."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

from clawbridge.protocol import Priority
from clawbridge.types import Completion, SamplingParams, TokenChunk

MODEL = "tiny-random"
KEY = "sk-test"  # the server wants a key: every surface's way of sending one is exercised

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
AFTER_TOOL = "The file a.txt says hello."
THINK_FIRST = "Think first."  # a user message with this gets a reasoning block, then the answer
THOUGHT, ANSWER = "The user wants a greeting.", "Hello!"
READ_FILE = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


class RecordingBackend:
    def __init__(self, real: Any) -> None:
        self.real = real
        self.name, self.model_name, self.context_length = real.name, real.model_name, real.context_length
        self.sampled: list[Completion] = []  # every completion handed out, in order

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    @property
    def version(self) -> int:
        return int(self.real.version)

    def _script(self, prompt_ids: Sequence[int]) -> list[int] | None:
        tok = self.real.tokenizer()
        text = tok.decode(list(prompt_ids))
        last = text.rsplit("<|im_start|>", 2)[-2] if text.count("<|im_start|>") >= 2 else ""
        if last.startswith("tool") or "<tool_response>" in last:
            answer = AFTER_TOOL
        elif THINK_FIRST in last:
            answer = f"<think>{THOUGHT}</think>{ANSWER}"
        elif "<tools>" in text or '"read_file"' in text:
            answer = CALL
        else:
            return None
        return [*tok.encode(answer, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1,
                     version: int | None = None, priority: Priority = "user") -> list[Completion]:
        ids = self._script(prompt_ids)
        if ids is None:
            comps = await self.real.sample(prompt_ids, params, n=n, version=version, priority=priority)
        else:
            lps = await self.real.score(prompt_ids, ids, temperature=params.temperature)
            comps = [Completion(tuple(ids), tuple(lps), "stop", self.version) for _ in range(n)]
        self.sampled.extend(comps)
        return comps

    async def sample_stream(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                            version: int | None = None, priority: Priority = "user") -> AsyncIterator[TokenChunk]:
        ids = self._script(prompt_ids)
        tokens: list[int] = []
        lps: list[float] = []
        finish = "stop"
        if ids is None:
            async for chunk in self.real.sample_stream(prompt_ids, params, version=version):
                tokens += chunk.tokens
                lps += chunk.logprobs
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    self.sampled.append(Completion(tuple(tokens), tuple(lps), finish, chunk.version))  # type: ignore[arg-type]
                yield chunk
            return
        scored = await self.real.score(prompt_ids, ids, temperature=params.temperature)
        self.sampled.append(Completion(tuple(ids), tuple(scored), "stop", self.version))
        for i, (t, lp) in enumerate(zip(ids, scored, strict=True)):
            yield TokenChunk((t,), (lp,), self.version, "stop" if i == len(ids) - 1 else None)


def assert_captured(turn: Any, sampled: Completion) -> None:
    """The stored turn holds exactly the ids and logprobs the backend handed out."""
    assert turn.completion_ids == sampled.tokens
    assert len(turn.logprobs) == len(sampled.logprobs) > 0
    assert all(math.isclose(a, b, rel_tol=0, abs_tol=0) for a, b in zip(turn.logprobs, sampled.logprobs, strict=True))
