"""The renderer against the embedded model's real tokenizer (ChatML, byte-level BPE)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from clawbridge.chat.decode import token_bytes_table
from clawbridge.chat.messages import AssistantMessage, Delta, RenderError, merge_deltas
from clawbridge.chat.renderer import Renderer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

# A Qwen-style template that takes `tools` natively and opens a <think> block in the prompt.
NATIVE_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> Renderer:
    return Renderer(tokenizer)


def counter_ids() -> Any:
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def byte_ids(tokenizer: Any, text: str) -> list[int]:
    """One token per UTF-8 byte (byte-level BPE has a token for every byte), so that feeding
    these ids in chunks splits the text at every byte boundary, inside characters too."""
    table = token_bytes_table(tokenizer)
    single = {t: i for i, t in enumerate(table) if len(t) == 1 and i > 16}
    return [single[bytes([b])] for b in text.encode()]


def template_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def concat(deltas: list[Delta]) -> tuple[str, str, list[tuple[int, str, str]]]:
    content = "".join(d.content for d in deltas if d.content is not None)
    reasoning = "".join(d.reasoning_content for d in deltas if d.reasoning_content is not None)
    calls = [(d.tool_call.index, d.tool_call.name, d.tool_call.arguments) for d in deltas if d.tool_call]
    return content, reasoning, calls


def as_triple(msg: AssistantMessage) -> tuple[str, str, list[tuple[int, str, str]]]:
    calls = [(i, c.name, c.arguments) for i, c in enumerate(msg.tool_calls)]
    return msg.content or "", msg.reasoning_content or "", calls


# --- prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
        [
            {"role": "system", "content": "Tu es poli. 😀"},
            {"role": "user", "content": "你好，世界"},
            {"role": "assistant", "content": "Bonjour ! ¿Qué tal?"},
            {"role": "user", "content": "  spaces and\n\nnewlines  "},
        ],
    ],
)
def test_plain_chat_prompt_equals_the_models_chat_template(renderer: Renderer, tokenizer: Any, messages: list[dict[str, Any]]) -> None:
    assert renderer.render(messages) == template_ids(tokenizer, messages)


def test_text_parts_developer_role_and_names_are_normalised_for_chatml(renderer: Renderer, tokenizer: Any) -> None:
    messages = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ]
    expected = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "one\ntwo"}]
    assert renderer.render(messages) == template_ids(tokenizer, expected)


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_non_text_content_parts_are_rejected_naming_the_part_type(renderer: Renderer, kind: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": kind, kind: {}}]}]
    with pytest.raises(RenderError, match=kind):
        renderer.render(messages)


def test_unknown_roles_and_empty_conversations_are_rejected(renderer: Renderer) -> None:
    with pytest.raises(RenderError, match="role"):
        renderer.render([{"role": "narrator", "content": "x"}])
    with pytest.raises(RenderError, match="non-empty"):
        renderer.render([])


def test_stop_token_ids_include_the_chatml_end_of_turn(renderer: Renderer, tokenizer: Any) -> None:
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in renderer.stop_token_ids
    assert tokenizer.eos_token_id in renderer.stop_token_ids


# --- tools: fallback for ChatML -----------------------------------------------------------------


def test_tool_fallback_puts_schemas_in_the_system_message_and_replays_calls_as_tool_call_json(renderer: Renderer) -> None:
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    text = renderer.render_text(messages, tools=[WEATHER], tool_choice="auto")
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou help.\n\n# Tools")
    assert json.dumps(WEATHER) in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tool_fallback_without_a_system_message_adds_one(renderer: Renderer) -> None:
    text = renderer.render_text([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools")
    assert "SmolLM" not in text  # our system message replaces the template's default one


def test_tool_choice_none_offers_no_tools_and_a_named_choice_offers_only_that_one(renderer: Renderer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert "# Tools" not in renderer.render_text(msgs, tools=[WEATHER, CLOCK], tool_choice="none")
    named = renderer.render_text(msgs, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in named and "get_weather" not in named
    assert "You must call the function get_time." in named
    assert "You must call at least one function." in renderer.render_text(msgs, tools=[WEATHER], tool_choice="required")
    with pytest.raises(RenderError, match="nope"):
        renderer.render(msgs, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ("get_weather", "must be a list"),
        ([{"type": "retrieval"}], "function"),
        ([{"type": "function"}], "function must be an object"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "name"),
        ([{"type": "function", "function": {"parameters": {}}}], "name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "type 'object'"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "JSON Schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 1}}}}], "properties"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}], "required"),
        ([CLOCK, CLOCK], "duplicate"),
    ],
)
def test_invalid_tools_are_rejected_with_a_clear_message(renderer: Renderer, tools: Any, match: str) -> None:
    with pytest.raises(RenderError, match=match):
        renderer.render([{"role": "user", "content": "hi"}], tools=tools)


def test_a_rendered_tool_call_parses_back_to_the_same_call(renderer: Renderer, tokenizer: Any) -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    text = renderer.render_text([{"role": "user", "content": "w?"}, {"role": "assistant", "content": "Checking.", "tool_calls": [call]}])
    assistant = text.split("<|im_start|>assistant\n")[1]  # the replayed turn, up to and with <|im_end|>
    assistant = assistant[: assistant.index("<|im_end|>") + len("<|im_end|>")]
    msg = renderer.parse(ids_of(tokenizer, assistant), "stop")
    assert msg.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [("get_weather", {"city": "Zürich"})]
    assert msg.finish_reason == "tool_calls"


# --- tools: templates that take them natively ----------------------------------------------------


def test_a_template_with_tool_support_receives_tools_and_structured_calls(tokenizer: Any) -> None:
    native = Renderer(tokenizer, chat_template=NATIVE_TEMPLATE)
    assert native.supports_tools and native.opens_think
    messages = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c", "content": "snow"},
    ]
    text = native.render_text(messages, tools=[WEATHER])
    assert "# Tools\n<tools>" + json.dumps(WEATHER) in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\nsnow\n</tool_response>" in text
    assert native.render(messages, tools=[WEATHER]) == ids_of(tokenizer, text)


@pytest.mark.parametrize("template", [None, NATIVE_TEMPLATE])
def test_the_template_called_directly_renders_what_apply_chat_template_renders(tokenizer: Any, template: str | None) -> None:
    r = Renderer(tokenizer, chat_template=template)
    assert r._direct is not None  # the fast call is in use for these templates
    messages = [
        {"role": "system", "content": "Sys. 😀"},
        {"role": "user", "content": "w?", "name": "al"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c", "content": "snow"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "now?"}]},
    ]
    for n in range(1, len(messages) + 1):
        for tools in (None, [WEATHER]):
            norm, native = r.normalise(messages[:n], tools)
            for generation in (True, False):
                assert r._template_text(norm, native, generation=generation) == tokenizer.apply_chat_template(
                    norm, tools=native, chat_template=r.chat_template, add_generation_prompt=generation, tokenize=False
                )


def test_a_prompt_that_opens_think_makes_the_completion_start_as_reasoning(tokenizer: Any) -> None:
    native = Renderer(tokenizer, chat_template=NATIVE_TEMPLATE)
    msg = native.parse(ids_of(tokenizer, "Let me think.\n</think>\n\nIt is 4.<|im_end|>"), "stop")
    assert (msg.reasoning_content, msg.content) == ("Let me think.", "It is 4.")


# --- parsing ------------------------------------------------------------------------------------


def test_parse_strips_the_end_token_and_keeps_the_finish_reason(renderer: Renderer, tokenizer: Any) -> None:
    assert renderer.parse(ids_of(tokenizer, "Hello 😀 世界<|im_end|>"), "stop") == AssistantMessage("Hello 😀 世界", None, (), "stop")
    truncated = renderer.parse(ids_of(tokenizer, "Hello wor"), "length")
    assert (truncated.content, truncated.finish_reason) == ("Hello wor", "length")


def test_parse_text_equals_the_tokenizers_own_decode(renderer: Renderer, tokenizer: Any) -> None:
    text = "Ünïcödé 😀👍🏽 中文字符 — tabs\tand\nnewlines, code `x<y>`"
    ids = ids_of(tokenizer, text)
    assert renderer.decode(ids) == tokenizer.decode(ids) == text
    assert renderer.parse(ids).content == text


def test_reasoning_is_extracted_from_think_tags(renderer: Renderer, tokenizer: Any) -> None:
    msg = renderer.parse(ids_of(tokenizer, "<think>\nStep 1. Step 2.\n</think>\n\nThe answer is 4.<|im_end|>"))
    assert (msg.reasoning_content, msg.content) == ("Step 1. Step 2.", "The answer is 4.")
    unclosed = renderer.parse(ids_of(tokenizer, "<think>still thinking"), "length")
    assert (unclosed.reasoning_content, unclosed.content) == ("still thinking", "")


def test_multiple_tool_calls_with_loose_whitespace_are_extracted_with_fresh_ids(renderer: Renderer, tokenizer: Any) -> None:
    text = (
        'Let me look.\n<tool_call>  {"name": "get_weather", "arguments": {"city": "Paris"}}\n\n</tool_call>\n'
        '<tool_call>\n{"name":"get_time","arguments":{}}</tool_call><|im_end|>'
    )
    msg = renderer.parse(ids_of(tokenizer, text))
    assert msg.content == "Let me look."
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == 2
    assert msg.finish_reason == "tool_calls"
    assert msg.to_openai()["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_tool_call_with_malformed_json_stays_content(renderer: Renderer, tokenizer: Any) -> None:
    msg = renderer.parse(ids_of(tokenizer, '<tool_call>{"name": "get_weather", "arguments": {city}}</tool_call><|im_end|>'))
    assert msg.tool_calls == ()
    assert msg.content == '<tool_call>{"name": "get_weather", "arguments": {city}}</tool_call>'
    assert msg.finish_reason == "stop"


def test_content_is_null_when_only_tool_calls_were_made(renderer: Renderer, tokenizer: Any) -> None:
    msg = renderer.parse(ids_of(tokenizer, '<tool_call>{"name": "get_time"}</tool_call><|im_end|>'))
    assert msg.content is None and msg.to_openai()["content"] is None
    assert msg.tool_calls[0].arguments == "{}"


def test_a_stop_string_ends_the_content_even_mid_token(renderer: Renderer, tokenizer: Any) -> None:
    msg = renderer.parse(ids_of(tokenizer, "First line.\nSTOP and the rest"), "stop", stop=["STOP"])
    assert msg.content == "First line."
    assert renderer.parse(ids_of(tokenizer, "no stop here"), stop=["STOP"]).content == "no stop here"


# --- streaming ----------------------------------------------------------------------------------

STREAM_CASES = [
    "Emoji 😀👍🏽 and CJK 中文字符, ¿qué? — ok",
    "<think>思考 😀 a < b</think>\n答案: 42 🎉",
    'Calling 🌍.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "<tool_call>{broken 😀</tool_call> then <thin and <tool_cal> text",
]


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streamed_deltas_equal_parse_when_split_at_every_byte_boundary(renderer: Renderer, tokenizer: Any, text: str) -> None:
    ids = [*byte_ids(tokenizer, text), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    expected = as_triple(renderer.parse(ids, "stop"))
    for cut in range(len(ids) + 1):
        decoder = renderer.stream()
        deltas = decoder.feed(ids[:cut]) + decoder.feed(ids[cut:]) + decoder.finish("stop")
        assert concat(deltas) == expected, f"split at byte {cut}"
        assert not any("\ufffd" in (d.content or "") + (d.reasoning_content or "") for d in deltas)
    one_by_one = renderer.stream()
    deltas = [d for i in ids for d in one_by_one.feed([i])] + one_by_one.finish("stop")
    assert concat(deltas) == expected


def test_streaming_releases_plain_text_as_it_arrives(renderer: Renderer, tokenizer: Any) -> None:
    decoder = renderer.stream()
    ids = byte_ids(tokenizer, "中")
    assert decoder.feed(ids[:2]) == []  # half a character is held, never U+FFFD
    assert decoder.feed(ids[2:]) == [Delta(content="中")]
    assert decoder.feed(ids_of(tokenizer, " and <tool")) == [Delta(content=" and")]  # tag prefix held
    assert decoder.feed(ids_of(tokenizer, "box> ok")) == [Delta(content=" <toolbox> ok")]


def test_tool_call_deltas_carry_their_index_and_a_whole_call(renderer: Renderer, tokenizer: Any) -> None:
    text = STREAM_CASES[2]
    decoder = renderer.stream(id_factory=counter_ids())
    deltas = [d for i in ids_of(tokenizer, text) for d in decoder.feed([i])] + decoder.finish("stop")
    calls = [d.tool_call.to_openai() for d in deltas if d.tool_call]
    assert calls == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert decoder.finish_reason == "tool_calls"
    assert decoder.message().tool_calls[1].id == "call_1"


def test_deltas_merge_into_one_openai_delta_object(renderer: Renderer, tokenizer: Any) -> None:
    decoder = renderer.stream(id_factory=counter_ids())
    deltas = decoder.feed(ids_of(tokenizer, '<think>hm</think>Yes.<tool_call>{"name": "f"}</tool_call>')) + decoder.finish()
    assert merge_deltas(deltas) == {
        "reasoning_content": "hm",
        "content": "Yes.",
        "tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert merge_deltas([]) is None


@pytest.mark.parametrize("stop", [["END"], ["\n\n", "😀!"]])
def test_streaming_with_stop_strings_matches_parse_at_every_split(renderer: Renderer, tokenizer: Any, stop: list[str]) -> None:
    text = "Some 😀 text EN and\nthen 😀! done\n\nEND tail"
    ids = byte_ids(tokenizer, text)
    expected = as_triple(renderer.parse(ids, "stop", stop=stop))
    assert "tail" not in expected[0]
    for cut in range(len(ids) + 1):
        decoder = renderer.stream(stop)
        deltas = decoder.feed(ids[:cut]) + decoder.feed(ids[cut:]) + decoder.finish("stop")
        assert concat(deltas) == expected, f"split at byte {cut}"


# --- incremental prompts ------------------------------------------------------------------------


def long_session(turns: int) -> list[list[dict[str, Any]]]:
    """Requests of an OpenClaw-like session: a big system prompt, tool calls, and a rebuilt
    internal-context message at the end of every request that is never kept in history."""
    system = "You are an agent.\n" + "\n".join(f"Rule {i}: be careful with 😀, 中文 and café #{i}." for i in range(300))
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    requests = []
    for t in range(turns):
        history.append({"role": "user", "content": f"[Sun 2026-11-22 08:{t:02d} UTC] question {t} — ¿sí?"})
        internal = {"role": "user", "content": [{"type": "text", "text": f"<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> turn {t}"}]}
        requests.append([*history, internal])
        if t % 3 == 1:
            history.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call{t}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": f"C{t}"})}}
            ]})
            history.append({"role": "tool", "tool_call_id": f"call{t}", "content": f"result {t} ✓"})
        history.append({"role": "assistant", "content": f"Answer {t}: " + "lorem ipsum " * 20})
    return requests


def test_incremental_render_equals_full_render_on_a_long_session(tokenizer: Any) -> None:
    incremental = Renderer(tokenizer)
    full = Renderer(tokenizer, incremental=False)
    requests = long_session(12)
    for messages in requests:
        assert incremental.render(messages, tools=[WEATHER]) == full.render(messages, tools=[WEATHER])
    assert incremental._cache is not None and incremental._cache.hits == len(requests) - 1
    # other sessions sharing the system prompt, an edited history, and a changed tool list
    edited = [dict(m) for m in requests[-1]]
    edited[3] = {"role": "assistant", "content": "a different earlier answer"}
    for messages, tools in ((requests[0], [WEATHER]), (edited, [WEATHER]), (requests[-1], [WEATHER, CLOCK]), (requests[-1], None)):
        assert incremental.render(messages, tools=tools) == full.render(messages, tools=tools)


def test_a_request_sent_twice_then_continued_renders_exactly(tokenizer: Any) -> None:
    """A retry shares every message with its base (nothing new to render); the request after it
    drops the rebuilt last message, so it must start from the boundary before that message."""
    incremental = Renderer(tokenizer)
    full = Renderer(tokenizer, incremental=False)
    sys_ = {"role": "system", "content": "Sys."}
    ctx0 = {"role": "user", "content": "internal context 0"}
    first = [sys_, {"role": "user", "content": "q0"}, ctx0]
    then = [*first[:2], {"role": "assistant", "content": "a0"}, {"role": "user", "content": "q1"},
            {"role": "user", "content": "internal context 1"}]
    for messages in (first, first, then):
        assert incremental.render(messages) == full.render(messages)
    assert incremental._cache is not None and incremental._cache.text_hits == 2


def test_incremental_render_equals_apply_chat_template_for_plain_growth(tokenizer: Any) -> None:
    incremental = Renderer(tokenizer)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "S 😀"}]
    for t in range(6):
        messages.append({"role": "user", "content": f"u{t} 中文"})
        assert incremental.render(messages) == template_ids(tokenizer, messages)
        messages.append({"role": "assistant", "content": f"a{t} ok"})


def test_incremental_render_of_a_10k_token_session_uses_the_prefix_cache(tokenizer: Any) -> None:
    """Speed is measured by bench/renderer.py; here: equal ids, and the cache really serves."""
    requests, tools = openclaw_sized_session(8)
    incremental, full = Renderer(tokenizer), Renderer(tokenizer, incremental=False)
    for messages in requests:
        expected = full.render(messages, tools=tools)
        assert incremental.render(messages, tools=tools) == expected
    assert len(expected) > 10_000
    assert incremental._cache is not None and incremental._cache.hits == len(requests) - 1
    # the chat template itself rendered only the new messages after the first request
    assert incremental._cache.text_hits == len(requests) - 1


# A template that looks ahead: reasoning is shown only on assistant turns after the last user
# message (as Qwen3's does), so a new user message changes how earlier turns render.
LOOKAHEAD_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}{% endfor %}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Consecutive tool results share one user block (Qwen2.5 style): a tool message's end depends on
# the message after it.
GROUPING_TEMPLATE = """
{%- for m in messages %}
{%- if m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>{{ m.content }}</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_looks_ahead_is_rendered_in_full_and_stays_exact(tokenizer: Any) -> None:
    incremental = Renderer(tokenizer, chat_template=LOOKAHEAD_TEMPLATE)
    full = Renderer(tokenizer, chat_template=LOOKAHEAD_TEMPLATE, incremental=False)
    assert incremental._gen_suffix is None  # the probe found it is not prefix-stable
    history: list[dict[str, Any]] = [{"role": "system", "content": "S"}]
    for t in range(5):
        history.append({"role": "user", "content": f"u{t}"})
        assert incremental.render(history) == full.render(history)
        history.append({"role": "assistant", "content": f"a{t}", "reasoning_content": f"r{t}"})


def test_consecutive_tool_results_in_one_block_render_exactly(tokenizer: Any) -> None:
    incremental = Renderer(tokenizer, chat_template=GROUPING_TEMPLATE)
    full = Renderer(tokenizer, chat_template=GROUPING_TEMPLATE, incremental=False)
    history: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "go"}]
    for t in range(4):
        history.append({"role": "assistant", "content": f"calling {t}"})
        for k in range(t % 3 + 1):  # one, two, three results in a row; requests end on each
            history.append({"role": "tool", "content": f"r{t}.{k}"})
            assert incremental.render(history) == full.render(history)
    # some requests extended their base, and the grouped ones fell back to full renders
    assert incremental._gen_suffix is not None and incremental._cache is not None
    assert 0 < incremental._cache.text_hits < 7


