"""The SDK client against a live server: sessions are preconfigured openai clients that tag their
requests; leaving a session marks it done; models and status read the server."""

from __future__ import annotations

import clawbridge
import pytest
from clawbridge.config import Settings
from clawbridge.server import build_backend
from live_server import LiveServer

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    settings = Settings(model=MODEL, port=0, data_dir=tmp_path_factory.mktemp("client"), train=False,
                        default_max_tokens=8)
    server = LiveServer(settings, build_backend(settings)).start()
    yield server
    server.stop()


def test_models_and_status(live: LiveServer):
    cb = clawbridge.Client(f"{live.url}/v1")  # a /v1 suffix is tolerated
    assert cb.models() == [MODEL]
    status = cb.status()
    assert status["model"] == MODEL and status["version"] == 0 and "store" in status


def test_session_tags_every_request_and_done_closes_it(live: LiveServer):
    cb = clawbridge.Client(live.url)
    with cb.session(user="alice") as chat:
        msgs = [{"role": "user", "content": "hi"}]
        r = chat.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "thanks"}]
        chat.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        sid = chat.session_id
        assert sid.startswith("alice-")
    store = live.running.store  # type: ignore[union-attr]
    t1, t2 = store.session_turns(sid)
    assert t1.turn_type == t2.turn_type == "main" and t1.tagged
    assert t1.next_state == [{"role": "user", "content": "thanks"}]
    assert store.get_session(sid).done


def test_side_and_opted_out_sessions(live: LiveServer):
    cb = clawbridge.Client(live.url)
    with cb.session(user="bob", main=False, train=False) as chat:
        chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        sid = chat.session_id
    [turn] = live.running.store.session_turns(sid)  # type: ignore[union-attr]
    assert turn.turn_type == "side" and turn.train is False


async def test_async_session(live: LiveServer):
    cb = clawbridge.Client(live.url)
    async with cb.async_session(user="carol") as chat:
        stream = await chat.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=5, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        sid = chat.session_id
    [turn] = live.running.store.session_turns(sid)  # type: ignore[union-attr]
    assert (turn.response["content"] or "") == text
    assert live.running.store.get_session(sid).done  # type: ignore[union-attr]
