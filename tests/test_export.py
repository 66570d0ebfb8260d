"""`clawbridge export-model`: a trained version merged into a Hugging Face folder and a GGUF file,
each loaded back with transformers and compared, logit by logit, with the engine serving that
version; the GGUF layout (llama's permuted q/k, tokenizer fields) and where cloud versions go."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from clawbridge.backends.local import LocalBackend
from clawbridge.cli import export_model as cli_export
from clawbridge.cli.main import app
from clawbridge.config import Settings
from clawbridge.local_gpu import export, models
from clawbridge.types import Datum, OptimSpec, SamplingParams
from typer.testing import CliRunner

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(autouse=True)
def _torch_threads_restored():  # type: ignore[no-untyped-def]
    # the engines here run one intra-op thread (on shared, busy cores a second spinning thread
    # costs several times the work); the setting is process-wide, so it is put back
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def chat_ids(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


async def train_and_publish(backend: LocalBackend, prompt: list[int], lr: float) -> int:
    """One PPO step that pushes up a sampled completion, hard enough to move every layer's
    LoRA far from zero; publishes it."""
    (c,) = await backend.sample(prompt, SamplingParams(max_tokens=12, seed=7))
    datum = Datum(tuple(prompt), c.tokens, c.logprobs, (1.0,) * len(c.tokens))
    await backend.train_step([datum], optim=OptimSpec(learning_rate=lr))
    return (await backend.publish()).version


def run_cli(*args: str) -> None:
    result = CliRunner().invoke(app, ["export-model", *args])
    assert result.exit_code == 0, result.output


def gguf_config(folder: Path, gguf_file: str):  # type: ignore[no-untyped-def]
    """transformers' config from a GGUF, with the YaRN keys llama.cpp reads (transformers' GGUF
    loader drops them for llama; the embedded model is served with YaRN)."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file, local_files_only=True)
    fields = GGUFReader(str(folder / gguf_file)).fields
    arch = fields["general.architecture"].contents()
    if f"{arch}.rope.scaling.type" in fields:
        assert fields[f"{arch}.rope.scaling.type"].contents() == "yarn"
        factor = fields[f"{arch}.rope.scaling.factor"].contents()
        config.rope_parameters = {
            "rope_theta": config.rope_parameters["rope_theta"],
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": fields[
                f"{arch}.rope.scaling.original_context_length"
            ].contents(),
        }
        if (
            f"{arch}.rope.scaling.attn_factor" in fields
        ):  # llama.cpp's factor over YaRN's own temperature
            attn = fields[f"{arch}.rope.scaling.attn_factor"].contents()
            config.rope_parameters["attention_factor"] = attn * (0.1 * math.log(factor) + 1)
    return config


def hf_logits(folder: Path, ids: list[int], gguf_file: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file, "config": gguf_config(folder, gguf_file)} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, local_files_only=True, **extra
    )
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


