"""`clawbridge up --backend local` picks its stack from the machine, and the SGLang stack runs end
to end: fake SGLang server processes under the real supervisor, the real FSDP2 trainer under
torchrun (gloo, CPU), served through the real HTTP proxy to the real `openai` client."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from clawbridge.backends.local import LocalBackend
from clawbridge.backends.local_stack import SGLangStack, build_local
from clawbridge.config import Settings
from clawbridge.local_gpu import layout, models
from clawbridge.local_gpu.fsdp import FSDPTrainer, free_port
from clawbridge.local_gpu.supervisor import Policy, ServerSpec, Supervisor
from clawbridge.protocol import BackendError
from clawbridge.types import Datum, OptimSpec
from helpers.processes import alive
from live_server import LiveServer

FAKE = str(Path(__file__).parent / "fakes" / "fake_sglang.py")


def test_no_gpu_serves_with_the_torch_engine_on_cpu_and_says_so(tmp_path, capsys):
    backend = build_local(Settings(model=models.TINY, data_dir=tmp_path), visible=0)
    assert isinstance(backend, LocalBackend) and backend.engine.device == "cpu"
    assert "no GPU visible" in capsys.readouterr().out


def test_a_gpu_without_sglang_serves_with_the_torch_engine_on_cuda_in_bf16_and_says_so(tmp_path, capsys):
    import torch

    backend = build_local(Settings(model=models.TINY, data_dir=tmp_path), visible=1, sglang_installed=False)
    assert isinstance(backend, LocalBackend)  # not started: no CUDA needed to build it
    assert backend.engine.device == "cuda" and backend.engine.dtype == torch.bfloat16
    assert "SGLang is not installed" in capsys.readouterr().out


def test_gpus_with_sglang_run_the_plan(tmp_path, capsys):
    settings = Settings(model=models.EMBEDDED, data_dir=tmp_path, lora_rank=16)
    stack = build_local(settings, visible=8, sglang_installed=True)
    assert isinstance(stack, SGLangStack)
    assert stack.plan.roles == {"actor": (0, 1, 2, 3), "rollout": (4, 5), "prm": (6, 7)}
    assert stack.trainer.nproc == 4 and stack.trainer.gpus == (0, 1, 2, 3) and stack.trainer.device == "cuda"
    by_name = {s.name: s for s in stack.specs}
    assert by_name["policy-sglang"].gpus == (4, 5) and "--enable-lora" in by_name["policy-sglang"].argv
    assert by_name["judge-sglang"].gpus == (6, 7) and "--enable-lora" not in by_name["judge-sglang"].argv
    assert stack.judge_endpoint[0] == f"http://127.0.0.1:{by_name['judge-sglang'].port}/v1"
    assert "SGLang servers per the plan" in capsys.readouterr().out


def test_the_plan_is_checked_against_the_visible_gpus(tmp_path):
    with pytest.raises(layout.LayoutError, match="only 2 GPU"):
        build_local(Settings(model=models.EMBEDDED, data_dir=tmp_path, num_gpus=4), visible=2, sglang_installed=True)
    with pytest.raises(BackendError, match="SGLang serves models from a folder"):
        build_local(Settings(model=models.TINY, data_dir=tmp_path), visible=1, sglang_installed=True)


def test_num_gpus_zero_keeps_a_gpu_machine_on_cpu(tmp_path):
    backend = build_local(Settings(model=models.TINY, data_dir=tmp_path, num_gpus=0), visible=4, sglang_installed=True)
    assert isinstance(backend, LocalBackend) and backend.engine.device == "cpu"


@pytest.mark.timeout(300)
def test_the_one_gpu_stack_serves_trains_publishes_and_stops_everything(tmp_path):
    """The colocated plan with its processes real: a fake SGLang (tiny model, LoRA by name) under
    the supervisor and the FSDP2 trainer (one gloo rank) under torchrun. A chat is served by v0;
    a train step and a publish later the next chat is served by v1; stopping the server stops
    every process the stack started."""
    settings = Settings(model=models.TINY, data_dir=tmp_path, lora_rank=8, lora_alpha=8, train=False, port=0)
    plan = layout.plan(1)
    port = free_port()
    fake = ServerSpec("policy-sglang", (sys.executable, FAKE, "--port", str(port)), port, (0,))
    trainer = FSDPTrainer(models.TINY, nproc=1, device="cpu", lora_rank=8, lora_alpha=8, threads=1,
                          log_file=tmp_path / "logs" / "trainer.log", start_timeout_s=240)
    supervisor = Supervisor(tmp_path / "logs", Policy(ready_timeout_s=120, poll_s=0.1, grace_s=2.0))
    spec = models.resolve(models.TINY)
    stack = SGLangStack(plan, supervisor, trainer, models.load_tokenizer(spec), model_path="tiny",
                        model_name="tiny", context_length=spec.context_length, settings=settings,
                        specs=[fake])
    server = LiveServer(settings, stack).start(timeout=240)
    try:
        server_pid, trainer_pid = supervisor.pid("policy-sglang"), trainer.proc.pid if trainer.proc else None
        assert server_pid and trainer_pid and alive(server_pid) and alive(trainer_pid)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", timeout=60)

        def chat(sid: str) -> int:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
                extra_headers={"X-Session-Id": sid},
            )
            turns = server.running.store.session_turns(sid)  # type: ignore[union-attr]
            return turns[-1].version

        assert chat("before") == 0
        trains = server.running.lineages.default.backend  # type: ignore[union-attr]  # as the learner trains it
        server.call(trains.train_step([Datum((1, 2, 3), (4, 5), (-10.4, -10.4), (1.0, 1.0))],
                                      optim=OptimSpec(learning_rate=1e-2)))
        published = server.call(trains.publish())
        assert published.version == 1 and (tmp_path / "adapters" / "v1" / "adapter_config.json").exists()
        assert chat("after") == 1
    finally:
        server.stop()
    assert not alive(server_pid) and not alive(trainer_pid)
    assert "starting policy-sglang" in (tmp_path / "logs" / "policy-sglang.log").read_text()
