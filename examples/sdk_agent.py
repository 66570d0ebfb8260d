"""A custom agent on the clawbridge SDK: one tagged session, a few turns, one streamed reply.

    clawbridge up                       # in another terminal (or: --model tiny-random for speed)
    python examples/sdk_agent.py [--url http://127.0.0.1:30000] [--api-key KEY]

Every request of the session carries its id, so each reply is recorded as a main turn and the
next user message becomes that turn's next state (what the judges read). Leaving the `with`
block marks the session done.
"""

from __future__ import annotations

import argparse

import clawbridge

USER_TURNS = [
    "Give me one tip for writing clear commit messages.",
    "Thanks! Can you make it shorter?",
    "Perfect, that's what I wanted.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--user", default="demo-user")
    a = ap.parse_args()

    cb = clawbridge.Client(a.url, api_key=a.api_key)
    model = cb.models()[0]
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a concise assistant."}]
    with cb.session(user=a.user) as chat:  # an openai.OpenAI that tags every request
        for i, text in enumerate(USER_TURNS):
            messages.append({"role": "user", "content": text})
            print(f"user: {text}")
            if i == 0:  # streamed, token by token
                print("assistant: ", end="", flush=True)
                parts = []
                for chunk in chat.chat.completions.create(
                    model=model, messages=messages, max_tokens=64, stream=True  # type: ignore[arg-type]
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        parts.append(chunk.choices[0].delta.content)
                        print(chunk.choices[0].delta.content, end="", flush=True)
                print()
                reply = "".join(parts)
            else:
                r = chat.chat.completions.create(model=model, messages=messages, max_tokens=64)  # type: ignore[arg-type]
                reply = r.choices[0].message.content or ""
                print(f"assistant: {reply}")
            messages.append({"role": "assistant", "content": reply})
        print(f"session {chat.session_id} done")
    s = cb.status()
    print(f"server: {s['requests']} requests, {s['store']['turns']} turns captured, policy@v{s['version']}")


if __name__ == "__main__":
    main()
