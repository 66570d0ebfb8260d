"""The user's standing preferences, served at once as an instruction (docs/serving.md#the-users-preferences).

What the user has asked for of every answer and the collector applied (the applied preferences,
docs/methods.md#preferences-heard-applied-learned) goes into the prompt of the user's own turns as
a system instruction (`chat.instructions.instructed`), so the next answer follows it before any
weights have learned it. It goes only where a user is talking to the model:

- a main turn (never a side turn: an agent's housekeeping, a summary, a title),
- whose last message is the user's (never a tool result, nor an assistant prefill; an agent's
  internal-context message, OpenClaw's, does not count),
- not opted out (`X-Instructions: off`: the weights alone, what benchmarks ask for),
- with `instant_preferences` on;

and only when it fits: a prompt that fits the context only without it is served without it. The
turn records the messages as the client sent them, the prompt ids as rendered, and the
instruction (`TurnRecord.instruction`).

The proxy never reads the store on a request: `Standing` keeps the served instruction in memory.
It is set when the preferences change in this process (the collector hears one, a route confirms
or forgets one) and read again from the store every REFRESH_S by the composition root, which is
how the other proxies on a shared store (docs/scale-out.md) see a change within seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from clawbridge.chat.instructions import instructed
from clawbridge.chat.messages import PromptTooLong
from clawbridge.serving.sessions import history
from clawbridge.serving.wire import APIError

log = logging.getLogger(__name__)

HEADER = "x-instructions"
REFRESH_S = 5.0  # how often the served instruction is read again from the store
_OFF, _ON = frozenset({"off", "false", "0", "no"}), frozenset({"on", "true", "1", "yes"})


class Standing:
    """The applied preferences' instruction (None: nothing applied), where to read it again from,
    and whether it is served at all (`instant_preferences`)."""

    def __init__(self, enabled: bool = True, source: Callable[[], Awaitable[str | None]] | None = None) -> None:
        self.text: str | None = None
        self.enabled = enabled
        self.source = source  # the store's applied preferences, as the composition root reads them
        self._failing = False

    @property
    def served(self) -> str | None:
        """What a user's turn is served with now."""
        return self.text if self.enabled else None

    async def refresh(self) -> str | None:
        """Read it again from the store (a failure keeps the last one: serving never waits on it;
        logged once until a read succeeds again)."""
        if self.source is not None:
            try:
                self.text = await self.source()
                self._failing = False
            except Exception:
                if not self._failing:
                    log.warning("could not read the preferences from the store; serving the last instruction",
                                exc_info=True)
                self._failing = True
        return self.text


def wanted(header: str | None) -> bool:
    """Whether the request lets the instruction in (`X-Instructions: on|off`, default on); any
    other value is a 400."""
    if header is None or header.strip().lower() in _ON:
        return True
    if header.strip().lower() in _OFF:
        return False
    raise APIError(400, f"X-Instructions must be 'on' or 'off', got {header!r}.", param="X-Instructions",
                   code="invalid_value")


def chosen(messages: Sequence[Mapping[str, Any]], turn_type: str, header: str | None, enabled: bool,
           standing: str | None) -> str | None:
    """The instruction a request is served with (pure): `standing` for a user's main turn, None
    otherwise (see the module's list)."""
    if not wanted(header) or not enabled or not standing or turn_type != "main":
        return None
    said = history(messages)  # an agent's internal context (OpenClaw's, rebuilt every request) is not the user
    if not said or said[-1].get("role") != "user":
        return None
    return standing


def render(render_messages: Callable[[list[dict[str, Any]]], list[int]], messages: list[dict[str, Any]],
           instruction: str | None, context: int) -> tuple[list[int], str | None]:
    """The prompt's ids and the instruction they carry: with it when it fits the context, else
    without it (then the instruction is None). `render_messages` raises PromptTooLong past the
    context, as the renderer does."""
    if instruction:
        try:
            ids = render_messages(instructed(messages, instruction))
            if len(ids) < context:
                return ids, instruction
        except PromptTooLong:
            pass
    return render_messages(messages), None


__all__ = ["HEADER", "REFRESH_S", "Standing", "chosen", "render", "wanted"]
