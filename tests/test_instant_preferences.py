"""The preference now: a real server on loopback (tiny model, the offline rules judge, the learner's
collector) and the real `openai` client. A correction heard twice is served at once as a system
instruction in the next request's prompt, and the captured turn records it; never with
`X-Instructions: off`, on a side turn or after a tool result; forgetting it stops it at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from clawbridge.chat.instructions import instructed
from clawbridge.chat.renderer import Renderer
from clawbridge.config import Settings
from clawbridge.serving import instructing
from clawbridge.serving.wire import APIError
from clawbridge.store import StoredTurn
from live_server import LiveServer, with_learner

MODEL = "tiny-random"
CORRECTION = "Too long. Answer in one short sentence."
SERVED = f"The user's standing preferences; follow them in every answer:\n{CORRECTION}"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # a batch never filled: the collector hears and judges, nothing trains
    settings = Settings(model=MODEL, port=0, data_dir=tmp_path_factory.mktemp("now"), default_max_tokens=6,
                        judge="rules", gate="off", batch_size=10_000, lora_rank=4, lora_alpha=4)
    with with_learner(settings) as server:
        yield server


class User:
    def __init__(self, live: LiveServer) -> None:
        self.live = live
        self.client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        self.tok = live.backend.tokenizer()

    def ask(self, sid: str, messages: list[dict[str, Any]], **headers: str) -> str:
        r = self.client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                extra_headers={"X-Session-Id": sid, **headers})
        self.live.settle()
        return r.choices[0].message.content or ""

    def turn(self, sid: str, turn_type: str = "main") -> StoredTurn:
        store = self.live.running.store  # type: ignore[union-attr]
        found = store.last_turn(sid, turn_type)
        assert found is not None
        return found

    def prompt(self, turn: StoredTurn) -> str:
        return str(self.tok.decode(list(turn.prompt_ids)))

    def served(self, sid: str, messages: list[dict[str, Any]], turn_type: str = "main", **headers: str) -> str | None:
        """Ask, then the instruction the captured turn was served with (checked against its prompt)."""
        self.ask(sid, messages, **headers)
        turn = self.turn(sid, turn_type)
        assert turn.messages == messages  # the client's messages as sent
        assert (SERVED in self.prompt(turn)) == (turn.instruction is not None)
        return turn.instruction


def wait_for(cond: Any, what: str, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.1)


def test_a_correction_heard_twice_is_served_at_once_where_a_user_talks_and_forget_stops_it(live: LiveServer) -> None:
    user, proxy = User(live), live.proxy
    store = live.running.store  # type: ignore[union-attr]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is rain?"}]
    for _ in range(2):
        msgs += [{"role": "assistant", "content": user.ask("corrected", msgs)}, {"role": "user", "content": CORRECTION}]
    user.ask("corrected", msgs)  # carries the second correction: the first turn's was heard already
    wait_for(lambda: [p.state for p in store.preferences()] == ["applied"], "the correction was not applied")
    [p] = store.preferences()
    assert (p.text, p.count, p.kind) == (CORRECTION, 2, "length")
    wait_for(lambda: proxy.standing.text == CORRECTION, "the proxy does not serve it")

    # the next request of any conversation is served with it, and its turn records it
    question = [{"role": "user", "content": "What is snow?"}]
    assert user.served("next", question) == CORRECTION
    # the weights alone, a side turn, a tool result: never
    assert user.served("off", question, **{"X-Instructions": "off"}) is None
    assert user.served("side", question, "side", **{"X-Turn-Type": "side"}) is None
    tool = [question[0], {"role": "assistant", "tool_calls": [
        {"id": "call1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "snow is frozen water"}]
    assert user.served("tool", tool) is None
    proxy.standing.enabled = False  # instant_preferences: false (the setting the proxy is built with)
    assert user.served("disabled", question) is None
    proxy.standing.enabled = True
    with pytest.raises(openai.BadRequestError, match="X-Instructions"):
        user.ask("bad", question, **{"X-Instructions": "maybe"})
    with httpx.Client(base_url=live.url, timeout=30) as h:
        assert "clawbridge_preferences_applied 1.0" in h.get("/metrics").text
        assert h.get("/v1/status").json()["instruction"] == CORRECTION
        listed = h.get("/v1/preferences").json()["data"]
        assert [(x["id"], x["state"], x["kind"], x["count"]) for x in listed] == [(1, "applied", "length", 2)]

        # forget: the instruction stops at once, its samples not trained yet are dropped
        out = h.post("/v1/admin/preferences/1/forget")
        assert out.status_code == 200, out.text
        body = out.json()
        assert body["state"] == "dropped" and body["instruction"] is None and body["samples_dropped"] >= 1
        assert body["rollback_command"] is None  # v0 serves: nothing trained since it was first heard
        assert user.served("after-forget", question) is None
        assert "clawbridge_preferences_applied 0.0" in h.get("/metrics").text

        # confirm: applied again at once; an unknown one is a clear 404
        assert h.post("/v1/admin/preferences/1/confirm").json()["state"] == "applied"
        assert user.served("confirmed", question) == CORRECTION
        missing = h.post("/v1/admin/preferences/9/confirm")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "preference_not_found"

    # the same from the command line, against the running server
    from clawbridge.cli.main import app
    from typer.testing import CliRunner

    forgot = CliRunner().invoke(app, ["preferences", "forget", "1", "--url", live.url])
    assert forgot.exit_code == 0 and "#1 is dropped" in forgot.output, forgot.output
    assert proxy.standing.text is None
    confirmed = CliRunner().invoke(app, ["preferences", "confirm", "1", "--url", live.url])
    assert confirmed.exit_code == 0 and "#1 is applied" in confirmed.output and proxy.standing.text == CORRECTION
    unknown = CliRunner().invoke(app, ["preferences", "forget", "7", "--url", live.url])
    assert unknown.exit_code == 1 and "No preference 7" in unknown.output
    listed = CliRunner().invoke(app, ["preferences", "--data-dir", str(live.settings.data_dir)], env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and "applied" in listed.output and f"served as an instruction now: {CORRECTION}" in listed.output


def test_a_prompt_that_fits_only_without_the_instruction_is_served_without_it(tokenizer: Any) -> None:
    renderer = Renderer(tokenizer)
    messages = [{"role": "user", "content": "What is snow?"}]
    plain = renderer.render(messages)
    with_it = renderer.render(instructed(messages, CORRECTION))
    for context, served in ((len(with_it) + 1, CORRECTION), (len(with_it), None), (len(plain) + 1, None)):
        ids, instruction = instructing.render(lambda ms, c=context: renderer.render(ms, limit=c), messages, CORRECTION,
                                              context)
        assert instruction == served and ids == (with_it if served else plain), context


def test_which_requests_get_the_instruction() -> None:
    user = [{"role": "user", "content": "Hi"}]
    tool = [*user, {"role": "tool", "tool_call_id": "c", "content": "x"}]
    assert instructing.chosen(user, "main", None, True, CORRECTION) == CORRECTION
    assert instructing.chosen(user, "main", "on", True, CORRECTION) == CORRECTION
    assert instructing.chosen(user, "main", "off", True, CORRECTION) is None
    assert instructing.chosen(user, "side", None, True, CORRECTION) is None
    assert instructing.chosen(tool, "main", None, True, CORRECTION) is None
    internal = {"role": "user", "content": [{"type": "text", "text": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ..."}]}
    assert instructing.chosen([*tool, internal], "main", None, True, CORRECTION) is None  # OpenClaw after a tool
    assert instructing.chosen([*user, internal], "main", None, True, CORRECTION) == CORRECTION
    assert instructing.chosen(user, "main", None, False, CORRECTION) is None  # instant_preferences off
    assert instructing.chosen(user, "main", None, True, None) is None
    with pytest.raises(APIError, match="X-Instructions"):
        instructing.chosen(user, "main", "sometimes", True, CORRECTION)
