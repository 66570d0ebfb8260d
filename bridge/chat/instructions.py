"""The user's standing preferences as an instruction in the prompt, in the model's own chat format.

What the user has asked for of every answer (the applied preferences,
docs/methods.md#preferences-heard-applied-learned) is served as a system instruction: appended to
the first message when it is a system (or developer) message, else a new system message in
front (the place the OPD teacher's hint takes, `judges.hints.teacher_messages`). The gate's
prompted twin is asked with exactly this function and wording, so what is served and what the
price is measured for are one prompt. Training rebuilds the student's view of a served turn from
its messages as the client sent them (`StoredTurn.messages`), and the teacher's view with
`instructed(messages, StoredTurn.instruction)`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

INSTRUCTION_SYSTEM = "The user's standing preferences; follow them in every answer:\n{instruction}"


def with_system_line(messages: Sequence[Mapping[str, Any]], line: str) -> list[dict[str, Any]]:
    """A copy of `messages` with `line` as a system instruction: appended (after a blank line) to
    the first message when it is a system (or developer) message, else a new system message in
    front. The input is never mutated; a first message with content parts gets it as a last text
    part. The one placement the served instruction, the twin and the OPD teacher's hint share."""
    out = [copy.deepcopy(dict(m)) for m in messages]
    first = out[0] if out else None
    if first is None or first.get("role") not in ("system", "developer"):
        return [{"role": "system", "content": line}, *out]
    content = first.get("content")
    if isinstance(content, list):
        content.append({"type": "text", "text": f"\n\n{line}"})
    else:
        first["content"] = f"{content}\n\n{line}" if content else line
    return out


def restates(instruction: str | None, line: str) -> bool:
    """`line` is word for word one of the instruction's preferences (case, spacing and the end's
    punctuation aside): a correction the user repeats once the preference is applied."""
    key = _key(line)
    return bool(instruction) and bool(key) and any(_key(x) == key for x in (instruction or "").splitlines())


def _key(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".!? ")


def instructed(messages: Sequence[Mapping[str, Any]], instruction: str | None) -> list[dict[str, Any]]:
    """A copy of `messages` with `instruction` as a system instruction (`INSTRUCTION_SYSTEM`,
    `with_system_line`); `instruction` None or empty: a plain copy."""
    if not instruction:
        return [copy.deepcopy(dict(m)) for m in messages]
    return with_system_line(messages, INSTRUCTION_SYSTEM.format(instruction=instruction))


__all__ = ["INSTRUCTION_SYSTEM", "instructed", "restates", "with_system_line"]
