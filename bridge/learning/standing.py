"""What a user does with a preference (confirm it, forget it), and how one is shown.

The routes (`POST /v1/admin/preferences/{n}/confirm|forget`), the page's buttons and
`clawbridge preferences confirm|forget N` all come here; the caller then refreshes the served
instruction (`Proxy.refresh_instruction`), so the change is served from the next request on.
Forgetting a preference stops its instruction, drops its samples not trained yet, and offers the
rollback to the version that served before any of its samples could train
(docs/methods.md#preferences-heard-applied-learned).

A preference is one user's: its number names it among every user's, and acting on it changes
that user's preferences alone (`user`: whose it must be; None, the operator's: whoever's it is).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clawbridge.learning import preferences
from clawbridge.store import Preference
from clawbridge.store.records import DEFAULT_USER, utcnow

if TYPE_CHECKING:
    from clawbridge.store import Store


@dataclass(frozen=True)
class Forgotten:
    preference: Preference
    samples_dropped: int  # its samples not trained yet, dropped now
    rollback_to: int | None  # the version that served before it could train; None: nothing trained since


async def confirm(store: Store, pref_id: int, version: int, user: str = DEFAULT_USER) -> Preference:
    """Apply `user`'s preference `pref_id` at once (KeyError: none such; PreferenceRefused: it
    cannot be)."""
    out = await store.run(store.update_preferences,
                          lambda known: preferences.confirm(known, pref_id, version, utcnow()), user)
    return next(p for p in out if p.id == pref_id)


async def forget(store: Store, pref_id: int, serving: int, stopped: Callable[[], Awaitable[Any]] | None = None,
                 lock: asyncio.Lock | None = None, user: str = DEFAULT_USER) -> Forgotten:
    """Drop `user`'s preference `pref_id` (KeyError: none such): its instruction stops at once
    (`stopped`: the caller serves without it from now on), then its samples not trained yet are
    dropped once no training step runs (`lock`: the learner's, so no batch in training loses a
    sample under it), and the rollback to the version before it is offered when a version newer
    than that serves."""
    p = await store.run(store.forget_preference, pref_id, user)
    if stopped is not None:
        await stopped()
    async with lock or contextlib.nullcontext():
        dropped = await store.run(store.drop_preference_samples, pref_id, user)
    return Forgotten(p, dropped, p.first_version if serving > p.first_version else None)


ACTIONS = ("confirm", "forget")


async def act(store: Store, action: str, pref_id: int, serving: int, changed: Callable[[], Awaitable[Any]],
              lock: asyncio.Lock | None = None, user: str | None = None) -> dict[str, Any]:
    """`confirm` or `forget` preference `pref_id` while `serving` serves; its JSON view.
    `changed` is awaited as soon as the preferences changed (the caller refreshes what it serves);
    `lock`: the learner's (`forget`); `user`: whose it must be (None: whoever's it is).
    ValueError: no such action; KeyError: no such preference (of `user`'s); PreferenceRefused:
    it cannot apply."""
    if action not in ACTIONS:
        raise ValueError(f"no action {action!r}: {' or '.join(ACTIONS)}")
    owner = user if user is not None else await store.run(store.preference_owner, pref_id)
    if action == "confirm":
        out = view(await confirm(store, pref_id, serving, owner))
        await changed()
        return out
    return forgotten_view(await forget(store, pref_id, serving, changed, lock, owner))


def note(p: Preference) -> str:
    """Why the preference is in its state, in a few words (for the list, the page and the API)."""
    if p.state == "heard":
        if (why := preferences.refusal(p)) is not None:
            return f"never applied: {why}"
        if p.kind is None:
            return "not about the form of an answer: applied only if you confirm it"
        if p.count_since < preferences.HEARINGS:
            return f"about {p.kind}: applied once heard {preferences.HEARINGS} times, or confirmed"
        return f"waits: {preferences.MAX_APPLIED} preferences are applied already"
    return {"applied": "served as an instruction" + (" (confirmed)" if p.confirmed else ""),
            "learned": f"the weights of v{p.learned_version} keep it: no longer served as an instruction",
            "superseded": "a newer preference contradicts it: applied again once heard twice more",
            "dropped": "dropped by you: applied again only if you confirm it"}.get(p.state, "")


def view(p: Preference) -> dict[str, Any]:
    """A preference as JSON (the API, the page)."""
    return {"object": "preference", "id": p.id, "user": p.user, "text": p.text, "state": p.state, "kind": p.kind,
            "count": p.count, "confirmed": p.confirmed, "first_version": p.first_version,
            "since": p.state_at.isoformat() if p.state_at else None,
            "applied_version": p.applied_version, "learned_version": p.learned_version,
            "note": note(p), "turns": list(p.turns[-5:])}


def forgotten_view(f: Forgotten) -> dict[str, Any]:
    rollback = None if f.rollback_to is None else f"clawbridge rollback {f.rollback_to}"
    return {**view(f.preference), "samples_dropped": f.samples_dropped, "rollback_to": f.rollback_to,
            "rollback_command": rollback}


__all__ = ["ACTIONS", "Forgotten", "act", "confirm", "forget", "forgotten_view", "note", "view"]
