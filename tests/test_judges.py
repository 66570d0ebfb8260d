"""Judges: vote parsing, majority, hint choice, teacher prompts, the rules judge, and the judge
clients over real HTTP on loopback (the judge model is the one thing faked: a tiny aiohttp app
that answers like an OpenAI-compatible server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from clawbridge.chat.renderer import Renderer
from clawbridge.config import Settings
from clawbridge.judges import (
    BackendJudgeClient,
    HintJudge,
    JudgeError,
    Judges,
    OpenAIJudgeClient,
    PRMJudge,
    RulesJudge,
    Teacher,
    TransientJudgeError,
    TurnContext,
    build_judges,
    teacher_messages,
)
from clawbridge.judges.hints import HINT_SYSTEM
from clawbridge.judges.prompts import INTERNAL_CONTEXT_MARKER, judge_messages, truncate
from clawbridge.judges.rules import classify
from clawbridge.judges.types import HintVote, Message
from clawbridge.judges.votes import (
    choose_hint,
    hint_candidates,
    parse_hint_vote,
    parse_vote,
    topk_overlap,
)
from clawbridge.types import Completion, SamplingParams

TURN = TurnContext(
    messages=[
        {"role": "system", "content": "You are a weather bot. " + "Be nice. " * 2000},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
    ],
    response={"role": "assistant", "content": "It is 64F and sunny in Paris."},
    next_state=[{"role": "user", "content": "[Sun 2026-11-22 08:47 UTC] No, I said Celsius please."}],
)


# --- vote parsing --------------------------------------------------------------------------------


def test_the_last_boxed_value_is_the_vote() -> None:
    vote = parse_vote(r"Scores are \boxed{1}, \boxed{0} or \boxed{-1}. The user corrects it: \boxed{-1}")
    assert (vote.value, vote.error) == (-1, None)


@pytest.mark.parametrize(("text", "value"), [
    (r"\boxed{1}", 1), (r"\boxed{+1}", 1), (r"\boxed{-1}", -1), (r"\boxed{0}", 0),
    (r"\boxed{ 1 }", 1), ("\\boxed{\u22121}", -1),  # U+2212, the minus sign some models write
])
def test_boxed_values_one_plus_one_minus_one_and_zero_parse(text: str, value: int | None) -> None:
    assert parse_vote(text).value == value


@pytest.mark.parametrize("text", [
    "", "I think it is good. Score: 1", r"\boxed{2}", r"\boxed{yes}", r"\boxed{0.5}",
    r"\boxed{1} on reflection \boxed{good}",  # the last box is malformed: no fallback to an earlier one
    r"\boxed{1",
])
def test_a_malformed_or_missing_box_is_a_failed_vote(text: str) -> None:
    vote = parse_vote(text)
    assert vote.value is None
    assert vote.error
    assert vote.raw_text == text


def test_a_positive_hint_vote_carries_its_hint() -> None:
    vote = parse_hint_vote("The user wanted Celsius.\n[HINT_START] Report temperatures in Celsius. [HINT_END]\n\\boxed{1}")
    assert (vote.value, vote.hint, vote.error) == (1, "Report temperatures in Celsius.", None)


def test_a_declined_hint_vote_has_no_hint_and_did_not_fail() -> None:
    vote = parse_hint_vote(r"Nothing to learn here. \boxed{-1}")
    assert (vote.value, vote.hint, vote.error) == (-1, None, None)


def test_a_positive_vote_without_a_hint_says_so() -> None:
    vote = parse_hint_vote(r"[HINT_START] unterminated \boxed{1}")
    assert vote.value == 1 and vote.hint is None and "without a hint" in (vote.error or "")


def hv(value: int | None, hint: str | None) -> HintVote:
    return HintVote(raw_text="", value=value, hint=hint)


def test_hints_are_kept_only_from_positive_votes_and_longer_than_ten_characters() -> None:
    votes = [
        hv(1, "Use Celsius."),  # 12 chars: kept
        hv(1, "Celsius!!!"),  # exactly 10: dropped
        hv(-1, "Answer in Celsius, always."),  # a decline: dropped
        hv(None, "Report temperatures in Celsius."),  # failed vote: dropped
        hv(1, "Report the temperature in Celsius."),
    ]
    assert hint_candidates(votes) == ["Use Celsius.", "Report the temperature in Celsius."]


def test_the_longest_hint_wins_and_ties_go_to_the_first() -> None:
    assert choose_hint(["short hint.", "the longest hint of all", "medium hint!"]) == "the longest hint of all"
    assert choose_hint(["aaaaaaaaaaaa", "bbbbbbbbbbbb"]) == "aaaaaaaaaaaa"
    assert choose_hint([]) is None


def test_scores_choose_the_hint_when_given() -> None:
    assert choose_hint(["a long long hint", "short one"], scores=[0.2, 0.9]) == "short one"
    with pytest.raises(ValueError):
        choose_hint(["x"], scores=[])


def test_topk_overlap_is_the_mean_shared_fraction() -> None:
    assert topk_overlap([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 9], [5, 6, 7, 8]]) == pytest.approx(0.75)
    assert topk_overlap([], []) == 0.0


# --- prompts and teacher messages ----------------------------------------------------------------


def test_the_prm_prompt_shows_request_response_and_next_state_with_long_parts_cut() -> None:
    system, user = judge_messages("prm", TURN)
    assert system["role"] == "system" and r"\boxed{-1}" in system["content"]
    text = user["content"]
    assert "## The user's request\nWhat's the weather in Paris?" in text
    assert 'weather({"city":"Paris"})' in text and "18C, sunny" in text
    assert "It is 64F and sunny in Paris." in text
    assert "No, I said Celsius please." in text
    assert "characters cut" in text and len(text) < 5000  # the 18 K system message was cut
    assert "$" not in text.replace("$$", "")  # every placeholder filled


def test_the_judge_never_sees_the_agents_internal_context_message() -> None:
    internal = {"role": "user", "content": [{"type": "text", "text": INTERNAL_CONTEXT_MARKER + " secret"}]}
    turn = TurnContext([*TURN.messages, internal], TURN.response, [*TURN.next_state, internal])
    _, user = judge_messages("hint", turn)
    assert "secret" not in user["content"] and "[HINT_START]" in user["content"]
    assert "## The user's request\nWhat's the weather in Paris?" in user["content"]


def test_truncate_keeps_head_and_tail() -> None:
    cut = truncate("A" * 100 + "Z" * 100, 30)
    assert cut.startswith("A" * 20) and cut.endswith("Z" * 10) and "170 characters cut" in cut


def test_the_hint_is_a_system_instruction_in_a_copy_of_the_prompt() -> None:
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "tool", "content": "18C"},
    ]
    before = json.dumps(messages)
    out = teacher_messages(messages, "Use Celsius.")
    assert out[0] == {"role": "system", "content": HINT_SYSTEM.format(hint="Use Celsius.")}
    assert out[1:] == messages  # everything else as it was
    assert json.dumps(messages) == before  # the original is untouched


def test_the_hint_joins_an_existing_system_message_even_one_of_parts() -> None:
    out = teacher_messages([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}], "Be brief.")
    assert out[0]["content"] == "You are terse.\n\n" + HINT_SYSTEM.format(hint="Be brief.") and len(out) == 2
    messages: list[Message] = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
                               {"role": "user", "content": "describe"}]
    out = teacher_messages(messages, "Be brief.")
    assert out[0]["content"][-1]["text"] == "\n\n" + HINT_SYSTEM.format(hint="Be brief.")
    assert messages[0]["content"] == [{"type": "text", "text": "You are terse."}]


# --- the rules judge -----------------------------------------------------------------------------

CORRECTIONS = [
    "No, I said Celsius, not Fahrenheit.",
    "[Sun 2026-11-22 08:47 UTC] no, that's the wrong file",
    "Nope",
    "That's wrong.",
    "that is not what I asked for",
    "Thats not right",
    "Actually, I meant the other repository.",
    "I said three bullet points.",
    "It should be 42, not 41.",
    "The answer should be in JSON",
    "Use a list comprehension instead.",
    "way too long, keep it to one line",
    "Can you make it shorter?",
    "Don't use emojis please",
    "Please do not add a summary at the end.",
    "Stop apologising.",
    "You forgot the unit tests.",
    "It doesn't work, I get a KeyError",
    "still failing with the same error",
    "Thanks, but that's incorrect: the capital is Canberra.",
    "Perfect, but make it more concise",
    "Why did you delete my file?",
    "not quite, the date is wrong",
    "there's a typo in the second line",
    "👎",
]
APPROVALS = [
    "thanks!",
    "[Sun 2026-11-22 08:47 UTC] Thank you, perfect.",
    "Perfect",
    "Great, now translate it to French",
    "exactly what I wanted",
    "That's correct.",
    "awesome, that works",
    "Well done 🎉",
    "👍",
    "Thanks! Can you also add a test?",
]
NEUTRAL = [
    "ok",
    "hmm",
    "What should I cook tonight?",
    "Is that correct?",
    "what exactly do you mean?",
    "No problem. Next: how tall is Everest?",
    "no thanks",
    "I don't know, maybe",
    "That should be fine",
    "Never mind, what time is it?",
    "Don't worry about it",
    "Can you fix this bug in my script?",
    "Not bad",
]


@pytest.mark.parametrize("text", CORRECTIONS)
def test_an_explicit_correction_gives_minus_one(text: str) -> None:
    verdict = classify(text)
    assert verdict.reward == -1, verdict
    assert verdict.rule.startswith("correction")


@pytest.mark.parametrize("text", APPROVALS)
def test_thanks_and_approval_give_plus_one_without_hint(text: str) -> None:
    verdict = classify(text)
    assert (verdict.reward, verdict.hint) == (1, None), verdict


@pytest.mark.parametrize("text", NEUTRAL)
def test_replies_that_are_not_feedback_give_zero(text: str) -> None:
    assert classify(text).reward == 0, classify(text)


def test_the_correction_text_is_the_hint_without_the_timestamp() -> None:
    verdict = classify("[Sun 2026-11-22 08:47 UTC]   No, I said   Celsius.")
    assert verdict.hint == "No, I said Celsius."
    assert classify("Nope, no.").hint is None  # too short to teach anything


def test_the_rules_judge_is_deterministic() -> None:
    assert all(classify(t) == classify(t) for t in CORRECTIONS + APPROVALS + NEUTRAL)


async def test_the_rules_judge_gives_reward_and_hint_through_the_judge_interface() -> None:
    rules = RulesJudge()
    judgment = await rules.judge(TURN)
    assert (judgment.reward, judgment.failed, judgment.judge) == (-1, 0, "rules")
    assert "correction: no" in judgment.votes[0].raw_text
    hint = await rules.hint(TURN)
    assert hint.accepted and hint.hint == "No, I said Celsius please." and hint.judge == "rules"


async def test_tool_results_alone_are_no_feedback_for_the_rules_judge() -> None:
    turn = TurnContext(TURN.messages, TURN.response, [{"role": "tool", "content": "Error: wrong city"}])
    judgment = await RulesJudge().judge(turn)
    assert judgment.reward == 0 and "no user message" in judgment.votes[0].raw_text
    assert not (await RulesJudge().hint(turn)).accepted


# --- model judges over a scripted judge model ------------------------------------------------------


@dataclass
class ScriptedJudgeModel:
    """Stands in for a judge model (the one thing outside this machine): answers in order."""

    answers: list[str | Exception]
    name: str = "scripted"
    seeds: list[int | None] = field(default_factory=list)

    async def complete(
        self, messages: Sequence[Message], *, temperature: float, max_tokens: int, seed: int | None = None
    ) -> str:
        self.seeds.append(seed)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_prm_majority_of_three_votes_with_every_vote_kept() -> None:
    model = ScriptedJudgeModel([r"good \boxed{1}", r"bad \boxed{-1}", r"\boxed{1}"])
    judgment = await PRMJudge(model, votes=3).judge(TURN)
    assert (judgment.reward, judgment.failed, judgment.judge) == (1, 0, "prm:scripted")
    assert [v.raw_text for v in judgment.votes] == [r"good \boxed{1}", r"bad \boxed{-1}", r"\boxed{1}"]
    assert sorted(s for s in model.seeds if s is not None) == [0, 1, 2]  # votes differ by seed


async def test_prm_failed_votes_are_counted_and_a_tie_gives_zero() -> None:
    model = ScriptedJudgeModel([r"\boxed{1}", "no score", JudgeError("401 bad key"), r"\boxed{-1}"])
    judgment = await PRMJudge(model, votes=4).judge(TURN)
    assert (judgment.reward, judgment.failed) == (0, 2)
    assert "401 bad key" in (judgment.votes[2].error or "")


async def test_prm_with_every_vote_failing_gives_zero() -> None:
    judgment = await PRMJudge(ScriptedJudgeModel(["?", "?", "?"])).judge(TURN)
    assert (judgment.reward, judgment.failed) == (0, 3)


async def test_hint_judge_keeps_the_longest_positive_hint() -> None:
    model = ScriptedJudgeModel([
        r"[HINT_START]Use Celsius.[HINT_END] \boxed{1}",
        r"[HINT_START]Report temperatures in Celsius, as the user asked.[HINT_END] \boxed{1}",
        r"[HINT_START]Never answer in Fahrenheit or Kelvin, whatever the tool says.[HINT_END] \boxed{-1}",
    ])
    result = await HintJudge(model, votes=3).hint(TURN)
    assert result.hint == "Report temperatures in Celsius, as the user asked."
    assert result.candidates == ("Use Celsius.", "Report temperatures in Celsius, as the user asked.")
    assert result.accepted and result.failed == 0 and len(result.votes) == 3


async def test_hint_judge_with_only_declines_accepts_no_hint() -> None:
    result = await HintJudge(ScriptedJudgeModel([r"\boxed{-1}", r"[HINT_START]short[HINT_END]\boxed{1}"]), votes=2).hint(TURN)
    assert not result.accepted and result.candidates == ()


async def test_hint_judge_overlap_selection_uses_the_scorer() -> None:
    model = ScriptedJudgeModel([
        r"[HINT_START]A long hint that rewrites the answer entirely.[HINT_END]\boxed{1}",
        r"[HINT_START]Use Celsius units.[HINT_END]\boxed{1}",
    ])
    scored: list[str] = []

    async def overlap(turn: TurnContext, hint: str) -> float:
        scored.append(hint)
        return 0.9 if "Celsius" in hint else 0.1

    result = await HintJudge(model, votes=2, selection="overlap", scorer=overlap).hint(TURN)
    assert result.hint == "Use Celsius units." and len(scored) == 2


def test_overlap_selection_without_a_scorer_is_refused() -> None:
    with pytest.raises(ValueError, match="scorer"):
        HintJudge(ScriptedJudgeModel([]), selection="overlap")


async def test_judges_run_only_what_the_method_needs() -> None:
    from clawbridge.learning.collector import judge_kinds

    rules = RulesJudge()
    judges = Judges(reward=rules, hint=rules)
    judgment, hint = await judges.run(TURN, judge_kinds("binary"))
    assert judgment is not None and hint is None
    judgment, hint = await judges.run(TURN, judge_kinds("opd"))
    assert judgment is None and hint is not None
    judgment, hint = await judges.run(TURN, judge_kinds("combine"))
    assert judgment is not None and judgment.reward == -1 and hint is not None and hint.accepted


async def test_auto_picks_the_rules_judge_offline_and_http_with_an_endpoint() -> None:
    offline = build_judges(Settings().judging, seed=0)
    assert isinstance(offline.reward, RulesJudge) and offline.hint is offline.reward
    online = build_judges(Settings(judge_url="http://127.0.0.1:9/v1", judge_model="judge", prm_votes=5).judging, seed=0)
    assert isinstance(online.reward, PRMJudge) and online.reward.votes == 5
    assert online.reward.name == "prm:http:judge"
    assert online.reward.client is online.hint.client  # type: ignore[attr-defined]  # one pool
    await online.aclose()
    await offline.aclose()
    overlap = Settings(judge_url="http://127.0.0.1:9/v1", judge_model="judge", hint_selection="overlap")
    assert build_judges(overlap.judging, seed=0).hint.selection == "longest"  # type: ignore[attr-defined]  # no teacher

    async def scorer(turn: TurnContext, hint: str) -> float:
        return 0.0

    assert build_judges(overlap.judging, seed=0, scorer=scorer).hint.selection == "overlap"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="judge-model"):
        build_judges(Settings(judge="http", judge_url="http://127.0.0.1:9/v1").judging, seed=0)
    with pytest.raises(ValueError, match="backend"):
        build_judges(Settings(judge="backend").judging, seed=0)


async def test_the_backend_judge_uses_the_stacks_judge_server_where_it_has_one() -> None:
    from clawbridge.judges.clients import BackendJudgeClient, OpenAIJudgeClient

    stack = SimpleNamespace(judge_endpoint=("http://127.0.0.1:9/v1", "prm-model"))  # the GPU stack's PRM server
    judges = build_judges(Settings(judge="backend").judging, stack, seed=0)  # type: ignore[arg-type]
    client = judges.reward.client  # type: ignore[attr-defined]
    assert isinstance(client, OpenAIJudgeClient) and judges.hint.client is client  # type: ignore[attr-defined]
    assert client.url == "http://127.0.0.1:9/v1/chat/completions" and client.model == "prm-model"
    await judges.aclose()
    plain = build_judges(Settings(judge="backend").judging, SimpleNamespace(model_name="policy"), seed=0,  # type: ignore[arg-type]
                         renderer=SimpleNamespace())  # type: ignore[arg-type]
    assert isinstance(plain.reward.client, BackendJudgeClient)  # type: ignore[attr-defined]


# --- the HTTP client against a live server on loopback ----------------------------------------------


@dataclass
class JudgeServer:
    base_url: str
    script: list[tuple[int, Any, dict[str, str], float]]  # status, body, headers, delay
    received: list[tuple[dict[str, str], dict[str, Any]]]


def chat_completion(text: str | None, **message: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "judge",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text, **message}}],
    }


@pytest.fixture
async def judge_server() -> AsyncIterator[JudgeServer]:
    script: list[tuple[int, Any, dict[str, str], float]] = []
    received: list[tuple[dict[str, str], dict[str, Any]]] = []

    async def handle(request: web.Request) -> web.Response:
        received.append((dict(request.headers), await request.json()))
        status, body, headers, delay = script.pop(0) if script else (200, chat_completion(r"\boxed{1}"), {}, 0.0)
        if delay:
            await asyncio.sleep(delay)
        return web.json_response(body, status=status, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield JudgeServer(f"http://{host}:{port}/v1", script, received)
    finally:
        await runner.cleanup()


def fast_client(server: JudgeServer, **kw: Any) -> OpenAIJudgeClient:
    return OpenAIJudgeClient(server.base_url, "judge", "sk-test", backoff_s=0.01, max_backoff_s=0.05, **kw)


async def test_http_client_sends_an_openai_request_and_returns_the_content(judge_server: JudgeServer) -> None:
    judge_server.script.append((200, chat_completion(r"fine \boxed{0}"), {}, 0.0))
    client = fast_client(judge_server)
    try:
        text = await client.complete([{"role": "user", "content": "hi"}], temperature=0.7, max_tokens=64, seed=3)
    finally:
        await client.aclose()
    assert text == r"fine \boxed{0}"
    headers, body = judge_server.received[0]
    assert headers["Authorization"] == "Bearer sk-test"
    assert body == {"model": "judge", "messages": [{"role": "user", "content": "hi"}],
                    "temperature": 0.7, "max_tokens": 64, "seed": 3}


async def test_http_client_reads_reasoning_content_when_content_is_empty(judge_server: JudgeServer) -> None:
    judge_server.script.append((200, chat_completion(None, reasoning_content=r"\boxed{-1}"), {}, 0.0))
    client = fast_client(judge_server)
    try:
        assert await client.complete([], temperature=0, max_tokens=8) == r"\boxed{-1}"
    finally:
        await client.aclose()


async def test_http_client_retries_a_rate_limit_then_succeeds(judge_server: JudgeServer) -> None:
    judge_server.script += [
        (429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}, 0.0),
        (429, {"error": {"message": "slow down"}}, {}, 0.0),
        (200, chat_completion(r"\boxed{1}"), {}, 0.0),
    ]
    client = fast_client(judge_server)
    try:
        assert await client.complete([], temperature=0, max_tokens=8) == r"\boxed{1}"
    finally:
        await client.aclose()
    assert len(judge_server.received) == 3


async def test_http_client_gives_up_after_repeated_server_errors(judge_server: JudgeServer) -> None:
    judge_server.script += [(500, {"error": {"message": "boom"}}, {}, 0.0)] * 3
    client = fast_client(judge_server, attempts=3)
    try:
        with pytest.raises(TransientJudgeError, match="500"):
            await client.complete([], temperature=0, max_tokens=8)
    finally:
        await client.aclose()
    assert len(judge_server.received) == 3


async def test_http_client_never_retries_a_client_error(judge_server: JudgeServer) -> None:
    judge_server.script.append((401, {"error": {"message": "bad key"}}, {}, 0.0))
    client = fast_client(judge_server)
    try:
        with pytest.raises(JudgeError, match="401") as info:
            await client.complete([], temperature=0, max_tokens=8)
    finally:
        await client.aclose()
    assert not isinstance(info.value, TransientJudgeError)
    assert len(judge_server.received) == 1


async def test_http_client_retries_a_timeout(judge_server: JudgeServer) -> None:
    judge_server.script += [(200, chat_completion(r"\boxed{1}"), {}, 2.0), (200, chat_completion(r"\boxed{-1}"), {}, 0.0)]
    client = fast_client(judge_server, timeout_s=0.3)
    try:
        assert await client.complete([], temperature=0, max_tokens=8) == r"\boxed{-1}"
    finally:
        await client.aclose()


async def test_http_client_retries_a_refused_connection_then_fails() -> None:
    client = OpenAIJudgeClient("http://127.0.0.1:9/v1", "judge", attempts=2, backoff_s=0.01)
    try:
        with pytest.raises(TransientJudgeError, match="ConnectError"):
            await client.complete([], temperature=0, max_tokens=8)
    finally:
        await client.aclose()


async def test_prm_judge_over_http_votes_concurrently_and_survives_a_failed_vote(judge_server: JudgeServer) -> None:
    judge_server.script += [
        (200, chat_completion(r"\boxed{-1}"), {}, 0.0),
        (400, {"error": {"message": "context too long"}}, {}, 0.0),
        (200, chat_completion(r"the user corrects it \boxed{-1}"), {}, 0.0),
    ]
    client = fast_client(judge_server)
    try:
        judgment = await PRMJudge(client, votes=3).judge(TURN)
    finally:
        await client.aclose()
    assert (judgment.reward, judgment.failed, judgment.judge) == (-1, 1, "prm:http:judge")
    assert sorted(body["seed"] for _, body in judge_server.received) == [0, 1, 2]
    assert "No, I said Celsius please." in judge_server.received[0][1]["messages"][1]["content"]


# --- the backend client ------------------------------------------------------------------------------


class AnsweringBackend:
    """Stands in for a judge model served by a backend: samples a fixed answer, with the real
    tokenizer, and records what it was asked."""

    name = "answering"
    model_name = "judge-model"
    context_length = 32768

    def __init__(self, tokenizer: Any, answer: str) -> None:
        self._tok = tokenizer
        self.answer = tuple(tokenizer.encode(answer, add_special_tokens=False))
        self.answer += (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self.calls: list[tuple[list[int], SamplingParams, int | None, str]] = []

    def tokenizer(self) -> Any:
        return self._tok

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, version: int | None = None,
        priority: str = "user",
    ) -> list[Completion]:
        self.calls.append((list(prompt_ids), params, version, priority))
        return [Completion(self.answer, (-0.1,) * len(self.answer), "stop", 0)]


async def test_backend_client_renders_the_chat_and_samples_the_frozen_base(tokenizer: Any) -> None:
    backend = AnsweringBackend(tokenizer, r"The user corrects the unit. \boxed{-1}")
    client = BackendJudgeClient(backend, Renderer(tokenizer), version=0)  # type: ignore[arg-type]
    judgment = await PRMJudge(client, votes=2).judge(TURN)
    assert judgment.reward == -1 and judgment.judge == "prm:backend:judge-model@v0"
    prompt, params, version, priority = backend.calls[0]
    assert version == 0 and params.temperature == 0.7 and params.max_tokens == 1024
    assert priority == "background"  # a judge on the serving backend waits behind the user
    text = tokenizer.decode(prompt)
    assert "process reward model" in text and text.rstrip().endswith("assistant")
    assert params.stop_token_ids  # the template's end-of-turn token stops the judge



# --- the teacher and the backend judge on the real local engine (tiny random model) ------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny_backend(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    from clawbridge.backends.local import LocalBackend

    backend = LocalBackend("tiny-random", data_dir=tmp_path_factory.mktemp("tiny"), lora_rank=4, lora_alpha=4)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture(scope="module")
def renderer(tiny_backend: Any) -> Any:
    return Renderer(tiny_backend.tokenizer())


SHORT = [{"role": "system", "content": "You are a weather bot."}, *TURN.messages[1:]]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_teacher_scores_the_students_tokens_under_the_hinted_prompt(tiny_backend: Any, renderer: Any) -> None:
    completion = tuple(tiny_backend.tokenizer().encode("It is 18C and sunny.", add_special_tokens=False))
    student = await tiny_backend.score(renderer.render(SHORT), completion, model="base")
    turn = TurnContext(SHORT, TURN.response, TURN.next_state, completion_ids=completion, logprobs=tuple(student))
    teacher = Teacher(tiny_backend, renderer, model="base")

    lp = await teacher.logprobs(turn, "Answer in Celsius.")
    hinted = renderer.render(teacher_messages(SHORT, "Answer in Celsius."))
    assert lp == await tiny_backend.score(hinted, completion, model="base")
    assert len(lp) == len(completion) and lp != student  # the hint changed the teacher's view
    assert await teacher.logprobs(turn, "Answer in Celsius.") is lp  # cached: one score per hint

    agreement = await teacher.agreement(turn, "Answer in Celsius.")
    assert -1.0 <= agreement < 0.0
    same = TurnContext(SHORT, TURN.response, TURN.next_state, completion_ids=completion, logprobs=tuple(lp))
    assert await teacher.agreement(same, "Answer in Celsius.") == 0.0


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_backend_judge_on_the_local_engine_counts_nonsense_as_failed_votes(
    tiny_backend: Any, renderer: Any
) -> None:
    client = BackendJudgeClient(tiny_backend, renderer, version=0)
    turn = TurnContext(SHORT, TURN.response, TURN.next_state)
    judgment = await PRMJudge(client, votes=2, max_tokens=8).judge(turn)
    assert judgment.judge == "prm:backend:tiny-random@v0"
    assert (judgment.reward, judgment.failed) == (0, 2)  # random weights never box a score
    assert all(v.raw_text for v in judgment.votes)


async def test_the_rules_judge_reads_multipart_user_replies_and_skips_the_internal_context() -> None:
    reply = {"role": "user", "content": [{"type": "text", "text": "[Sun 2026-11-22 08:47 UTC] too verbose, one line please"}]}
    internal = {"role": "user", "content": [{"type": "text", "text": INTERNAL_CONTEXT_MARKER + " thanks perfect"}]}
    turn = TurnContext(TURN.messages, TURN.response, [reply, internal])
    judgment = await RulesJudge().judge(turn)
    assert judgment.reward == -1
    assert (await RulesJudge().hint(turn)).hint == "too verbose, one line please"
