"""Train your own agent: groups of episodes, each a tool-calling run in a real environment loop,
scored by an outcome; clawbridge normalises the outcomes within each group (GRPO) and trains
every assistant turn of every episode on the exact tokens it sampled (docs/agents.md).

    clawbridge up                       # in another terminal (or: --model tiny-random for speed)
    python examples/train_agent.py [--url http://127.0.0.1:30000] [--n 4] [--tasks 3]

The environment: arithmetic questions with a `calculator` tool. An episode offers the tool, runs
the calls the model makes, sends their results back as `tool` messages and repeats until the
model answers in text (or runs out of steps); the outcome is 1.0 when the answer holds the right
number, 0.1 when it at least called the calculator with valid arguments, else 0. The n episodes
of a task run concurrently on the async SDK. The last line is a JSON summary (the test reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from typing import Any

import clawbridge

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 17 * 23"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "You solve arithmetic questions. Call the calculator tool, then answer with the number."


def calculator(expression: str) -> str:
    if not re.fullmatch(r"[\d\s+\-*/().]{1,64}", expression):
        return "error: only digits, spaces and + - * / ( ) are allowed"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))  # the regex keeps it arithmetic
    except (SyntaxError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"


def make_task(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 9)
    return f"What is {a} * {b} + {c}?", a * b + c


class Run:
    """One episode's environment: what the agent did, and the outcome it earned."""

    def __init__(self) -> None:
        self.valid_calls = 0
        self.answer = ""

    def tool(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:  # a result, not a crash: the model learns from it too
            return f"error: arguments are not JSON ({e})"
        if name != "calculator" or not isinstance(args, dict):
            return f"error: unknown tool {name}"
        self.valid_calls += 1
        return calculator(str(args.get("expression", "")))

    def outcome(self, expected: int) -> float:
        if re.search(rf"(?<!\d){expected}(?!\d)", self.answer.replace(",", "")):
            return 1.0
        return 0.1 if self.valid_calls else 0.0


async def episode(ep: clawbridge.AsyncEpisode, model: str, question: str, expected: int,
                  max_tokens: int, max_steps: int) -> float:
    """The environment loop: the same OpenAI tool-calling loop any agent runs."""
    env = Run()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": question}]
    for _ in range(max_steps):
        r = await ep.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,  # type: ignore[arg-type]
        )
        msg = r.choices[0].message
        if not msg.tool_calls:
            env.answer = msg.content or ""
            break
        # Replay the call exactly, then one result per call: they are the turn's next state.
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            fn = call.function  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": env.tool(fn.name, fn.arguments)})
    reward = env.outcome(expected)
    await ep.outcome(reward)
    return reward


async def run(cb: clawbridge.AsyncClient, a: argparse.Namespace) -> dict[str, Any]:
    """The groups, one task each, then their states once the learner settled them."""
    model = (await cb.models())[0]
    rng = random.Random(a.seed)
    groups = []
    for _ in range(a.tasks):
        question, expected = make_task(rng)
        async with cb.group(a.n, task={"question": question, "answer": expected}) as g:
            rewards = await asyncio.gather(*(
                episode(ep, model, question, expected, a.max_tokens, a.max_steps) for ep in g))
        print(f"{g.id}: {question} -> outcomes {rewards}")
        groups.append(g.id)
    # Leaving the block closed each group; the learner settles it in the background: GRPO
    # samples for the trainer, or "dropped" with the reason when every outcome was equal.
    deadline = time.monotonic() + a.wait
    states: dict[str, Any] = {}
    while time.monotonic() < deadline:
        states = {gid: await cb.get_group(gid) for gid in groups if gid is not None}
        if all(s["state"] in ("trained", "dropped") for s in states.values()):
            break
        await asyncio.sleep(0.25)
    return states


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--tasks", type=int, default=3, help="Groups (one task each).")
    ap.add_argument("--n", type=int, default=4, help="Episodes (attempts) per task.")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-steps", type=int, default=3, help="Model calls per episode.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait", type=float, default=20.0, help="Seconds to wait for the groups to settle.")
    a = ap.parse_args()

    async with clawbridge.AsyncClient(a.url, api_key=a.api_key) as cb:
        states = await run(cb, a)
    for gid, s in states.items():
        print(f"{gid}: {s['state']} ({s['reason']})")
    print(json.dumps({"groups": [{"id": gid, "state": s["state"], "reason": s["reason"],
                                  "outcomes": [e["outcome"] for e in s["episodes"]],
                                  "episodes": [e["id"] for e in s["episodes"]]}
                                 for gid, s in states.items()]}))


if __name__ == "__main__":
    asyncio.run(main())
