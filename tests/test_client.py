"""The SDK client against a live server: sessions are preconfigured openai clients that tag their
requests; leaving a session marks it done; models and status read the server. The async client
offers the same calls as the sync one, over one pooled connection."""

from __future__ import annotations

import inspect

import clawbridge
import pytest
from clawbridge.config import Settings
from clawbridge.server import build_backend
from live_server import LiveServer, with_learner

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    settings = Settings(model=MODEL, port=0, data_dir=tmp_path_factory.mktemp("client"), train=False,
                        default_max_tokens=8)
    server = LiveServer(settings, build_backend(settings)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def learning(tmp_path_factory: pytest.TempPathFactory):
    """A server with the learning loop's routes (feedback, groups); it never trains (batch 1000)."""
    settings = Settings(model=MODEL, port=0, data_dir=tmp_path_factory.mktemp("learning"), default_max_tokens=4,
                        batch_size=1000, judge="rules")
    with with_learner(settings, poll_s=0.1) as server:  # the learner's task stops before the store
        yield server


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
    async with clawbridge.AsyncClient(live.url) as cb, cb.session(user="carol") as chat:
        stream = await chat.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=5, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        sid = chat.session_id
    [turn] = live.running.store.session_turns(sid)  # type: ignore[union-attr]
    assert (turn.response["content"] or "") == text
    assert live.running.store.get_session(sid).done  # type: ignore[union-attr]


def _surface(cls: type) -> dict[str, inspect.Signature]:
    """Public methods and their signatures, with async-ness and return annotations set aside."""
    rename = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
    keep = {"__enter__", "__exit__", "__aenter__", "__aexit__", "__iter__", "__len__", "__getitem__"}
    own = {n for k in cls.__mro__ if k.__module__ == "clawbridge.sdk.client" for n in vars(k)}
    return {rename.get(n, n): inspect.signature(f).replace(return_annotation=inspect.Signature.empty)
            for n, f in inspect.getmembers(cls, inspect.isfunction)
            if n in own and (not n.startswith("_") or n in keep)}


@pytest.mark.parametrize(("sync", "asyn"), [
    (clawbridge.Client, clawbridge.AsyncClient), (clawbridge.Session, clawbridge.AsyncSession),
    (clawbridge.Group, clawbridge.AsyncGroup), (clawbridge.Episode, clawbridge.AsyncEpisode),
])
def test_the_async_sdk_has_every_call_of_the_sync_one(sync: type, asyn: type):
    s, a = _surface(sync), _surface(asyn)
    assert s.keys() == a.keys()
    for name in s:  # the parameters, names, kinds and defaults alike (the owner's type differs)
        assert [(p.name, p.kind, p.default) for p in s[name].parameters.values()] == \
            [(p.name, p.kind, p.default) for p in a[name].parameters.values()], name
    if sync is clawbridge.Client:  # what the async side once lacked
        assert {"feedback", "status", "get_group", "session", "group", "close"} <= a.keys()


async def test_the_async_client_reads_status_groups_and_feedback(learning: LiveServer):
    live = learning
    async with clawbridge.AsyncClient(live.url) as cb:
        pooled = cb._http
        assert await cb.models() == [MODEL]
        assert (await cb.status())["model"] == MODEL
        async with cb.session(user="dave") as chat:
            await chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                               max_tokens=2)
            fb = await chat.feedback(reward=1.0)
            sid = chat.session_id
        async with cb.group(2, task="t") as g:
            info = await g.status()
            assert info["id"] == g.id and len(info["episodes"]) == 2 == len(g)
            assert (await cb.get_group(g.id or ""))["id"] == g.id
        assert cb._http is pooled  # every call went through the one pooled client
    assert pooled.is_closed
    last = live.running.store.last_turn(sid)  # type: ignore[union-attr]
    assert last is not None and fb["turn_id"] == last.id and fb["reward"] == 1.0


def test_a_closed_client_closes_its_pool(live: LiveServer):
    with clawbridge.Client(live.url) as cb:
        assert cb.models() == [MODEL]
    assert cb._http.is_closed
