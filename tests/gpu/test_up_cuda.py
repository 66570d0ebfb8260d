"""`clawbridge up --backend local` on a GPU machine without SGLang, end to end: the stack is chosen
from the machine (the torch engine on CUDA in bf16, and a start-up line saying so), served over
real HTTP to the real `openai` client, trained and published while serving, and every captured
turn is token-exact (`score` of the recorded completion reproduces the recorded logprobs)."""

from __future__ import annotations

import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.backends.local_stack import build_local
from clawbridge.config import Settings
from clawbridge.types import Datum, OptimSpec
from live_server import LiveServer

pytestmark = pytest.mark.gpu


def test_up_on_a_gpu_without_sglang_serves_trains_and_publishes_on_cuda(tiny_dir, tmp_path, capsys):
    import openai
    import torch

    settings = Settings(model=tiny_dir, data_dir=tmp_path, lora_rank=8, lora_alpha=16, train=False, port=0)
    backend = build_local(settings, sglang_installed=False)
    assert "serving with the torch engine on CUDA" in capsys.readouterr().out
    assert isinstance(backend, LocalBackend) and backend.engine.dtype == torch.bfloat16
    server = LiveServer(settings, backend).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", timeout=60)
        store = server.running.store  # type: ignore[union-attr]

        def chat(sid: str, stream: bool) -> None:
            kw = dict(model=server.proxy.model_name, max_tokens=12, temperature=0.8,
                      messages=[{"role": "user", "content": "Say something"}],
                      extra_headers={"X-Session-Id": sid})
            if stream:
                chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
                assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
            else:
                client.chat.completions.create(**kw)

        def exact(sid: str, version: int) -> None:
            t = store.session_turns(sid)[-1]
            assert t.version == version
            # bf16: the same kernels at another batch shape round differently, hence a tolerance
            scored = server.call(backend.score(t.prompt_ids, t.completion_ids, temperature=0.8))
            assert scored == pytest.approx(list(t.logprobs), abs=0.05)

        chat("a", stream=False)
        chat("b", stream=True)
        exact("a", 0)
        exact("b", 0)
        server.call(backend.train_step([Datum((1, 2, 3), (4, 5), (-10.4, -10.4), (1.0, 1.0))],
                                       optim=OptimSpec(learning_rate=1e-2)))
        assert server.call(backend.publish()).version == 1
        chat("c", stream=True)
        exact("c", 1)
    finally:
        server.stop()