# --- the round trips ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """tiny-random trained one step and published as v1, then exported by the command (HF and
    f32 GGUF); the prompt and the logits the engine serves for v0 and v1."""
    import asyncio

    tmp = tmp_path_factory.mktemp("tiny-export")
    backend = LocalBackend(models.TINY, tmp / "data", lora_rank=8, lora_alpha=16, threads=1)

    async def serve() -> tuple[list[int], int, torch.Tensor, torch.Tensor]:
        await backend.start()
        try:
            prompt = chat_ids(backend.tokenizer())
            base = await backend.engine.logits(prompt, version=0)
            version = await train_and_publish(backend, prompt, lr=1e-2)
            return prompt, version, base, await backend.engine.logits(prompt, version=version)
        finally:
            await backend.close()

    threads = torch.get_num_threads()
    try:
        prompt, version, base, served = asyncio.run(serve())
    finally:
        torch.set_num_threads(threads)
    out = tmp / "exported"
    run_cli(
        "--data-dir",
        str(tmp / "data"),
        "--model",
        models.TINY,
        "--out",
        str(out),
        "--gguf-type",
        "f32",
    )
    return SimpleNamespace(
        out=out,
        prompt=prompt,
        version=version,
        base=base,
        served=served,
        manifest=json.loads((out / "export.json").read_text()),
    )


def test_tiny_random_version_exported_as_a_folder_gives_the_served_logits(
    tiny_export: SimpleNamespace,
) -> None:
    t = tiny_export
    assert (
        t.served - t.base
    ).abs().max() > 1e-2  # the version is not the base: the check has teeth
    assert t.manifest["version"] == t.version and t.manifest["model"] == models.TINY
    assert t.manifest["files"]["hf"]["path"] == "hf"
    assert t.manifest["files"]["gguf"]["path"] == f"gguf/tiny-random-v{t.version}.f32.gguf"
    assert (
        (t.out / "gguf" / "Modelfile")
        .read_text()
        .startswith(f"FROM ./tiny-random-v{t.version}.f32.gguf\n")
    )
    torch.testing.assert_close(hf_logits(t.out / "hf", t.prompt), t.served, atol=1e-4, rtol=0)


@pytest.mark.slow  # transformers parses the 49 K-token vocabulary of a GGUF twice: ~20 s here
def test_tiny_random_gguf_gives_the_served_logits_and_the_embedded_tokenizer_fields(
    tiny_export: SimpleNamespace,
) -> None:
    from gguf import GGUFReader

    t = tiny_export
    name = Path(t.manifest["files"]["gguf"]["path"]).name
    torch.testing.assert_close(
        hf_logits(t.out / "gguf", t.prompt, name), t.served, atol=1e-4, rtol=0
    )
    ours = GGUFReader(str(t.out / "gguf" / name)).fields
    package = GGUFReader(
        str(models.gguf_path())
    ).fields  # the tokenizer llama.cpp's converter wrote
    for key in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
    ):
        assert ours[key].contents() == package[key].contents(), key


async def test_embedded_model_round_trip_hf_and_gguf(
    tmp_path: Path, embedded_spec: models.ModelSpec
) -> None:
    from transformers import AutoTokenizer

    data = tmp_path / "data"
    backend = LocalBackend(models.EMBEDDED, data, lora_rank=8, lora_alpha=16, threads=1)
    await backend.start()
    try:
        prompt = chat_ids(backend.tokenizer())
        base = await backend.engine.logits(prompt, version=0)
        version = await train_and_publish(backend, prompt, lr=2e-3)
        served = await backend.engine.logits(prompt, version=version)
    finally:
        await backend.close()
    assert (served - base).abs().max() > 0.5

    out = tmp_path / "exported"
    run_cli(
        "--data-dir",
        str(data),
        "--model",
        models.EMBEDDED,
        "--out",
        str(out),
        "--version",
        f"v{version}",
    )

    # the folder: the same ids from its own tokenizer and chat template, the served logits
    assert chat_ids(AutoTokenizer.from_pretrained(str(out / "hf"), local_files_only=True)) == prompt
    hf = hf_logits(out / "hf", prompt)
    torch.testing.assert_close(hf, served, atol=1e-3, rtol=0)
    # the GGUF (f16 weights): the served logits to f16 rounding, the same greedy choices
    gguf_name = f"smollm2-135m-instruct-v{version}.f16.gguf"
    from_gguf = hf_logits(out / "gguf", prompt, gguf_name)
    print(
        f"max |logit difference| vs the engine: HF {(hf - served).abs().max():.2e}, "
        f"GGUF f16 {(from_gguf - served).abs().max():.2e}"
    )
    assert (from_gguf - served).abs().max() < 0.25


def tiny_bpe_tokenizer():  # type: ignore[no-untyped-def]
    """A small byte-level BPE with ChatML specials (a Qwen-like tokenizer, 300-odd tokens)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["Name three colours of the rainbow: red, orange, yellow, green."] * 4, trainer
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=models.embedded_tokenizer().chat_template,
    )


