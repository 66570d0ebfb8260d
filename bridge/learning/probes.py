"""Did the answer answer the question? An offline, deterministic check, and the general probe set.

A question carries a few reference keywords that never repeat its own words. An answer answers it
when it is at least `min_words` long and names one keyword (a word that starts with it, so
"evaporat" matches "evaporation" and "evaporates"). An echo of the question or a dodge ("It seems
I'm having a misunderstanding.") names none, so it fails however short and polite it is: that is
the point, a count of words or a preference check alone paid for exactly those answers.

The general probe set (`probes.yaml`, 200 everyday questions shared by no scenario; the first
`ORIGINAL` of them the set every earlier measurement used) measures whether a version still
answers questions at all; the gate and the demo read it. Pure functions, except `general_probes`,
which reads the package file once.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources

ORIGINAL = 50  # the first questions of probes.yaml: the tools demo's set
_WORD = re.compile(r"[a-z0-9][a-z0-9'\u2019²^,.-]*", re.IGNORECASE)
DEFAULT_MIN_WORDS = 4


def words(text: str) -> list[str]:
    return [w.strip(".,'\u2019").lower() for w in _WORD.findall(text)]


def _pattern(keyword: str) -> re.Pattern[str]:
    # a word that starts with the keyword; a number is matched whole ("8" is not "80")
    tail = r"(?![0-9])" if keyword[-1:].isdigit() else ""
    return re.compile(r"(?<![a-z0-9])" + re.escape(keyword.lower()) + tail, re.IGNORECASE)


def own_words(question: str, keywords: Iterable[str]) -> list[str]:
    """The keywords the question itself already names (they prove nothing and are ignored)."""
    q = " " + " ".join(words(question))
    return [k for k in keywords if _pattern(k).search(q)]


@dataclass(frozen=True)
class AnswerKey:
    """What an answer to one question must contain."""

    question: str
    keywords: tuple[str, ...]
    min_words: int = DEFAULT_MIN_WORDS

    @functools.cached_property
    def _patterns(self) -> tuple[re.Pattern[str], ...]:
        ignored = set(own_words(self.question, self.keywords))
        return tuple(_pattern(k) for k in self.keywords if k not in ignored)

    def answered(self, answer: str) -> bool:
        """At least `min_words` words, one of which starts with a reference keyword. With no
        usable keyword (a question nobody gave keywords for) only length and not-an-echo count."""
        said = words(answer)
        if len(said) < self.min_words or is_echo(self.question, answer):
            return False
        if not self._patterns:
            return True
        text = " ".join(said)
        return any(p.search(text) for p in self._patterns)


_STOP = frozenset(
    ["a", "an", "the", "is", "are", "was", "were", "be", "do", "does", "did", "i", "you", "we", "it", "of", "to", "in", "on", "for", "and", "or", "how", "what", "why", "who", "where", "when", "which", "can", "could", "would", "should", "my", "your", "this", "that", "with", "as", "at", "by", "from"]
)


def is_echo(question: str, answer: str) -> bool:
    """The answer says nothing the question did not (its content words are the question's)."""
    q = set(words(question))
    content = [w for w in words(answer) if w not in _STOP]
    return not content or all(w in q or w.rstrip("s") in q for w in content)


def rate(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


@dataclass(frozen=True)
class Probe:
    question: str
    key: AnswerKey


def gate_tiers(pool: Sequence[Probe], first: int, total: int) -> tuple[list[Probe], list[Probe]]:
    """The gate's two tiers of the general probe set: `first` questions spread evenly over
    `pool` (asked of every candidate), then the next of the rest up to `total` in all (pure)."""
    k = min(first, len(pool))
    chosen = [pool[(i * len(pool)) // k] for i in range(k)] if k else []
    rest = [p for p in pool if p not in chosen][: max(0, min(total, len(pool)) - k)]
    return chosen, rest


@functools.cache
def general_probes() -> tuple[Probe, ...]:
    """The fixed general probe set shipped with clawbridge (`clawbridge/learning/probes.yaml`)."""
    import yaml

    data = yaml.safe_load(resources.files("clawbridge.learning").joinpath("probes.yaml").read_text())
    min_words = int(data.get("min_words", DEFAULT_MIN_WORDS))
    return tuple(
        Probe(p["q"], AnswerKey(p["q"], tuple(str(k) for k in p["k"]), min_words)) for p in data["probes"]
    )


__all__ = ["ORIGINAL", "AnswerKey", "Probe", "gate_tiers", "general_probes", "is_echo", "own_words", "rate", "words"]
