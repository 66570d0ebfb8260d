"""Which corrections are about the form of an answer, and which must never become an instruction.

A preference heard often enough is applied at once as an instruction to what is served
(docs/methods.md#preferences-heard-applied-learned), without the user being asked, only when it
is about the **form** of an answer: its length, its format, its tone, its language or its
structure. Whatever else a correction says (a fact, a behaviour, a tool to use, a name, a
sign-off) may be the user's wish for one turn or a misreading, so it stays "heard" until the user
confirms it. And a text that reads like an attack on the prompt (an injection, a role switch, the
system prompt, a secret or key, a URL, code to run) is **hostile**: it is never applied, not even
when confirmed.

`form(text)` is a closed-vocabulary classifier, rules as data: every word of the text must be in
`VOCABULARY` (the words of the form kinds below, plus function words, politeness and small
numbers), at least one word must name a kind, and the text must not pull one way and the other on
the same axis ("shorter and longer"). So "Too long. Please answer in one short sentence, under 20
words." is about length, and "No, the capital is Canberra." (two words outside the vocabulary)
is about nothing the classifier knows: it is not form. Pure functions over strings.
"""

from __future__ import annotations

import re
from collections import Counter

MAX_CHARS = 200  # the longest text applied as an instruction (one line of the served instruction)
SAME_WORDS = 0.8  # the share of the shorter text's words in the other at which two texts say the same words

# --- words and their negation ---------------------------------------------------------------------
_WORDS = re.compile(r"[a-z0-9']+")
_END = re.compile(r"[.;:!?\n]+")  # a negation reaches to the end of its sentence
# words that negate what follows them ("doesn't", "won't", ...: any word ending in n't)
NEGATIONS = frozenset({"not", "no", "never", "nor", "neither", "none", "nothing", "cannot", "dont", "without",
                       "avoid", "avoiding", "stop", "stopping", "quit"})


def negates(word: str) -> bool:
    return word in NEGATIONS or word.endswith("n't")


def senses(text: str) -> frozenset[tuple[str, bool]]:
    """The words of `text` but the negations, each with whether it is negated: a negation
    negates the rest of its sentence (a second one undoes it). A negation alone before a comma
    ("No, in French.") is an interjection and negates nothing."""
    out: set[tuple[str, bool]] = set()
    for sentence in _END.split(text.lower().replace("\u2019", "'")):
        negated = False
        for part in sentence.split(","):
            ws = _WORDS.findall(part)
            if len(ws) == 1 and negates(ws[0]):
                continue
            for w in ws:
                if negates(w):
                    negated = not negated
                else:
                    out.add((w, negated))
    return frozenset(out)


# --- the form kinds -------------------------------------------------------------------------------
# word -> (kind, axis, value). On an axis a preference takes one value; two preferences with
# different values on one axis contradict each other (the newer supersedes the older). A value
# "+" is flipped to "-" by a negation ("Do not use bullet points." is ("list", "-")).
LENGTH_SHORT = ("short", "shorter", "shortest", "brief", "briefer", "briefly", "concise", "concisely",
                "succinct", "terse", "fewer", "tldr")
LENGTH_LONG = ("long", "longer", "lengthy", "verbose", "wordy", "detail", "details", "detailed", "elaborate",
               "thorough", "expand", "depth")
LENGTH_NEUTRAL = ("length", "sentence", "sentences", "word", "words", "paragraph", "paragraphs", "line", "lines",
                  "tokens", "characters", "chars",
                  "max", "maximum", "minimum")
LIST_WORDS = ("bullet", "bullets", "bulleted", "list", "lists", "listed", "numbered", "points", "itemize")
FORMAT_AXES = {"table": ("table", "tables", "tabular"), "markdown": ("markdown", "formatting", "bold", "italics"),
               "json": ("json",), "emoji": ("emoji", "emojis", "emoticons"), "case": ("lowercase", "uppercase"),
               "prose": ("prose",), "code": ("code",)}
