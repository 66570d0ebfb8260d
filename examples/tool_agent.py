"""A tool-calling agent on the async SDK: the tool results it sends back are the next state of the
turn that called the tool, so clawbridge judges (and trains) the call by what the tool returned.

    clawbridge up                       # in another terminal (or: --model tiny-random for speed)
    python examples/tool_agent.py [--url http://127.0.0.1:30000] [--api-key KEY]

The loop is the ordinary OpenAI one: offer tools, run the calls the model makes, send their
results as `tool` messages, repeat until the model answers in text; then the user speaks again.
Small models often answer without calling the tool: the loop handles both. The last line is a
JSON summary (the test reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import clawbridge

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]
WEATHER = {"paris": "14°C, light rain", "tokyo": "21°C, clear", "lima": "19°C, overcast"}


def get_weather(city: str) -> str:
    return WEATHER.get(city.strip().lower(), "no data for that city")


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:  # the model's JSON is not always valid: say so, as a result
        return f"error: arguments are not JSON ({e})"
    if name == "get_weather" and isinstance(args, dict):
        return get_weather(str(args.get("city", "")))
    return f"error: unknown tool {name}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-steps", type=int, default=4, help="Model calls per user message.")
    a = ap.parse_args()

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer weather questions. Call get_weather for facts."},
    ]
    tool_calls_made = 0
    async with clawbridge.AsyncClient(a.url, api_key=a.api_key) as cb, cb.session(user="tool-agent") as chat:
        model = (await cb.models())[0]
        for text in ["What's the weather in Paris?", "And in Tokyo? Answer in five words."]:
            messages.append({"role": "user", "content": text})
            print(f"user: {text}")
            for _ in range(a.max_steps):
                r = await chat.chat.completions.create(
                    model=model, messages=messages, tools=TOOLS, max_tokens=a.max_tokens  # type: ignore[arg-type]
                )
                msg = r.choices[0].message
                if not msg.tool_calls:
                    messages.append({"role": "assistant", "content": msg.content or ""})
                    print(f"assistant: {msg.content}")
                    break
                # Replay the assistant's call exactly, then one result per call: together they are
                # the next state clawbridge attaches to the turn that made the call.
                messages.append(msg.model_dump(include={"role", "content", "tool_calls"}))
                for call in msg.tool_calls:
                    fn = call.function  # type: ignore[union-attr]
                    result = run_tool(fn.name, fn.arguments)
                    tool_calls_made += 1
                    print(f"tool {fn.name}({fn.arguments}) -> {result}")
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        session_id = chat.session_id
    print(json.dumps({"session_id": session_id, "tool_calls": tool_calls_made, "messages": len(messages)}))


if __name__ == "__main__":
    asyncio.run(main())
