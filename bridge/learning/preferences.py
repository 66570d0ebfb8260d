"""The user's preferences: heard in their corrections, applied at once, learned by the weights.

Each user has their own (the store keeps them apart, `store.update_preferences(..., user)`): the
functions here see one user's list at a time, so one user's hearings never count for another's.

A correction the judges turn into a hint is **heard** (the collector, as soon as the turn is
judged): the hint, less the sentences that quote the turn's own question (`unquoted`), counts for
the known preference that says the same thing (`same`: mostly the same words, or the same
stances on the form of an answer in other words; a negated wish never matches the wish;
the shortest wording is kept, unless it would change the form the preference is about), or
starts a new one. Each turn counts once (`Preference.turns`), so a collector that re-runs a
sample after a crash hears nothing twice.

A preference then moves through states (docs/methods.md#preferences-heard-applied-learned):

    heard ──(heard twice and about the form of an answer, or confirmed by the user)──► applied
    applied ──(the gate finds the weights alone keep it)──► learned ──(a later version loses it)──► applied
    any ──(`clawbridge preferences forget N`)──► dropped (sticky: only a confirmation brings it back)
    any ──(a newer preference that contradicts it is applied)──► superseded
    superseded ──(heard twice again after that)──► applied

What is applied is served at once as an instruction (`served_instruction`, the applied ones, one
a line, in a canonical order); what the user wants (`wanted_instruction`: applied and learned) is
what the gate's **prompted twin** is asked with, and the price of the preferences is measured on
it. Only the form of an answer applies without asking, and a hostile text never applies
(`learning.form`); at most MAX_APPLIED are applied at once, each at most `form.MAX_CHARS` long.
Pure functions over plain data; the store keeps the list (`store.update_preferences`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import datetime

from clawbridge.learning.form import (
    MAX_CHARS,
    NEGATIONS,
    contradicts,
    form,
    hostile,
    same_form,
    senses,
)
from clawbridge.store import Preference

SAME = 0.8  # the share of the shorter hint's words in the longer one at which they say the same thing
MAX_APPLIED = 3  # preferences applied at once: a fourth waits (heard) until one is dropped, superseded or learned
HEARINGS = 2  # hearings after which a preference about the form of an answer applies without asking
STATES = ("heard", "applied", "learned", "superseded", "dropped")


class PreferenceRefused(ValueError):
    """A confirmation that cannot apply the preference (hostile, too long, too many applied)."""


def same(a: str, b: str) -> bool:
    """Two hints say the same thing: SAME or more of the shorter one's words are in the other,
    negated in both or in neither (so "Too long, one short sentence please." and the same words
    followed by an objection are one wish, and "Do not use bullet points." is not "Use bullet
    points."); or both are about the form of an answer alone and take the same stances on the
    same axes (`form.same_form`: "Too long. Please answer in one short sentence, under 20 words." and
    "That's too long for me. Just one short sentence of at most 20 words, please." are one wish,
    worded twice, not two instructions served one after the other)."""
    wa, wb = senses(a), senses(b)
    if not wa or not wb:
        return a.strip().lower() == b.strip().lower()
    return len(wa & wb) / min(len(wa), len(wb)) >= SAME or same_form(a, b)


_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def unquoted(hint: str, question: str | None) -> str:
    """`hint` without the sentences that quote the turn's own question (they are about that turn,
    not every answer)."""
    q = " ".join(question.lower().split()).rstrip("?!. ") if question else ""
    if not q:
        return " ".join(hint.split())
    kept = [x for x in _SENTENCE.split(" ".join(hint.split())) if q not in x.lower()]
    return " ".join(kept)


# --- states ---------------------------------------------------------------------------------------

def refusal(p: Preference) -> str | None:
    """Why `p` can never be applied, even when confirmed (None: it can)."""
    if (why := hostile(p.text)) is not None:
        like = {"injection": "an instruction injection", "secret": "a secret or a key", "url": "a link",
                "code": "code or markup"}.get(why, why)
        return f"it reads like {like}, which is never applied"
    if len(p.text) > MAX_CHARS:
        return f"it is longer than {MAX_CHARS} characters"
    return None


def applicable(p: Preference) -> bool:
    """Whether `p` may be applied now: heard (or superseded, or dropped and then confirmed), never
    hostile or too long, and either about the form of an answer and heard HEARINGS times (since it
    was last superseded), or confirmed by the user."""
    if p.state not in ("heard", "superseded", "dropped") or refusal(p) is not None:
        return False
    if p.confirmed:
        return True
    return p.state != "dropped" and p.kind is not None and p.count_since >= HEARINGS


def _apply(prefs: list[Preference], at: int, version: int, now: datetime | None) -> None:
    """Apply prefs[at] in place if the cap allows, superseding what contradicts it."""
    p = prefs[at]
    rivals = [i for i, q in enumerate(prefs)
              if i != at and q.state in ("heard", "applied", "learned") and contradicts(q.text, p.text)]
    applied = sum(q.state == "applied" for i, q in enumerate(prefs) if i not in rivals and i != at)
    if applied >= MAX_APPLIED:
        return
    for i in rivals:
        prefs[i] = replace(prefs[i], state="superseded", state_at=now, count_since=0, confirmed=False)
    prefs[at] = replace(p, state="applied", state_at=now, applied_at=now, applied_version=version, dropped_at=None)


def merge(
    known: Sequence[Preference], hints: Iterable[tuple[str, str]], version: int, now: datetime | None = None,
) -> list[Preference]:
    """`known` after hearing the (hint, turn id) pairs while `version` serves: a hint that says
    what a known preference says counts for it (once per turn); any other starts a new one. A
    preference heard often enough applies (`applicable`) and supersedes what contradicts it.
    Order: first heard first."""
    out = list(known)
    heard = {t for p in out for t in p.turns}
    for hint, turn_id in hints:
        text = " ".join(hint.split())
        if not text or turn_id in heard:
            continue
        heard.add(turn_id)
        at = next((i for i, p in enumerate(out) if same(p.text, text)), None)
        if at is None:
            number = max((p.id for p in out), default=0) + 1  # the store numbers it among all users
            out.append(Preference(text, 1, (turn_id,), version, id=number, kind=form(text), count_since=1,
                                  state_at=now))
            at = len(out) - 1
        else:
            p = out[at]
            wording = min(p.text, text, key=len)
            if p.kind is not None and form(wording) != p.kind:  # a wording never changes what it is about
                wording = p.text
            out[at] = replace(p, text=wording, count=p.count + 1, turns=(*p.turns, turn_id),
                              count_since=p.count_since + 1, kind=form(wording))
        if applicable(out[at]):
            _apply(out, at, version, now)
    return out


def confirm(known: Sequence[Preference], pref_id: int, version: int, now: datetime) -> list[Preference]:
    """The user confirms preference `pref_id`: it applies at once (a dropped one comes back).
    Raises KeyError (no such preference) or PreferenceRefused (hostile, too long, or MAX_APPLIED
    applied already)."""
    out = list(known)
    at = next((i for i, p in enumerate(out) if p.id == pref_id), None)
    if at is None:
        raise KeyError(pref_id)
    p = out[at]
    if (why := refusal(p)) is not None:
        raise PreferenceRefused(f"preference {pref_id} cannot be applied: {why}")
    if p.state in ("applied", "learned"):
        out[at] = replace(p, confirmed=True)
        return out
    out[at] = replace(p, confirmed=True)
    _apply(out, at, version, now)
    if out[at].state != "applied":
        raise PreferenceRefused(f"{MAX_APPLIED} preferences are applied already: forget one first "
                                "(`clawbridge preferences forget N`)")
    return out


def reheard(known: Sequence[Preference]) -> list[Preference]:
    """Stored preferences heard again from scratch, each as often as it was counted: the states
    a store recorded before preferences had states (a recorded run's) would have now."""
    hints = [(p.text, f"{p.id}#{k}") for p in known for k in range(p.count)]
    return merge([], sorted(hints, key=lambda h: int(h[1].split("#")[1])), 0)


def served_instruction(prefs: Sequence[Preference]) -> str | None:
    """What is served now as the user's standing instruction: the applied preferences (never a
    learned one: the weights carry it), one a line, in a canonical order; None: nothing."""
    return instruction([p for p in prefs if p.state == "applied" and refusal(p) is None][:MAX_APPLIED])


def served_by_user(prefs: Sequence[Preference]) -> dict[str, str]:
    """Each user's served instruction (`served_instruction` of their own preferences alone; a user
    served nothing is left out), the user whose preferences applied most recently first."""
    mine: dict[str, list[Preference]] = {}
    for p in prefs:
        mine.setdefault(p.user, []).append(p)
    latest = {u: max((p.applied_at.timestamp() for p in ps if p.applied_at), default=0.0) for u, ps in mine.items()}
    served = {u: served_instruction(mine[u]) for u in sorted(mine, key=lambda u: -latest[u])}
    return {u: text for u, text in served.items() if text}


def wanted_instruction(prefs: Sequence[Preference]) -> str | None:
    """What the user wants of every answer: the applied and the learned preferences (what the
    gate's prompted twin is asked with, and the price is measured for)."""
    return instruction([p for p in prefs if p.state in ("applied", "learned") and refusal(p) is None])


def instruction(prefs: Sequence[Preference]) -> str | None:
    """The preferences, one a line (None: none), in a canonical order (sorted, each text once:
    several users may want the same), so the same preferences are asked the same way whichever
    the user gave first (the order is part of the prompt the twin's price is measured with)."""
    return "\n".join(sorted({p.text for p in prefs})) or None


__all__ = ["HEARINGS", "MAX_APPLIED", "MAX_CHARS", "NEGATIONS", "STATES", "PreferenceRefused", "applicable",
           "confirm", "instruction", "merge", "refusal", "reheard", "same", "senses", "served_by_user",
           "served_instruction", "unquoted", "wanted_instruction"]