TONE_AXES = {"formal": ("formal", "professional", "serious"), "casual": ("casual", "informal", "playful", "chatty"),
             "warm": ("friendly", "warm", "polite", "kinder", "gentle"), "blunt": ("blunt", "direct"),
             "jargon": ("jargon", "technical"), "simple": ("simple", "simpler", "plain", "clear", "clearer"),
             "apology": ("apologize", "apologise", "apologizing", "apologising", "apologies", "sorry"),
             "humor": ("joke", "jokes", "humor", "humour", "funny"), "exclamation": ("exclamation", "exclamations"),
             "tone": ("tone",)}
LANGUAGES = ("english", "french", "german", "spanish", "italian", "portuguese", "dutch", "chinese", "japanese",
             "korean", "russian", "arabic", "hindi", "swedish", "polish", "turkish", "greek", "danish", "norwegian",
             "finnish", "czech", "ukrainian", "hebrew", "vietnamese", "indonesian")
STRUCTURE_AXES = {"steps": ("step", "steps", "stepwise"), "examples": ("example", "examples"),
                  "summary": ("summary", "summarize", "summarise", "recap", "overview"),
                  "headings": ("heading", "headings", "header", "headers", "section", "sections", "title", "titles"),
                  "preamble": ("intro", "introduction", "preamble", "preambles", "greeting", "greetings", "filler"),
                  "conclusion": ("conclusion", "outro"), "structure": ("structure", "structured", "outline")}


def _kinds() -> dict[str, tuple[str, str, str]]:
    out: dict[str, tuple[str, str, str]] = {}
    out.update({w: ("length", "length", "shorter") for w in LENGTH_SHORT})
    out.update({w: ("length", "length", "longer") for w in LENGTH_LONG})
    out.update({w: ("length", "", "") for w in LENGTH_NEUTRAL})  # length words with no direction
    out.update({w: ("format", "list", "+") for w in LIST_WORDS})
    for table, kind in ((FORMAT_AXES, "format"), (TONE_AXES, "tone"), (STRUCTURE_AXES, "structure")):
        for axis, words in table.items():
            out.update({w: (kind, axis if axis != "tone" else "", "+" if axis != "tone" else "") for w in words})
    out.update({w: ("language", "language", w) for w in LANGUAGES})
    out["language"] = ("language", "", "")
    out["format"] = ("format", "", "")
    return out


KIND_WORDS = _kinds()
KINDS = ("length", "format", "tone", "language", "structure")

