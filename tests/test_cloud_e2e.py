"""End to end on each cloud backend: the real HTTP proxy serves a Tinker, Fireworks or Modal
backend whose SDK is the offline fake of that platform; the real `openai` client talks to it; the
user's next messages are judged (rules judge), the samples train on the platform and the
published version serves the next request."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from clawbridge.backends.fireworks import FireworksBackend
from clawbridge.backends.modal import ModalBackend
from clawbridge.backends.remote import RetryPolicy
from clawbridge.backends.tinker import TinkerBackend
from clawbridge.config import Settings
from clawbridge.learning.learner import Learner
from clawbridge.protocol import Backend
from clawbridge.server import bind_learner, learner_hooks
from fakes.fake_fireworks import FakeFiretitanService
from fakes.fake_modal import FakeEngine
from fakes.fake_tinker import FakeTinkerService
from live_server import LiveServer
from openai import OpenAI

pytestmark = pytest.mark.filterwarnings("ignore:.*executing locally.*")  # Modal's offline .local()
FAST = RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02, timeout_s=120.0)


def tinker(tokenizer, tmp_path: Path) -> Backend:
    service = FakeTinkerService()
    return TinkerBackend(service_client=service, base_model=service.known_models[0], tokenizer=tokenizer,
                         served_model_name="tiny-tinker", lora_rank=8, retry=FAST)


def fireworks(tokenizer, tmp_path: Path) -> Backend:
    service = FakeFiretitanService()
    return FireworksBackend(connect=lambda: service, base_model="accounts/fireworks/models/qwen3-4b",
                            tokenizer=tokenizer, retry=FAST)


def modal(tokenizer, tmp_path: Path) -> Backend:
    return ModalBackend(engine=FakeEngine(tmp_path / "volume"), tokenizer=tokenizer, model_name="tiny-random",
                        context_length=32768, retry=FAST)


@pytest.mark.timeout(280)
@pytest.mark.parametrize("make_backend", [tinker, fireworks, modal])
def test_cloud_backend_serves_judges_and_trains_through_the_proxy(make_backend, tmp_path: Path, tokenizer) -> None:
    settings = Settings(data_dir=tmp_path / "data", backend="tinker", port=0, batch_size=2, judge="rules",
                        method="combine", default_max_tokens=8)
    (tmp_path / "data").mkdir()
    backend = make_backend(tokenizer, tmp_path)
    learner = Learner(settings)
    live = LiveServer(settings, backend, hooks=learner_hooks(learner)).start()
    try:
        assert live.running is not None
        bind_learner(learner, backend, live.running.store, lineages=live.running.lineages)  # as the server binds it
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        headers = {"X-Session-Id": "e2e"}
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        for follow_up in ("No, that's wrong. The capital of France is Paris.", "Thanks, that's perfect!"):
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                   temperature=1.0, extra_headers=headers)
            assert reply.choices[0].message is not None
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": follow_up}]
        last = client.chat.completions.create(model=model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                              extra_headers={**headers, "X-Session-Done": "true"})
        assert last.choices[0].message is not None
        assert learner.collector is not None and learner.trainer is not None
        for _ in range(5):  # judge every turn whose next state arrived
            if not live.call(learner.collector.run_once(), timeout=120):
                break
        assert learner.collector.stats.judged >= 2
        def train_usage() -> tuple[float, float]:  # tokens trained (Tinker, Fireworks), GPU seconds (Modal)
            t = backend.meter.snapshot()["by_activity"].get("train", {})  # type: ignore[attr-defined]
            return float(t.get("trained_tokens", 0)), float(t.get("gpu_seconds", 0))

        tokens_before, gpu_s_before = train_usage()
        step = live.call(learner.trainer.step_once(), timeout=120)
        assert step is not None and step.version == 1 == backend.version
        tokens_after, gpu_s_after = train_usage()
        assert tokens_after > tokens_before or gpu_s_after > gpu_s_before  # the step ran on the platform
        scrape = httpx.get(f"{live.url}/metrics", timeout=10).text
        assert "clawbridge_train_step 1.0" in scrape and "clawbridge_train_loss " in scrape
        assert "clawbridge_policy_version 1.0" in scrape
        after = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, extra_headers={"X-Train": "false"})
        assert after.choices[0].message is not None

        # The budget is reached: the train loop says so once and stops; serving goes on, and the
        # judged samples stay judged (never marked trained) for when the budget is raised.
        more = [{"role": "user", "content": "Name a colour."}]
        for follow_up in ("No, wrong. I wanted blue.", "Thanks, perfect!"):
            r = client.chat.completions.create(model=model, messages=more, max_tokens=4,  # type: ignore[arg-type]
                                               extra_headers={"X-Session-Id": "budget"})
            more += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": follow_up}]
        client.chat.completions.create(model=model, messages=more, max_tokens=4,  # type: ignore[arg-type]
                                       extra_headers={"X-Session-Id": "budget"})
        for _ in range(5):
            if not live.call(learner.collector.run_once(), timeout=120):
                break
        judged_before = live.running.store.stats().samples["judged"]
        assert judged_before >= 1
        backend.meter.budget_usd = backend.meter.spent_usd  # type: ignore[attr-defined]
        live.call(learner._train_loop(learner.trainer), timeout=60)  # returns instead of retrying forever
        assert learner.training_stopped is not None and "budget" in learner.training_stopped
        assert learner.status()["training_stopped"] == learner.training_stopped
        assert live.running.store.stats().samples["judged"] == judged_before
        assert backend.version == 1
        served = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4)
        assert served.choices[0].message is not None
    finally:
        live.stop()
