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

Each user is served their own preferences' instruction, never another user's: the request's
user (`serving.users`; `default` for a request that names nobody) picks it.

The proxy never reads the store on a request: `Standing` keeps each user's served instruction in
memory (only users with one, at most MAX_USERS). It is set when a user's preferences change in
this process (the collector hears one, a route confirms or forgets one) and read again from the
store every REFRESH_S by the composition root, which is how the other proxies on a shared store
(docs/scale-out.md) see a change within seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from itertools import islice
from typing import Any

from clawbridge.chat.instructions import instructed
from clawbridge.chat.messages import PromptTooLong
from clawbridge.serving.sessions import history
from clawbridge.serving.wire import APIError
from clawbridge.store import DEFAULT_USER

log = logging.getLogger(__name__)

HEADER = "x-instructions"
REFRESH_S = 5.0  # how often the served instruction is read again from the store
# Users whose instruction is kept in memory (each at most MAX_APPLIED lines of form.MAX_CHARS: a
# few MB at most); past it, those whose preferences applied longest ago are served none.
MAX_USERS = 10_000
_OFF, _ON = frozenset({"off", "false", "0", "no"}), frozenset({"on", "true", "1", "yes"})


class Standing:
    """Each user's applied preferences' instruction (a user with none is not kept), where to read
    them again from, and whether they are served at all (`instant_preferences`)."""

    def __init__(self, enabled: bool = True,
                 source: Callable[[], Awaitable[Mapping[str, str]]] | None = None) -> None:
        self.texts: dict[str, str] = {}  # user -> instruction, the most recently applied last
        self.enabled = enabled
        # every user's instruction, as the composition root reads them, the most recently applied first
        self.source = source
        self._failing = False

    def of(self, user: str) -> str | None:
        """The instruction `user`'s applied preferences make (None: none), served or not."""
        return self.texts.get(user)

    def served_to(self, user: str) -> str | None:
        """What `user`'s turn is served with now."""
        return self.texts.get(user) if self.enabled else None

    @property
    def text(self) -> str | None:
        """The instruction of `default`, the user of a request that names nobody."""
        return self.of(DEFAULT_USER)

    @property
    def served(self) -> str | None:
        """What a request naming nobody is served with now."""
        return self.served_to(DEFAULT_USER)

    def set(self, user: str, text: str | None) -> None:
        """`user`'s instruction, now (None: none), the most recent one kept first past MAX_USERS."""
        self.texts.pop(user, None)
        if text:
            self.texts[user] = text
            while len(self.texts) > MAX_USERS:
                del self.texts[next(iter(self.texts))]

    async def refresh(self) -> None:
        """Read every user's again from the store (a failure keeps the last ones: serving never
        waits on it; logged once until a read succeeds again)."""
        if self.source is not None:
            try:
                texts = await self.source()
                self._failing = False
            except Exception:
                if not self._failing:
                    log.warning("could not read the preferences from the store; serving the last instructions",
                                exc_info=True)
                self._failing = True
                return
            newest = list(islice(((u, x) for u, x in texts.items() if x), MAX_USERS))
            self.texts = dict(reversed(newest))


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