# Words that may surround the kinds' words: function words, asking, politeness, small numbers.
OTHER_WORDS = frozenset(["a", "an", "the", "and", "or", "but", "nor", "so", "to", "of", "in", "on", "at", "for", "with", "by", "as", "from", "into", "than", "then", "like", "about", "around", "just", "only", "very", "too", "much", "more", "less", "most", "least", "many", "few", "each", "every", "all", "any", "some", "no", "not", "never", "none", "without", "also", "again", "be", "is", "are", "was", "were", "been", "being", "am", "it", "its", "it's", "itself", "that", "that's", "this", "these", "those", "there", "here", "what", "which", "i", "i'm", "i'd", "i'll", "i've", "me", "my", "myself", "you", "you're", "your", "yours", "we", "us", "our", "they", "them", "their", "he", "she", "his", "her", "do", "does", "did", "doing", "don't", "doesn't", "didn't", "can", "can't", "could", "would", "should", "will", "won't", "shall", "may", "might", "must", "need", "needs", "needed", "want", "wanted", "wants", "prefer", "preferred", "like", "liked", "love", "would'd", "please", "pls", "thanks", "thank", "ok", "okay", "yes", "yeah", "hmm", "hey", "sorry", "well", "now", "next", "time", "times", "going", "forward", "always", "anymore", "instead", "rather", "keep", "make", "made", "use", "using", "used", "give", "gave", "write", "written", "writing", "answer", "answers", "answered", "answering", "reply", "replies", "respond", "response", "responses", "say", "said", "put", "try", "stick", "stay", "limit", "limited", "cut", "trim", "start", "begin", "end", "finish", "stop", "avoid", "add", "include", "skip", "drop", "way", "style", "form", "kind", "sort", "bit", "little", "lot", "lots", "enough", "exactly", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve", "fifteen", "twenty", "thirty", "fifty", "hundred", "single", "half", "under", "over", "up", "below", "above", "within", "less", "most", "least", "top", "same", "whole", "overall", "mostly", "entirely", "first", "last", "still", "even", "already", "really", "quite", "rather", "pretty", "fairly", "way", "text", "reading", "read"])

VOCABULARY = frozenset(KIND_WORDS) | OTHER_WORDS
_ALLOWED_CHARS = re.compile(r"[A-Za-z0-9\s.,;:!?'\"()\-\u2019]*")
_NUMBER = re.compile(r"[0-9]{1,3}")

# Phrases that name a direction in words that alone would say the opposite ("too long": shorter)
# or nothing ("at most 20"); rewritten to a direction word before the words are read. A negation
# before them still flips them ("do not write more than 20 words": shorter).
PHRASES = tuple((re.compile(p), w) for p, w in (
    (r"\btoo (long|wordy|verbose|lengthy|much( detail)?|many (words|sentences|lines|paragraphs))\b", "shorter"),
    (r"\btoo (short|brief|terse|little( detail)?)\b", "longer"),
    (r"\b(no more than|not more than|at most|fewer than|less than|under|up to|max(imum)?( of)?)\b", "shorter"),
    (r"\b(at least|more than|minimum( of)?|over)\b", "longer"),
    (r"\bless (detail|details|text|words)\b", "shorter"),
    (r"\bmore (detail|details|depth|words|text)\b", "longer"),
    (r"\b(one|a single|single|1) (short )?(sentence|line|word|paragraph)\b", "shorter"),
))

# --- hostile: never an instruction, confirmed or not ----------------------------------------------
HOSTILE = tuple((name, re.compile(p, re.IGNORECASE)) for name, p in (
    ("injection", r"\b(ignore|disregard|forget|override|bypass)\b.{0,40}\b(instruction|instructions|rules?|prompt|"
                  r"guidelines?|above|previous|prior|earlier|everything)\b"),
    ("injection", r"\byou are (now|no longer)\b|\bact as\b|\bpretend\b|\brole-?play\b|\bfrom now on,? you are\b"),
    ("injection", r"\b(system|developer) (prompt|message|instructions?)\b|\bjailbreak\b|\bdo anything now\b"),
    ("injection", r"\b(reveal|print|show|repeat|leak)\b.{0,30}\b(prompt|instructions|system)\b"),
    ("injection", r"<\||\|>|\[/?inst\]|<<sys>>|^\s*(system|assistant|user)\s*:|#{2,}\s*(instruction|system)"),
    ("secret", r"\b(password|passwd|passphrase|secret|api[ _-]?key|access[ _-]?key|credentials?|private[ _-]?key|"
               r"ssh|bearer|otp|pin code|(access|auth|api|session|refresh|github|slack) ?tokens?)\b"),
    ("secret", r"\bsk-[A-Za-z0-9]{8,}|\bAKIA[0-9A-Z]{12,}|\bghp_[A-Za-z0-9]{8,}"),
    ("url", r"\b[a-z][a-z0-9+.-]*://|\bwww\.|\b[a-z0-9-]+\.(com|org|net|io|dev|ai|co|sh|xyz|ru|cn)\b"),
    ("code", r"```|`|\$\(|\bsudo\b|\brm -rf\b|\bcurl\b|\bwget\b|\beval\(|\bexec\(|\bimport os\b|<script|"
             r"\bos\.system\b|\bsubprocess\b|;\s*(rm|cat|curl|wget)\b"),
))


def hostile(text: str) -> str | None:
    """Why `text` can never be an instruction ("injection", "secret", "url", "code"), or None."""
    return next((name for name, pattern in HOSTILE if pattern.search(text)), None)


def _directed(text: str) -> str:
    low = text.lower().replace("\u2019", "'")
    for pattern, word in PHRASES:
        low = pattern.sub(word, low)
    return low


def stances(text: str) -> frozenset[tuple[str, str]]:
    """The (axis, value) pairs `text` takes on the form axes: ("length", "shorter"),
    ("list", "-"), ("language", "french"), ... A negation flips a "+" value to "-" and a length
    direction to the other one; for a language, "not in French" is ("language", "not french")."""
    out: set[tuple[str, str]] = set()
    for word, negated in senses(_directed(text)):
        _, axis, value = KIND_WORDS.get(word, ("", "", ""))
        if not axis:
            continue
        if negated:
            value = {"+": "-", "shorter": "longer", "longer": "shorter"}.get(value, f"not {value}")
        out.add((axis, value))
    return frozenset(out)


def form(text: str) -> str | None:
    """The form kind `text` is about ("length", "format", "tone", "language", "structure"), or
    None: it says something else too (a word outside `VOCABULARY`), nothing about form, it is
    hostile, longer than MAX_CHARS, or it contradicts itself on one axis."""
    if not text.strip() or len(text) > MAX_CHARS or hostile(text) or not _ALLOWED_CHARS.fullmatch(text):
        return None
    words = _WORDS.findall(text.lower().replace("\u2019", "'"))
    if any(w not in VOCABULARY and not _NUMBER.fullmatch(w) and not negates(w) for w in words):
        return None
    kinds = Counter(KIND_WORDS[w][0] for w in words if w in KIND_WORDS)
    if not kinds:
        return None
    axes = Counter(axis for axis, _ in stances(text))
    if any(n > 1 for n in axes.values()):  # "shorter and longer", "use a list, no list"
        return None
    return max(KINDS, key=lambda k: (kinds[k], -KINDS.index(k)))


def contradicts(a: str, b: str) -> bool:
    """Two preferences that cannot both hold: they take different values on one form axis
    ("Keep answers short." and "Give me more detail, longer answers."), or they say the same
    words, one negated where the other is not ("Use bullet points." and "Do not use bullet
    points."; also for preferences outside the form kinds)."""
    sa, sb = dict(stances(a)), dict(stances(b))
    if any(axis in sb and sb[axis] != value for axis, value in sa.items()):
        return True
    wa, wb = senses(a), senses(b)
    plain_a, plain_b = {w for w, _ in wa}, {w for w, _ in wb}
    common = plain_a & plain_b
    if not common or len(common) / min(len(plain_a), len(plain_b)) < SAME_WORDS:
        return False
    only_negated_a = {w for w, n in wa if n and (w, False) not in wa}
    only_negated_b = {w for w, n in wb if n and (w, False) not in wb}
    return any((w in only_negated_a) != (w in only_negated_b) for w in common)

def same_form(a: str, b: str) -> bool:
    """`a` and `b` say one wish about the form of an answer in other words: the same form kind
    (`form`), the same values on the same axes (`stances`: length shorter, no list, in French
    ...; at least one) and the same numbers ("at most 20 words" is not "at most 50 words", nor
    "Shorter.")."""
    kind, taken = form(a), stances(a)
    return (kind is not None and kind == form(b) and bool(taken) and taken == stances(b)
            and _numbers(a) == _numbers(b))


def _numbers(text: str) -> set[str]:
    return {w for w in _WORDS.findall(text.lower()) if w.isdigit()}


__all__ = ["KINDS", "MAX_CHARS", "NEGATIONS", "VOCABULARY", "contradicts", "form", "hostile", "negates", "same_form",
           "senses", "stances"]
