"""The redaction hook masks personal data and secrets before text leaves for a cloud platform."""

from __future__ import annotations

from clawbridge.backends.redact import DEFAULT, for_backend, redact


def test_emails_are_masked() -> None:
    assert redact("write to jane.doe+work@example.co.uk today") == "write to [EMAIL] today"


def test_phone_numbers_in_common_formats_are_masked() -> None:
    for phone in ("+1 415 555 0134", "(415) 555-0134", "+447911123456", "030 1234 5678"):
        assert redact(f"call {phone} now") == "call [PHONE] now", phone


def test_dates_times_and_versions_are_not_phone_numbers() -> None:
    text = "on 2026-11-22 at 08:47 UTC, version 1.2.28, port 30000, 3 apples"
    assert redact(text) == text


def test_api_key_like_strings_are_masked() -> None:
    keys = [
        "sk-proj-abcdefghijklmnop1234567890",
        "tml-AbCdEfGhIjKlMnOpQrSt1234",
        "fw_3ZkY8mQ2pL9xW4vN7tR1sB6c",
        "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
        "AKIAIOSFODNN7EXAMPLE",
        "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8",  # generic hex secret
    ]
    for key in keys:
        assert redact(f"key={key} ok") == "key=[SECRET] ok", key


def test_bearer_tokens_keep_the_scheme_and_lose_the_token() -> None:
    assert redact("Authorization: Bearer abc.def-ghi_jkl012345678") == "Authorization: Bearer [SECRET]"


def test_ordinary_prose_and_long_words_are_untouched() -> None:
    text = "Internationalization is hard; see https://example.com/docs/page for details."
    assert redact(text) == text


def test_messages_are_redacted_in_every_text_field_and_keep_their_shape() -> None:
    messages = [
        {"role": "system", "content": "You help bob@corp.com"},
        {"role": "user", "content": [{"type": "text", "text": "my number is +1 415 555 0134"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "send", "arguments": '{"to": "bob@corp.com"}'}}]},
    ]
    out = DEFAULT.messages(messages)
    assert out[0]["content"] == "You help [EMAIL]"
    assert out[1]["content"][0]["text"] == "my number is [PHONE]"
    assert out[1]["content"][1] == messages[1]["content"][1]
    assert out[2]["tool_calls"][0]["function"]["arguments"] == '{"to": "[EMAIL]"}'
    assert messages[0]["content"] == "You help bob@corp.com"  # the input is not mutated


def test_extra_patterns_extend_the_defaults() -> None:
    r = DEFAULT.with_patterns({r"\bACME-\d+\b": "[TICKET]"})
    assert r.text("ACME-1234 from a@b.io") == "[TICKET] from [EMAIL]"


def test_local_backend_or_disabled_setting_gets_no_redactor() -> None:
    assert for_backend("local", True) is None
    assert for_backend("tinker", False) is None
    assert for_backend("tinker", True) is DEFAULT


async def test_cloud_prompts_are_redacted_consistently_for_sampling_scoring_and_training(tokenizer) -> None:
    from clawbridge.backends.redact import RedactingBackend, protect
    from clawbridge.backends.remote import RetryPolicy
    from clawbridge.backends.tinker import TinkerBackend
    from clawbridge.types import Datum, SamplingParams
    from fakes.fake_tinker import FakeTinkerService

    service = FakeTinkerService()
    inner = TinkerBackend(service_client=service, base_model=service.known_models[0], tokenizer=tokenizer,
                          retry=RetryPolicy(attempts=2, initial_s=0.01, timeout_s=120.0))
    backend = protect(inner, True)
    assert isinstance(backend, RedactingBackend) and backend.name == "tinker"
    await backend.start()
    def ids(text: str) -> tuple[int, ...]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tuple(tokenizer.encode(chat, add_special_tokens=False))

    prompt = ids("mail jane@corp.com or call +1 415 555 0134")
    (c,) = await backend.sample(prompt, SamplingParams(max_tokens=3))
    await backend.score(prompt, c.tokens)
    await backend.train_step([Datum(prompt, c.tokens, c.logprobs, (1.0,) * len(c.tokens))])
    sent = [tokenizer.decode(ids) for ids in service.platform.seen]
    assert len(sent) >= 3 and all("jane@corp.com" not in t and "555 0134" not in t for t in sent)
    assert all("[EMAIL]" in t and "<|im_start|>" in t for t in sent)
    clean = ids("hello")
    assert backend.prompt(clean) == clean  # nothing to redact: the exact ids go out
    assert protect(inner, False) is inner


# --- issue 14: what the model sees is the user's; ids and digests are not secrets ---------------


def test_redaction_is_off_unless_asked_so_the_model_sees_the_prompt_as_sent() -> None:
    from clawbridge.backends.redact import protect
    from clawbridge.config import Settings

    assert Settings().judging.redact is False

    class Cloud:
        name = "tinker"

    cloud = Cloud()
    assert protect(cloud, Settings().judging.redact) is cloud  # not wrapped: prompts go out unchanged


def test_git_shas_uuids_and_sha256_digests_are_not_secrets() -> None:
    text = ("checkout 3f2a9c1e8b7d6a5f4e3d2c1b0a9f8e7d6c5b4a39, run 550e8400-e29b-41d4-a716-446655440000, "
            "image sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08, "
            "object 9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B")
    assert redact(text) == text
    # a key-like mixed token is still masked when redaction is on
    assert redact("token Zx9kQ2mP7vL4nR8sT1wY6bC3dF5gH0jK2aB") == "token [SECRET]"


async def test_the_judge_endpoint_gets_the_same_redaction_as_a_cloud_backend() -> None:
    import httpx
    from clawbridge.config import Settings
    from clawbridge.judges import build_judges

    sent: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "\\boxed{1}"}}]})

    for asked in (True, False):
        settings = Settings(judge="http", judge_url="http://judge.example/v1", judge_model="m", redact=asked)
        client = build_judges(settings.judging, seed=settings.seed).reward.client  # type: ignore[attr-defined]
        client._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        await client.complete([{"role": "user", "content": "mail jane@example.com"}], temperature=0.0, max_tokens=4)
        assert (b"[EMAIL]" in sent[-1]) is asked and (b"jane@example.com" in sent[-1]) is not asked