async def test_a_qwen3_model_round_trips_with_its_own_tokenizer(tmp_path: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = tiny_bpe_tokenizer()
    folder = tmp_path / "tiny-qwen3"
    config = Qwen3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,  # transformers' GGUF loader assumes 128
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))

    data = tmp_path / "data"
    backend = LocalBackend(str(folder), data, lora_rank=4, lora_alpha=8, threads=1)
    await backend.start()
    try:
        prompt = chat_ids(backend.tokenizer())
        version = await train_and_publish(backend, prompt, lr=1e-2)
        served = await backend.engine.logits(prompt, version=version)
    finally:
        await backend.close()

    out = tmp_path / "exported"
    run_cli(
        "--data-dir",
        str(data),
        "--model",
        str(folder),
        "--out",
        str(out),
        "--format",
        "gguf",
        "--gguf-type",
        "f32",
    )
    gguf_file = out / "gguf" / f"tiny-qwen3-v{version}.f32.gguf"
    fields = GGUFReader(str(gguf_file)).fields
    assert fields["general.architecture"].contents() == "qwen3"
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 320 and tokens[-1] == "[PAD319]"  # the embedding is wider than the vocab
    assert fields["tokenizer.ggml.token_type"].contents()[:3] == [3, 3, 3]  # the specials: control
    assert "<|im_start|>" in fields["tokenizer.chat_template"].contents()
    assert not (out / "hf").exists()
    torch.testing.assert_close(
        hf_logits(out / "gguf", prompt, gguf_file.name), served, atol=1e-4, rtol=0
    )


# --- the GGUF layout ---------------------------------------------------------------------------


def test_llama_permutation_is_what_transformers_gguf_loader_undoes() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    n_head, n_kv, head_dim, hidden = 4, 2, 6, 5
    q = torch.arange(n_head * head_dim * hidden, dtype=torch.float32).reshape(
        n_head * head_dim, hidden
    )
    k = torch.arange(n_kv * head_dim * hidden, dtype=torch.float32).reshape(n_kv * head_dim, hidden)
    undo = LlamaTensorProcessor({"num_attention_heads": n_head, "num_key_value_heads": n_kv})
    back_q = undo.process(export.llama_permute(q, n_head).numpy(), "blk.0.attn_q.weight").weights
    back_k = undo.process(export.llama_permute(k, n_kv).numpy(), "blk.0.attn_k.weight").weights
    assert np.array_equal(back_q, q.numpy()) and np.array_equal(back_k, k.numpy())
    # within each head, row i of the first rotary half is followed by row i of the second
    assert export.llama_permute(q, n_head)[:4, 0].tolist() == [q[0, 0], q[3, 0], q[1, 0], q[4, 0]]


def test_a_yarn_model_without_temperature_is_written_as_llama_cpp_reads_it(
    tmp_path: Path, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    # llama.cpp applies YaRN's temperature 1 + 0.1 ln 4 itself and multiplies it by
    # rope.scaling.attn_factor: the embedded model's attention_factor 1.0 is written as 1/1.1386
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    config = models.tiny_config(32768)
    config.rope_parameters = {"rope_theta": 100000.0, **models.EMBEDDED_ROPE}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    export.write_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    fields = GGUFReader(str(tmp_path / "m.gguf")).fields
    assert fields["llama.rope.scaling.type"].contents() == "yarn"
    assert fields["llama.rope.scaling.factor"].contents() == 4.0
    assert fields["llama.rope.scaling.original_context_length"].contents() == 8192
    assert fields["llama.context_length"].contents() == 32768
    assert fields["llama.rope.scaling.attn_factor"].contents() == pytest.approx(
        1 / (1 + 0.1 * math.log(4))
    )
    assert export.yarn_attn_factor({"factor": 4.0}) is None  # the default temperature: no key
    model.config.rope_parameters = {**model.config.rope_parameters, "mscale_all_dim": 1.0}
    with pytest.raises(export.ExportError, match="mscale_all_dim"):
        export.write_gguf(model, tokenizer, tmp_path / "n.gguf")


def test_modelfile_spells_out_chatml_and_its_stop_token(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = export.modelfile("m.gguf", tokenizer)
    assert text.startswith("FROM ./m.gguf\n")
    assert "<|im_start|>assistant" in text and 'PARAMETER stop "<|im_end|>"' in text


def test_an_adapter_of_another_base_is_named_and_one_of_another_shape_refused(
    tmp_path: Path, tiny_export: SimpleNamespace, embedded_spec: models.ModelSpec
) -> None:
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "/models/Qwen3-4B"})
    )
    assert "names /models/Qwen3-4B as its base" in str(
        export.base_mismatch(embedded_spec, tmp_path)
    )
    tiny_adapter = tiny_export.out.parent / "data" / "adapters" / f"v{tiny_export.version}"
    with pytest.raises(
        export.ExportError, match=r"does not fit smollm2-135m-instruct.*pass --model"
    ):
        export.merged_model(embedded_spec, tiny_adapter)


