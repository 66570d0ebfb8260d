"""Explicit feedback: when your app knows how a reply went (a thumbs up, an edit the user made),
say so instead of waiting for the judges to infer it from the next message.

    clawbridge up                       # in another terminal (or: --model tiny-random for speed)
    python examples/explicit_feedback.py [--url http://127.0.0.1:30000] [--api-key KEY]

`session.feedback(reward=+1)` rates the session's last main turn; `hint=...` says what the reply
should have done (it becomes the OPD teacher's hint); `turn_id=` picks another turn. Each turn
takes one feedback (a second answers HTTP 409). The same over HTTP:

    curl http://127.0.0.1:30000/v1/feedback -H 'Content-Type: application/json' \\
      -d '{"session_id": "SESSION", "reward": -1, "hint": "Answer in one sentence."}'
"""

from __future__ import annotations

import argparse
import json

import clawbridge


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args()

    cb = clawbridge.Client(a.url, api_key=a.api_key)
    model = cb.models()[0]
    results = []
    with cb.session(user="feedback-demo") as chat:
        messages = [{"role": "user", "content": "Name a prime number."}]
        r = chat.chat.completions.create(model=model, messages=messages, max_tokens=32)  # type: ignore[arg-type]
        print(f"assistant: {r.choices[0].message.content}")
        # The user clicked thumbs-up on this reply.
        results.append(chat.feedback(reward=1))

        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": "Explain why it is prime."},
        ]
        r = chat.chat.completions.create(model=model, messages=messages, max_tokens=64)  # type: ignore[arg-type]
        print(f"assistant: {r.choices[0].message.content}")
        # The user edited the reply: a negative reward and what it should have said.
        results.append(chat.feedback(reward=-1, hint="Show that no number between 2 and its square root divides it."))

    for fb in results:
        print(f"turn {fb['turn_id']}: reward {fb['reward']}, sample {fb['sample']['id']} ({fb['sample']['state']})")
    print(json.dumps({"session_id": chat.session_id, "feedback": results}))


if __name__ == "__main__":
    main()