def test_a_caller_changing_its_messages_after_a_render_cannot_change_a_later_render(tokenizer: Any) -> None:
    incremental, full = Renderer(tokenizer), Renderer(tokenizer, incremental=False)
    assert incremental._gen_suffix is not None  # the cache is in use, text level included
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"},
    ]
    incremental.render(messages, tools=[WEATHER])
    messages[1]["content"] = "edited in place"
    call["function"]["arguments"] = '{"city": "Rome"}'
    messages.append({"role": "user", "content": "thanks"})
    assert incremental.render(messages, tools=[WEATHER]) == full.render(messages, tools=[WEATHER])


def test_values_that_compare_equal_but_render_differently_are_not_shared(tokenizer: Any) -> None:
    incremental, full = Renderer(tokenizer), Renderer(tokenizer, incremental=False)

    def convo(value: Any) -> list[dict[str, Any]]:  # 1 == 1.0 == True in Python, not in JSON
        args = {"n": value}
        return [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]},
                {"role": "user", "content": "y"}]

    assert incremental._gen_suffix is not None  # the cache is in use, text level included
    for value in (1, True, 1.0):
        assert incremental.render(convo(value)) == full.render(convo(value))


def openclaw_sized_session(turns: int) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """An OpenClaw-sized session (~10 K-token prompt, 12 tools) growing turn by turn."""
    tools = [
        {"type": "function", "function": {
            "name": f"tool_{k}", "description": f"Does thing {k}. " * 8,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}},
        }}
        for k in range(12)
    ]
    system = "You are a personal agent.\n" + "\n".join(
        f"- Guideline {i}: for topic {i}, check the workspace files first and answer briefly." for i in range(380)
    )
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    requests = []
    for t in range(turns):
        history.append({"role": "user", "content": f"[Sun 2026-11-22 08:{t:02d} UTC] please do task {t}"})
        requests.append([*history, {"role": "user", "content": [{"type": "text", "text": f"<<<INTERNAL>>> {t}"}]}])
        history.append({"role": "assistant", "content": f"Done with task {t}. " + "Details follow. " * 15})
    return requests, tools


