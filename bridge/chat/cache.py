"""The renderer's incremental prompt cache: a long session re-tokenises only what is new, with
the same ids as a full render (docs/renderer.md)."""

from __future__ import annotations

import bisect
import logging
import threading
from array import array
from dataclasses import dataclass, field
from typing import Any

import orjson
from clawbridge.chat.prefix import Recent

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One rendered request, kept so the next request of its conversation renders only what is
    new. Text ends are per message count: `ends[j]` is the length of the text of the first `j`
    request messages without the generation prompt (-1 where not known)."""

    raw: list[Any]  # a snapshot of the request's messages (compared, never changed)
    sig: bytes  # tools and tool_choice, serialised: equal bytes render equally
    norm: list[dict[str, Any]]  # the normalised messages the template saw
    tools: list[dict[str, Any]] | None  # the template's `tools`
    shift: int  # 1 when normalisation inserted a system message (the fallback tool block)
    text: str  # the prompt text, generation prompt included
    ends: list[int]
    ids: tuple[int, ...] = ()
    cuts: array = field(default_factory=lambda: array("l"))  # char offsets just after a splitting added token ...
    cut_ids: array = field(default_factory=lambda: array("l"))  # ... and the number of ids up to there


class PromptCache:
    """The last few rendered requests, found by their messages: a new request reuses the entry
    that shares its longest message prefix (compared by value, exactly; a hash never decides).

    Two levels of reuse:
    - text: for prefix-stable templates (probed at construction), the template renders only the
      new messages, in a small context (the first message and the last shared one), and the
      shared prefix's text is taken from the entry. Three small renders instead of one whose cost
      grows with the conversation.
    - tokens: added tokens (`<|im_start|>`, `<|im_end|>`, ...) are split out before BPE runs, so
      the ids of the text up to just after one of them never depend on what follows. The new
      text reuses the entry's ids up to the last such boundary inside their common text prefix
      and tokenises the rest.
    """

    def __init__(self, tokenizer: Any, size: int) -> None:
        self._tok = tokenizer.backend_tokenizer
        self.size = size
        self.entries: Recent[Entry] = Recent(size)
        # Tokens whose flags let them eat neighbouring whitespace are not safe boundaries.
        self._split_ids = frozenset(
            i for i, t in tokenizer.added_tokens_decoder.items() if not (t.lstrip or t.rstrip)
        )
        self.hits = 0  # token ids reused
        self.text_hits = 0  # text rendered incrementally
        self.lock = threading.RLock()  # the proxy may render from a thread pool

    def encode(self, entry: Entry, base: Entry | None) -> None:
        """Fill `entry.ids` (and its boundaries), reusing `base`'s ids where the texts agree."""
        text = entry.text
        start, cuts, cut_ids = 0, array("l"), array("l")
        prefix_ids: tuple[int, ...] = ()
        if base is not None:
            common = _common_prefix_len(base.text, text)
            j = bisect.bisect_right(base.cuts, common) - 1
            if j >= 0:
                start = base.cuts[j]
                prefix_ids = base.ids[: base.cut_ids[j]]
                cuts, cut_ids = base.cuts[: j + 1], base.cut_ids[: j + 1]
                self.hits += 1
        enc = self._tok.encode(text[start:], add_special_tokens=False)
        new = enc.ids
        n0 = len(prefix_ids)
        split = self._split_ids
        offsets = enc.offsets  # built on each access: once
        for k, tid in enumerate(new):
            if tid in split:
                cuts.append(start + offsets[k][1])
                cut_ids.append(n0 + k + 1)
        entry.ids = prefix_ids + tuple(new)
        entry.cuts, entry.cut_ids = cuts, cut_ids


def request_signature(tools: Any, tool_choice: Any) -> bytes | None:
    """Tools and tool_choice as bytes, or None when they are not plain JSON (then: no cache)."""
    try:
        return orjson.dumps([tools, tool_choice])
    except TypeError:
        return None


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