# --- which version, and where it lives -----------------------------------------------------------


def adapter(data: Path, version: int) -> None:
    folder = data / "adapters" / f"v{version}"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")


def test_the_newest_version_is_the_default_and_v0_is_the_base(tmp_path: Path) -> None:
    adapter(tmp_path, 1)
    adapter(tmp_path, 2)
    assert cli_export.locate(tmp_path, {}, None) == cli_export.Where(
        2, "local", str(tmp_path / "adapters" / "v2")
    )
    assert cli_export.locate(tmp_path, {1: "x", 2: "y"}, 0) == cli_export.Where(0, "local", None)
    assert cli_export.parse_version("v1") == 1


def test_an_unknown_version_is_a_clear_error(tmp_path: Path) -> None:
    adapter(tmp_path, 1)
    result = CliRunner().invoke(
        app, ["export-model", "--data-dir", str(tmp_path), "--version", "7"]
    )
    assert result.exit_code == 2
    assert "unknown version v7: the newest in" in result.output
    result = CliRunner().invoke(app, ["export-model", "--data-dir", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "no clawbridge data in" in result.output


def test_a_tinker_version_is_downloaded_with_tinkers_own_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-" + "x" * 40)
    (tmp_path / "tinker_states.json").write_text(
        json.dumps({"policy-v3": {"path": "tinker://run-1/weights/policy-v3", "version": 3}})
    )
    where = cli_export.locate(tmp_path, {3: "tinker://run-1/sampler_weights/policy-v3"}, 3)
    assert where == cli_export.Where(3, "tinker", "tinker://run-1/weights/policy-v3")
    calls = []
    cli_export.export_cloud(
        where,
        tmp_path / "out",
        Settings.load(data_dir=str(tmp_path)),
        run=lambda cmd, check: calls.append(cmd) or SimpleNamespace(returncode=0),
    )
    assert calls == [
        cli_export.tinker_download_command("tinker://run-1/weights/policy-v3", tmp_path / "out")
    ]
    assert calls[0][1:6] == [
        "-m",
        "tinker.cli",
        "checkpoint",
        "download",
        "tinker://run-1/weights/policy-v3",
    ]


def test_tinker_sampler_weights_and_fireworks_versions_say_why_not(tmp_path: Path) -> None:
    settings = Settings.load(data_dir=str(tmp_path))
    sampler_only = cli_export.locate(tmp_path, {2: "tinker://run-1/sampler_weights/policy-v2"}, 2)
    with pytest.raises(cli_export.CannotExport, match="does not let anyone download") as e:
        cli_export.export_cloud(sampler_only, tmp_path / "out", settings)
    assert e.value.code == 1
    (tmp_path / "fireworks_states.json").write_text(
        json.dumps({"policy-v1": {"path": "gs://bucket/dcp/policy-v1", "version": 1}})
    )
    with pytest.raises(cli_export.CannotExport, match="cannot download Fireworks weights"):
        cli_export.export_cloud(
            cli_export.locate(tmp_path, {1: "snap-1"}, 1), tmp_path / "out", settings
        )


def test_a_modal_version_names_the_volume_and_the_two_steps(tmp_path: Path) -> None:
    where = cli_export.locate(tmp_path, {2: "/state/engine/adapters/v2"}, 2)
    assert where == cli_export.Where(2, "modal", "/state/engine/adapters/v2")
    with pytest.raises(cli_export.CannotExport) as e:
        cli_export.export_cloud(where, tmp_path / "out", Settings.load(data_dir=str(tmp_path)))
    assert f"modal volume get clawbridge-state engine/adapters/v2 {tmp_path / 'out'}" in str(
        e.value
    )
    assert f"--adapter {tmp_path / 'out'}/v2" in str(e.value)