def test_an_unclosed_tool_call_at_the_end_is_a_call_only_if_its_json_is_complete(renderer: Renderer, tokenizer: Any) -> None:
    complete = renderer.parse(ids_of(tokenizer, '<tool_call>\n{"name": "get_time", "arguments": {}}\n'), "length")
    assert [c.name for c in complete.tool_calls] == ["get_time"] and complete.finish_reason == "tool_calls"
    cut = renderer.parse(ids_of(tokenizer, 'Ok <tool_call>{"name": "get_ti'), "length")
    assert (cut.content, cut.tool_calls, cut.finish_reason) == ('Ok\n<tool_call>{"name": "get_ti', (), "length")


def test_sentencepiece_style_byte_fallback_tokens_decode_to_their_bytes() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xB8>": 2, "<0xAD>": 3, "▁hi": 4, "▁": 5, "h": 6, "i": 7, "<|im_end|>": 8}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", unk_token="<unk>",
                                  chat_template="{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    sp = Renderer(tok)
    assert sp.stop_token_ids == (8,)
    assert sp.parse([4, 1, 2, 3, 8]).content == "hi中"
    decoder = sp.stream()
    assert decoder.feed([4, 1, 2]) == [Delta(content="hi")] and decoder.feed([3]) == [Delta(content="中")]
