"""How a stored turn reads on the page (`store.browse`): its text cut short, its messages, the
last thing the user said, and where it is in the learning loop. Pure functions of stored values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

JSON = dict[str, Any]
TEXT_CHARS = 2_000  # a message's text on the page; the whole conversation is `clawbridge export`


def text_of(content: Any, limit: int = TEXT_CHARS) -> str:
    """A message's content as plain text (parts joined, non-text parts named), cut to `limit`.
    The page escapes it; this only makes it short."""
    if content is None:
        return ""
    if isinstance(content, str):
        s = content
    elif isinstance(content, list):
        bits = []
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                bits.append(str(part.get("text", "")) if kind in ("text", "input_text") or "text" in part
                            else f"[{kind or 'part'}]")
            else:
                bits.append(str(part))
        s = "\n".join(bits)
    else:
        s = str(content)
    return s if len(s) <= limit else s[:limit] + f"… ({len(s) - limit} more characters)"


def message_view(m: Any) -> JSON:
    if not isinstance(m, dict):
        return {"role": "?", "text": text_of(m)}
    out: JSON = {"role": str(m.get("role", "?")), "text": text_of(m.get("content"))}
    calls = m.get("tool_calls")
    if isinstance(calls, list) and calls:
        names = [str((c.get("function") or {}).get("name", "?")) for c in calls if isinstance(c, dict)]
        out["tool_calls"] = names
    return out


def last_user_text(messages: Sequence[Any]) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") in ("user", "tool"):
            return text_of(m.get("content"), 400)
    return ""


def turn_status(turn_type: str, train: bool, has_next: bool, sample: JSON | None) -> tuple[str, str]:
    """(state, words) of a turn in the learning loop, for the page's badge."""
    if turn_type != "main":
        return "side", "side turn: not trained"
    if not train:
        return "opted_out", "opted out (X-Train: false)"
    if sample is None:
        return ("waiting_judge", "waiting for the judge") if has_next else (
            "waiting_reply", "waiting for the user's next message")
    state = sample["state"]
    if state == "trained":
        return "trained", f"trained in step {sample['step']}" if sample.get("step") is not None else "trained"
    if state == "dropped":
        return "dropped", f"dropped: {sample.get('reason') or 'no reason stored'}"
    if state == "judged":
        return "judged", "judged, waiting for a training step"
    return "pending", "being judged"
