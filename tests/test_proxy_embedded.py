"""The embedded SmolLM2-135M behind the proxy, where real language matters: a real answer over
the openai client, streamed and not, captured token-exactly."""

from __future__ import annotations

import math

import openai
import pytest
from clawbridge.config import Settings
from clawbridge.server import build_backend
from live_server import LiveServer

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    settings = Settings(model=MODEL, port=0, data_dir=tmp_path_factory.mktemp("embedded"), train=False)
    server = LiveServer(settings, build_backend(settings)).start()
    yield server
    server.stop()


def test_embedded_model_answers_and_every_turn_is_exact(live: LiveServer):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                       extra_headers={"X-Session-Id": "emb-1"})
    assert "paris" in (r.choices[0].message.content or "").lower()
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, stream=True,  # type: ignore[arg-type]
                                            extra_headers={"X-Session-Id": "emb-2"})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    store = live.running.store  # type: ignore[union-attr]
    for sid, text in (("emb-1", r.choices[0].message.content), ("emb-2", streamed)):
        [turn] = store.session_turns(sid)
        assert turn.response["content"] == text
        assert list(turn.prompt_ids) == live.proxy.renderer.render(turn.messages, turn.tools)
        scored = live.call(live.backend.score(turn.prompt_ids, turn.completion_ids,
                                              temperature=turn.sampling.temperature or 1.0))
        # greedy (temperature 0) records logprobs at temperature 1, which score reproduces
        assert all(math.isclose(a, b, abs_tol=2e-4) for a, b in zip(scored, turn.logprobs, strict=True))
