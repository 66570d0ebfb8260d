"""The user's standing preferences: what the trained hints asked for, kept as a short list.

Every sample trained from a hint (OPD, or a hint-guided rewrite) was trained towards the model's
answer *with that hint as its instruction*. Taken together, the hints of the trained samples are
what the user is teaching the model, so they are what the gate's **prompted twin** is asked with:
the base model answering the general probe with the preferences as its system instruction (the
same instruction the OPD teacher gets, `judges.hints.teacher_messages`). Its probe rate against
plain v0's is the price of the preferences (docs/methods.md#harm-is-judged-against-what-you-asked-for).

A preference is what the user wants of every answer, so the part of a hint that is about one
turn is left out: a sentence that quotes the turn's own question ("I asked: Why is the sky
blue?") is dropped (`unquoted`). The same wish comes in several wordings and combinations, so a
hint counts for a known preference when either's words are nearly all in the other (`same`), a
word negated in one ("Do not use bullet points.") never matching it affirmed in the other ("Use
bullet points."); a preference keeps its shortest wording; only the most frequent `keep` stand:
the twin changes (and is measured again) only when the standing list does. Pure functions over
plain data; the trainer keeps the list in the store (`store.save_preferences`, `store.history()`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from clawbridge.store import Preference

SAME = 0.8  # the share of the shorter hint's words in the longer one at which they say the same thing
SOURCES = 5  # turn ids kept per preference (the newest)

_WORD = re.compile(r"[a-z0-9']+")
_END = re.compile(r"[.;:!?\n]+")  # a negation reaches to the end of its sentence
# words that negate what follows them ("doesn't", "won't", ...: any word ending in n't)
NEGATIONS = frozenset({"not", "no", "never", "nor", "neither", "none", "nothing", "cannot", "dont", "without",
                       "avoid", "avoiding", "stop", "stopping", "quit"})


def _negates(word: str) -> bool:
    return word in NEGATIONS or word.endswith("n't")


def senses(text: str) -> frozenset[tuple[str, bool]]:
    """The words of `text` but the negations, each with whether it is negated: a negation
    negates the rest of its sentence (a second one undoes it). A negation alone before a comma
    ("No, in French.") is an interjection and negates nothing."""
    out: set[tuple[str, bool]] = set()
    for sentence in _END.split(text.lower().replace("\u2019", "'")):
        negated = False
        for part in sentence.split(","):
            ws = _WORD.findall(part)
            if len(ws) == 1 and _negates(ws[0]):
                continue
            for w in ws:
                if _negates(w):
                    negated = not negated
                else:
                    out.add((w, negated))
    return frozenset(out)


def same(a: str, b: str) -> bool:
    """Two hints say the same thing: SAME or more of the shorter one's words are in the other,
    negated in both or in neither (so "Too long, one short sentence please." and the same words
    followed by an objection are one wish, and "Do not use bullet points." is not "Use bullet
    points.")."""
    wa, wb = senses(a), senses(b)
    if not wa or not wb:
        return a.strip().lower() == b.strip().lower()
    return len(wa & wb) / min(len(wa), len(wb)) >= SAME


_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def unquoted(hint: str, question: str | None) -> str:
    """`hint` without the sentences that quote the turn's own question (they are about that turn,
    not every answer)."""
    q = " ".join(question.lower().split()).rstrip("?!. ") if question else ""
    if not q:
        return " ".join(hint.split())
    kept = [x for x in _SENTENCE.split(" ".join(hint.split())) if q not in x.lower()]
    return " ".join(kept)


def merge(
    known: Sequence[Preference], hints: Iterable[tuple[str, str]], version: int
) -> list[Preference]:
    """`known` plus the (hint, turn id) pairs trained into `version`: a hint that says what a
    known preference says counts for it; any other starts a new one. Order: first seen first."""
    out = list(known)
    for hint, turn_id in hints:
        text = " ".join(hint.split())
        if not text:
            continue
        at = next((i for i, p in enumerate(out) if same(p.text, text)), None)
        if at is None:
            out.append(Preference(text, 1, (turn_id,), version))
        else:
            p = out[at]
            out[at] = Preference(min(p.text, text, key=len), p.count + 1, (*p.turns, turn_id)[-SOURCES:],
                                 p.first_version)
    return out


def standing(prefs: Sequence[Preference], keep: int = 3) -> list[Preference]:
    """The `keep` most frequent, ties to the first seen; in the order they were first seen."""
    ranked = sorted(range(len(prefs)), key=lambda i: (-prefs[i].count, i))[:keep]
    return [prefs[i] for i in sorted(ranked)]


def instruction(prefs: Sequence[Preference]) -> str | None:
    """The twin's instruction: the standing preferences, one a line (None: nothing was asked), in
    a canonical order (sorted), so the same preferences are asked the same way whichever the user
    gave first (the order is part of the prompt the twin's price is measured with)."""
    return "\n".join(sorted(p.text for p in prefs)) or None


__all__ = ["NEGATIONS", "instruction", "merge", "same", "senses", "standing", "unquoted"]
