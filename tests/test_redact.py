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
