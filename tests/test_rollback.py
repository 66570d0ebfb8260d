"""`clawbridge rollback` against a live server on loopback (tiny model, real store): the route
publishes an earlier version's weights as a new version while streams keep being served, never
overlaps a training step, is recorded for `clawbridge versions`, and fails clearly."""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.cli.main import app
from clawbridge.learning.learner import Learner
from clawbridge.server import bind_learner, learner_hooks
from helpers.learning import judged_samples, settings_for
from live_server import LiveServer
from typer.testing import CliRunner

KEY = "rollback-test-key"
PROMPT, COMPLETION = (1, 520, 3121, 28, 1830, 446), (17, 401, 2032, 9)


def ask(url: str, content: str, **kw: Any) -> httpx.Response:
    body = {"model": "tiny-random", "max_tokens": 8, "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}", "X-Train": "false"})


def wait_for(done: Any, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


class Intervals:
    """Wraps backend verbs to record when each ran, to show a rollback never overlaps a step."""

    def __init__(self, backend: LocalBackend) -> None:
        self.spans: list[tuple[str, float, float]] = []
        for verb in ("train_step", "publish", "rollback"):
            setattr(backend, verb, self._wrap(verb, getattr(backend, verb)))

    def _wrap(self, name: str, fn: Any) -> Any:
        async def timed(*args: Any, **kw: Any) -> Any:
            started = time.monotonic()
            try:
                return await fn(*args, **kw)
            finally:
                self.spans.append((name, started, time.monotonic()))

        return timed


@pytest.mark.timeout(280)
def test_rollback_under_streaming_load_serves_the_old_weights_as_a_new_version(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "data", batch_size=2, default_max_tokens=8, api_key=KEY, port=0)
    (tmp_path / "data").mkdir()
    learner = Learner(settings)
    backend = LocalBackend.from_settings(settings)
    live = LiveServer(settings, backend, hooks=learner_hooks(learner)).start()
    assert live.running is not None
    store = live.running.store
    try:
        judged_samples(store, 6)
        bind_learner(learner, backend, store, lineages=live.running.lineages)  # as the server binds it
        trainer = learner.trainer
        assert trainer is not None
        assert live.call(trainer.step_once(), timeout=120).version == 1
        v1_scores = live.call(backend.score(PROMPT, COMPLETION))
        v1_greedy = ask(live.url, "Say something", temperature=0).json()
        assert v1_greedy["system_fingerprint"] == "policy@v1"
        assert live.call(trainer.step_once(), timeout=120).version == 2
        assert live.call(backend.score(PROMPT, COMPLETION)) != pytest.approx(v1_scores, abs=1e-4)

        spans = Intervals(backend)
        statuses: list[int] = []
        fingerprints: list[str] = []
        stop = threading.Event()

        def client(k: int) -> None:
            with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}", "X-Train": "false"}) as h:
                i = 0
                while not stop.is_set():
                    body = {"model": "tiny-random", "max_tokens": 8, "stream": True,
                            "messages": [{"role": "user", "content": f"stream {k} {i}"}]}
                    with h.stream("POST", f"{live.url}/v1/chat/completions", json=body) as r:
                        text = "".join(r.iter_text())
                    ok = r.status_code == 200 and "data: [DONE]" in text and '"error"' not in text
                    statuses.append(200 if ok else r.status_code or 599)
                    fingerprints.extend(set(re.findall(r'"system_fingerprint":\s*"([^"]+)"', text)))
                    i += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(statuses) >= 4)
            # a training step and a rollback asked for at once: they run one after the other
            judged_samples(store, 2)
            step = asyncio.run_coroutine_threadsafe(trainer.step_once(), live.loop)  # type: ignore[arg-type]
            out = cli("rollback", "v1", "--url", live.url, "--api-key", KEY)
            assert out.exit_code == 0, out.output
            assert step.result(120) is not None
            seen = len(statuses)
            wait_for(lambda: len(statuses) >= seen + 4)
        finally:
            stop.set()
            for t in threads:
                t.join(120)

        assert statuses and set(statuses) == {200}, statuses  # zero failed requests
        ran = sorted(spans.spans, key=lambda s: s[1])
        for (_, _, end), (_, start, _) in itertools.pairwise(ran):
            assert end <= start, ran  # no train_step / publish overlapped the rollback
        assert backend.version == 4
        rollback_version = learner.last_rollback.version if learner.last_rollback else None
        assert rollback_version in (3, 4) and f"policy@v{rollback_version}" in out.output
        # streams went on through both: at most 3 of the 4 answered after both returned were
        # admitted before, so one was served by the newest version
        assert "policy@v4" in fingerprints

        if rollback_version == 3:  # the step ran after it: roll back once more to check weights
            assert cli("rollback", "1", "--url", live.url, "--api-key", KEY).exit_code == 0
            rollback_version = 5
        assert live.call(backend.score(PROMPT, COMPLETION)) == pytest.approx(v1_scores, abs=1e-6)
        again = ask(live.url, "Say something", temperature=0).json()
        assert again["system_fingerprint"] == f"policy@v{rollback_version}"
        assert again["choices"][0]["message"] == v1_greedy["choices"][0]["message"]

        table = cli("versions", "--data-dir", str(settings.data_dir))
        assert table.exit_code == 0 and "rollback of v1" in table.output, table.output
        from clawbridge.learning.promotion import CHECKPOINT_KEY

        assert store.get_meta(CHECKPOINT_KEY)["version"] == rollback_version  # --resume continues from it
    finally:
        live.stop()


@pytest.fixture(scope="module")
def quiet_live(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("rollback-errors")
    settings = settings_for(data, api_key=KEY, port=0)
    learner = Learner(settings)
    live = LiveServer(settings, LocalBackend.from_settings(settings), hooks=learner_hooks(learner)).start()
    yield live
    live.stop()


def test_a_version_never_published_is_a_clear_404(quiet_live: LiveServer) -> None:
    for url in (quiet_live.url, f"{quiet_live.url}/v1/"):  # the root, or the OpenAI-style base URL
        out = cli("rollback", "7", "--url", url, "--api-key", KEY)
        assert out.exit_code == 1 and "policy@v7 was never published (the newest is v0)" in out.output
    r = httpx.post(f"{quiet_live.url}/v1/admin/rollback", json={"version": 7}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
    assert quiet_live.running is not None and quiet_live.running.backend.version == 0


@pytest.mark.parametrize(("body", "status"), [({"version": -1}, 400), ({"version": "x"}, 400), ({}, 400),
                                               ({"version": 1, "extra": 1}, 400)])
def test_bad_rollback_bodies_get_openai_shaped_errors(quiet_live: LiveServer, body: dict, status: int) -> None:
    r = httpx.post(f"{quiet_live.url}/v1/admin/rollback", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error"


def test_the_route_wants_the_api_key_and_the_cli_says_so(quiet_live: LiveServer) -> None:
    r = httpx.post(f"{quiet_live.url}/v1/admin/rollback", json={"version": 0})
    assert r.status_code == 401
    out = cli("rollback", "0", "--url", quiet_live.url, "--api-key", "wrong")
    assert out.exit_code == 1 and "--api-key" in out.output


def test_no_server_and_a_bad_version_argument_are_explained() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = cli("rollback", "1", "--url", f"http://127.0.0.1:{port}")
    assert out.exit_code == 1 and "no clawbridge server" in out.output and "clawbridge up" in out.output
    out = cli("rollback", "latest")
    assert out.exit_code == 1 and "version number" in out.output
