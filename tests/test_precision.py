"""The engine's compute dtype: chosen from the CPU's flags (both answers tested on any machine),
and a bf16 body that keeps its output head, hence its logits, in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.local_gpu import models, precision

WITH_BF16 = frozenset({"fpu", "avx512f", "avx512_bf16"})
WITHOUT_BF16 = frozenset({"fpu", "avx2", "avx512f", "avx512bw"})  # emulated bf16 only


def test_auto_is_bf16_on_a_cpu_with_native_bf16_and_fp32_on_one_without() -> None:
    assert precision.choose("auto", "cpu", WITH_BF16) == torch.bfloat16
    assert precision.choose("auto", "cpu", frozenset({"amx_bf16"})) == torch.bfloat16
    assert precision.choose("auto", "cpu", WITHOUT_BF16) == torch.float32
    assert precision.choose("auto", "cpu", frozenset()) == torch.float32


def test_a_forced_setting_wins_and_auto_on_a_gpu_stays_fp32() -> None:
    assert precision.choose("fp32", "cpu", WITH_BF16) == torch.float32
    assert precision.choose("bf16", "cpu", WITHOUT_BF16) == torch.bfloat16
    assert precision.choose("auto", "cuda", WITH_BF16) == torch.float32
    assert [precision.name(d) for d in (torch.bfloat16, torch.float32, torch.float16)] == ["bf16", "fp32", "float16"]


def test_the_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert precision.cpu_flags(info) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert precision.native_bf16(precision.cpu_flags(info))
    assert precision.cpu_flags(tmp_path / "missing") == frozenset()  # not Linux: fp32


def test_the_backend_resolves_auto_from_this_cpu_and_honours_a_forced_dtype(tmp_path: Path) -> None:
    here = precision.name(precision.choose("auto", "cpu", precision.cpu_flags()))
    assert LocalBackend("tiny-random", tmp_path, engine_dtype="auto").dtype == here
    assert LocalBackend("tiny-random", tmp_path).dtype == "fp32"  # the library's default
    assert LocalBackend("tiny-random", tmp_path, engine_dtype="fp32").engine.dtype == torch.float32
    assert LocalBackend("tiny-random", tmp_path, engine_dtype="bf16").engine.dtype == torch.bfloat16
    backend = LocalBackend("tiny-random", tmp_path, engine_dtype="bf16", dtype=torch.float32)
    assert backend.dtype == "fp32"  # an explicit torch dtype (a GPU caller's) wins


def test_a_cpu_bf16_model_multiplies_in_bf16_and_keeps_everything_else_fp32() -> None:
    """On a CPU, bf16 is bf16 matmuls in an fp32 model: only the decoder's linear weights are
    bf16; embeddings, norms and the head stay as loaded, and the logits are fp32 products."""
    spec = models.resolve(models.TINY)
    reference = models.load_model(spec)
    model = models.load_model(spec)
    precision.prepare(model, torch.bfloat16, "cpu")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()]
    assert linears and all(type(m) is precision.Bf16Linear and m.weight.dtype == torch.bfloat16 for m in linears)
    rest = {n: p for n, p in model.named_parameters() if not any(p is m.weight for m in linears)}
    assert rest and {p.dtype for p in rest.values()} == {torch.float32}
    head = model.get_output_embeddings()
    assert torch.equal(head.weight, reference.get_output_embeddings().weight)
    ids = torch.tensor([[1, 520, 3121, 28, 1830]])
    with torch.inference_mode():
        logits, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=0, atol=0.05)  # bf16 products, not fp32 ones
    assert not torch.equal(logits, expected)


def test_the_packed_product_equals_the_plain_one_and_a_grad_flows_to_the_input() -> None:
    """Without a grad a Bf16Linear multiplies by its oneDNN-packed weight: bit-equal to F.linear
    on the same bf16 operands at every row count; with a grad it takes F.linear, whose backward
    gives the input (an fp32 activation) its gradient."""
    layer = torch.nn.Linear(64, 96, bias=False)
    model = torch.nn.Sequential(layer)
    model.get_output_embeddings = lambda: None  # type: ignore[attr-defined]
    assert precision.bf16_matmuls(model) == 1
    if layer.packed is None:
        pytest.skip("this torch build cannot pack bf16 weights for oneDNN")
    for rows in (1, 7, 300):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            packed = layer(x)
        plain = torch.nn.functional.linear(x.bfloat16(), layer.weight).float()
        assert packed.dtype == torch.float32 and torch.equal(packed, plain)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, layer.weight.float().sum(0).expand(3, 64), rtol=0, atol=0.05)


def test_a_gpu_bf16_body_keeps_the_checkpoints_head_in_fp32_and_gives_fp32_logits() -> None:
    """The GPU's arithmetic (the model cast whole), checked on the CPU: the head untied and fp32."""
    spec = models.resolve(models.TINY)
    reference = models.load_model(spec)
    model = models.load_model(spec)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    precision.to_compute_dtype(model, torch.bfloat16)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight.dtype == torch.float32 and embed.weight.dtype == torch.bfloat16
    assert torch.equal(head.weight, reference.get_output_embeddings().weight)  # not rounded
    assert {p.dtype for n, p in model.named_parameters() if "lm_head" not in n} == {torch.bfloat16}
    ids = torch.tensor([[1, 520, 3121, 28, 1830]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
    assert logits.dtype == torch.float32
    # bf16 rounding through two layers, not bf16 logits (a multiple of 2^-6 near 1)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0.05)
    assert (logits * 64 != (logits * 64).round()).any()


def test_fp32_is_left_untouched() -> None:
    model = models.load_model(models.resolve(models.TINY))
    precision.to_compute_dtype(model, torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not model.get_output_embeddings()._forward_pre_hooks


@pytest.mark.parametrize("engine_dtype", ["fp32", "bf16"])
async def test_the_trainable_adapter_and_its_optimizer_stay_fp32(tmp_path: Path, engine_dtype: str) -> None:
    from clawbridge.types import Datum, LossSpec, OptimSpec, SamplingParams

    backend = LocalBackend("tiny-random", tmp_path, lora_rank=4, lora_alpha=8, threads=1, engine_dtype=engine_dtype)  # type: ignore[arg-type]
    await backend.start()
    try:
        prompt = (1, 520, 3121, 28)
        (c,) = await backend.sample(prompt, SamplingParams(max_tokens=4, seed=1))
        await backend.train_step([Datum(prompt, c.tokens, c.logprobs, (1.0,) * len(c.tokens))], LossSpec(), OptimSpec())
        engine = backend.engine
        trainable = [p for p in engine._model.parameters() if p.requires_grad]
        assert trainable and {p.dtype for p in trainable} == {torch.float32}
        assert engine._optimizer is not None
        moments = [t for s in engine._optimizer.state.values() for t in s.values() if t.dim()]
        assert moments and {t.dtype for t in moments} == {torch.float32}
        matmuls = {p.dtype for n, p in engine._model.named_parameters() if "base_layer.weight" in n}
        assert matmuls == {precision.DTYPES[engine_dtype]}
        rest = {p.dtype for n, p in engine._model.named_parameters() if "base_layer.weight" not in n}
        assert rest == {torch.float32}  # the served adapters too: the activations stay fp32
        await backend.publish()
        served = {p.dtype for n, p in engine._model.named_parameters() if "lora_" in n and ".serve" in n}
        assert served == {torch.float32}
    finally:
        await backend.close()


def test_the_chosen_dtype_is_in_the_banner_the_model_card_and_the_status(tmp_path: Path) -> None:
    import httpx
    from clawbridge.config import Settings
    from clawbridge.server import banner, build_backend
    from live_server import LiveServer

    threads = torch.get_num_threads()
    settings = Settings(model="tiny-random", port=0, data_dir=tmp_path, train=False, engine_dtype="bf16")
    assert Settings(model="tiny-random").engine.engine_dtype == "auto"  # the server's default: bf16 where the CPU has it
    live = LiveServer(settings, build_backend(settings)).start()
    try:
        assert httpx.get(f"{live.url}/v1/models").json()["data"][0]["dtype"] == "bf16"
        assert httpx.get(f"{live.url}/v1/status").json()["dtype"] == "bf16"
        first = banner(live.settings, live.backend, live.proxy, live.url).splitlines()[0]
        assert "(local backend, bf16, policy@v0)" in first
    finally:
        live.stop()
        torch.set_num_threads(threads)


def test_stochastic_rounding_keeps_a_change_smaller_than_half_a_bf16_step_on_average() -> None:
    """A merged weight is a bf16 weight plus a LoRA change; rounded to nearest, a change under half
    a bf16 step vanishes (the merged version would be less trained than the adapter). Rounded
    stochastically, it survives on average, and a value bf16 holds exactly stays as it is."""
    step = 2.0**-7  # bf16's step at 1.0
    weight = torch.full((100_000,), 1.0)
    changed = weight + 0.3 * step
    assert changed.to(torch.bfloat16).float().mean().item() == 1.0  # nearest: the change is gone
    rounded = precision.round_stochastically(changed, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + step}
    assert abs((rounded.mean().item() - 1.0) / step - 0.3) < 0.01
    negative = precision.round_stochastically(-changed, torch.Generator().manual_seed(1)).float()
    assert abs((negative.mean().item() + 1.0) / step + 0.3) < 0.01
    exact = torch.tensor([0.5, -3.0, 1.0 + step, 0.0])
    assert torch.equal(precision.round_stochastically(exact, torch.Generator()).float(), exact)
