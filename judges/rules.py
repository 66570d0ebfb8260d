"""The offline rules judge: the default when no judge model is configured (docs/design.md#judges).

It reads only what the user says next, and only explicit feedback:

1. The text is the user messages of the next state (tool results are not feedback to it: a tool
   error may be the environment's fault, which a model judge can tell and a rule cannot). An
   agent's timestamp prefix (`[Sun 2026-11-22 08:47 UTC] `) and its internal-context message are
   dropped; case, curly quotes and spacing are normalised.
2. Harmless phrases that look like feedback are neutralised first: "no problem", "no worries",
   "don't worry", "no thanks", "nothing wrong", "never mind", "that should be fine", "I don't know", ...
3. A correction anywhere gives -1, and the user's own words become the hint (when longer than
   10 characters). Corrections: a leading "no"/"nope"; "wrong", "incorrect", "not right",
   "not what I ..."; "that's not", "it isn't"; "actually"; "I said/asked for/meant/told you";
   "you/it/the answer should ...", "should be", "supposed to"; "instead", "rather than"; "too long/short/verbose/..."; "shorter",
   "more concise", ...; "don't ..."/"do not"/"stop"/"never" as an instruction; "you forgot/missed/
   didn't ..."; "doesn't work", "broken"; "try again", "fix it", "rewrite that", "mistake", "typo";
   "why did you"; 👎.
4. Otherwise approval, in a sentence that is not a question, gives +1 with no hint: "thanks", "thank you", "perfect", "great",
   "exactly", "correct", "that's right", "awesome", "nice", "well done", "works", "helpful",
   "spot on", "exactly what I wanted", 👍 🙏 ✅ 🎉 ...
5. Otherwise 0: "ok", "yes", a new question — not evidence either way.

A correction outranks approval ("thanks, but that's wrong" is -1). Deterministic: the same text
always gives the same verdict, and the verdict names the rule that fired.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clawbridge.judges.prompts import INTERNAL_CONTEXT_MARKER, message_text
from clawbridge.judges.types import HintJudgment, HintVote, Judgment, TurnContext, Vote
from clawbridge.judges.votes import MIN_HINT_CHARS

HINT_CHARS = 600  # the user's words kept as a hint

_TIMESTAMP = re.compile(r"^\s*\[[^\]\n]{0,40}\d{4}-\d{2}-\d{2}[^\]\n]{0,40}\]\s*")

_NEUTRAL = [
    r"\bno (problem|worries|rush|doubt|need)\b",
    r"\bno,? thanks?( you)?\b",
    r"\bnot a problem\b",
    r"\bnothing (is )?wrong\b",
    r"\bcan't go wrong\b",
    r"\bnot bad\b",
    r"\b(don't|do not) (worry|mind|care)\b",
    r"\bi (don't|do not) (know|think so|mind)\b",
    r"\bnever ?mind\b",
    r"\b(doesn't|does not) matter\b",
    r"\b(should|would|will) (be|work) (just )?(fine|ok|okay|good|great|enough|perfectly)\b",
    r"\bthat should (do it|work)\b",
]

# Verbs that tell the assistant how to answer, at the start of a sentence ("Keep it brief."),
# after "please", or in a request ("Could you format that as a table?").
_HOW = (r"(always|never|keep|make|end|start|begin|finish|reply|respond|answer|use|write|format|include|add|"
        r"sign|say|stick|limit|avoid|cite|remember|give me (just|only|a|an|the)|put|list|shorten|simplify|"
        r"rephrase|summari[sz]e|explain (it|that|this) (again|more|less|in|like|simply)|be (more|less|brief|concise|short|clear|specific|direct))")
_INSTRUCTION = (rf"(^|[.!?;:]\s*)(please\s+|pls\s+|kindly\s+)?{_HOW}\b"
                rf"|\bplease\s+{_HOW}\b"
                rf"|\b(can|could|would|will) you( please)? {_HOW}\b")

_CORRECTIONS: list[tuple[str, str]] = [
    ("no", r"^(no|nope|nah|wrong)\b"),
    ("wrong", r"\b(wrong|incorrect|inaccurate|mistaken)\b"),
    ("not right", r"\bnot (right|correct|accurate|true|quite|exactly|it|helpful|great|good|perfect|what i|what you)\b"),
    ("that's not", r"\b(that|this|it)('s| is|s| was)? not\b"),
    ("isn't", r"\b(that|this|it) (isn't|wasn't|doesn't|didn't)\b"),
    ("actually", r"^actually\b|\bactually,"),
    ("i said", r"\bi (said|asked for|asked you|meant|told you|specifically|already (said|told|asked)|was asking)\b"),
    ("should", r"\b(you|it|that|this|there|answer|result|output|response|code|format) (should|shouldn't|should've|must|was supposed to|is supposed to|needs to|need to|have to)\b|\bshould (be|have been|use|say|include|return)\b"),
    ("instead", r"\binstead\b|\brather than\b"),
    ("too much", r"\btoo (long|short|verbose|wordy|formal|informal|casual|complicated|complex|vague|generic|technical|much|many|few|little|slow|brief|detailed)\b"),
    ("style", r"\b(shorter|longer|more concise|less verbose|more detail(ed)?|less detail(ed)?|simpler|more formal|less formal|more specific|briefer)\b"),
    ("don't", r"(^|[.!?;:,]\s*)(please\s+)?(don't|do not|stop|quit)\b|\b(don't|do not|never) (use|say|add|include|write|do|give|make|start|put|call|mention|repeat|change|ask|answer|reply|respond|be)\b"),
    ("you forgot", r"\byou (forgot|missed|ignored|misunderstood|misread|didn't|did not|haven't|have not|left out|skipped|keep|made (a|an) (mistake|error))\b"),
    ("broken", r"\b(doesn't|does not|didn't|did not|won't|isn't|is not) work(ing)?\b|\bnot working\b|\bbroken\b|\bbroke\b|\bstill (fails|failing|wrong|broken|not)\b"),
    ("redo", r"\b(try again|start over|(fix|redo|re-do|rewrite) (it|that|your \w+)|please fix|mistake|typo)\b|^(please )?correct (it|this|that|the)\b"),
    ("why did you", r"\bwhy (did|would|do) you\b"),
    ("off topic", r"\brambling\b|\b(get|come|stick) to the point\b|\boff[- ]topic\b|\birrelevant\b|\b(doesn't|does not|didn't|did not|don't|do not|never) (really )?answer\b|\bnot (an|the) answer\b|\banswer (the|my) (actual )?question\b|\bnot what i (asked|wanted|meant|need)"),
    # A request about how to answer is a correction too: the user wants something the answer lacks.
    ("instruction", _INSTRUCTION),
    ("preference", r"\bi('d| would) (like|prefer|rather|want)\b|\b(answers?|replies|words?|sentences?) only\b|\bi (only )?(prefer|want|need) (it|that|this|the answer|answers|your answers?|a |an |you to|shorter|longer|simpler|just|only|less|more)\b|\b(next time|from now on|in (the )?future|going forward|every (time|answer|reply))\b"),
    ("thumbs down", r"👎|❌"),
]

_APPROVALS: list[tuple[str, str]] = [
    ("thanks", r"\b(thanks|thank you|thank u|thx|ty|cheers|much appreciated|appreciate it)\b"),
    ("perfect", r"\b(perfect|great|exactly|excellent|awesome|amazing|fantastic|wonderful|brilliant|nice|lovely)\b"),
    ("correct", r"\b(correct|that's right|that is right|spot on|nailed it|bingo|that's it|that is it)\b"),
    ("what i wanted", r"\b(exactly|just) what i (wanted|needed|asked for|meant)\b"),
    ("well done", r"\b(good job|well done|good work|great job|nice work|love it|love this)\b"),
    ("works", r"\b(works|worked|working now|fixed|solved|helpful|useful|that helps|that helped|good (stuff|answer|one))\b"),
    ("thumbs up", r"👍|🙏|✅|🎉|❤️|🙌|💯|😊"),
]

_NEUTRAL_RE = re.compile("|".join(_NEUTRAL))
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")
_CORRECTION_RES = [(name, re.compile(p)) for name, p in _CORRECTIONS]
_APPROVAL_RES = [(name, re.compile(p)) for name, p in _APPROVALS]


@dataclass(frozen=True)
class RuleVerdict:
    reward: int
    hint: str | None
    rule: str  # "correction: too much", "approval: thanks", "none", "no user message"
    matched: str | None = None  # the words that fired the rule


def clean(text: str) -> str:
    """The user's words as written, minus the agent's timestamp prefix and extra spacing."""
    text = _TIMESTAMP.sub("", text)
    return re.sub(r"\s+", " ", text).strip()


def _normalise(text: str) -> str:
    text = text.lower().replace("\u2019", "'").replace("\u2018", "'")
    return _NEUTRAL_RE.sub(" ~ ", text)


def classify(text: str) -> RuleVerdict:
    """The verdict on one user reply (pure)."""
    words = clean(text)
    normal = _normalise(words)
    for name, pattern in _CORRECTION_RES:
        m = pattern.search(normal)
        if m:
            hint = words[:HINT_CHARS] if len(words) > MIN_HINT_CHARS else None
            return RuleVerdict(-1, hint, f"correction: {name}", m.group(0).strip(" .!?;:,"))
    # a question is not approval: "is that correct?", "what exactly do you mean?"
    statements = " | ".join(s for s in _SENTENCE.findall(normal) if not s.rstrip().endswith("?"))
    for name, pattern in _APPROVAL_RES:
        m = pattern.search(statements)
        if m:
            return RuleVerdict(1, None, f"approval: {name}", m.group(0))
    return RuleVerdict(0, None, "none")


def user_reply(turn: TurnContext) -> str | None:
    """The user's words in the next state (None: the next state holds no user message)."""
    texts = [
        message_text(m)
        for m in turn.next_state
        if m.get("role") == "user" and INTERNAL_CONTEXT_MARKER not in message_text(m)
    ]
    return "\n".join(texts) if texts else None


def verdict(turn: TurnContext) -> RuleVerdict:
    reply = user_reply(turn)
    if reply is None:
        return RuleVerdict(0, None, "no user message")
    return classify(reply)


def _explain(v: RuleVerdict) -> str:
    fired = f" on {v.matched!r}" if v.matched else ""
    return f"rules: {v.rule}{fired} -> {v.reward:+d}"


class RulesJudge:
    """Both judge roles from explicit feedback: `judge` gives the reward, `hint` the
    correction as a hint. Same interface as PRMJudge and HintJudge."""

    name = "rules"

    async def judge(self, turn: TurnContext) -> Judgment:
        v = verdict(turn)
        vote = Vote(raw_text=_explain(v), value=v.reward)
        return Judgment(reward=v.reward, votes=(vote,), failed=0, judge=self.name)

    async def hint(self, turn: TurnContext) -> HintJudgment:
        v = verdict(turn)
        vote = HintVote(raw_text=_explain(v), value=1 if v.hint else -1, hint=v.hint)
        candidates = (v.hint,) if v.hint else ()
        return HintJudgment(hint=v.hint, votes=(vote,), candidates=candidates, failed=0, judge=self.name)
