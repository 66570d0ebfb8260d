"""Multi-turn conversations through a load balancer without affinity, then the store's account
of them: the experiment of docs/scale-out.md.

    python examples/scale_out/conversations.py --url http://127.0.0.1:30000 --db "$DATABASE_URL" \
        [--conversations 40] [--turns 3] [--model NAME]

Half the conversations name their session (`X-Session-Id`), half do not (the proxies match
them by their messages). Each turn is a new HTTP connection, so the balancer sends it wherever
it likes. Afterwards the store is read: next states attached out of those expected (every turn
but a conversation's last has one), sessions per conversation, turns stored out of those
answered. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from collections import Counter

from openai import OpenAI


def converse(url: str, model: str, n: int, turns: int, run: str) -> dict[str, int]:
    answered = 0
    for i in range(n):
        tagged = i % 2 == 0
        headers = {"X-Session-Id": f"{run}-{i}"} if tagged else {}
        messages = [{"role": "user", "content": f"[{run}] conversation {i}: name a prime above {10 * i}."}]
        for k in range(turns):
            # a client per turn: a fresh connection, which the balancer routes on its own
            with OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("CLAWBRIDGE_API_KEY", "none")) as client:
                reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                       extra_headers=headers)
            answered += 1
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            if k < turns - 1:
                messages.append({"role": "user", "content": "Thanks! And one more?"})
    return {"answered": answered}


def account(db: str, run: str, n: int, turns: int) -> dict[str, object]:
    from clawbridge.store import Store

    with Store.open(db) as store, store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT t.session_id, ns.turn_id IS NOT NULL FROM turns t LEFT JOIN next_states ns ON ns.turn_id = t.id"
        ).all()
        sessions = {sid for sid, _ in rows}
        of: dict[str, str] = {}  # session -> the conversation it belongs to (by its first message)
        for sid in sessions:
            first = store.session_turns(sid)[0].messages[0]["content"]
            if isinstance(first, str) and first.startswith(f"[{run}]"):
                of[sid] = first
    mine = [r for r in rows if r[0] in of]
    per_conversation = Counter(of.values())
    return {
        "conversations": n,
        "sessions": len(of),
        "conversations_split": sum(1 for c in per_conversation.values() if c > 1),
        "turns_stored": len(mine),
        "next_states_expected": n * (turns - 1),
        "next_states_attached": sum(1 for _, attached in mine if attached),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--db", required=True, help="the proxies' store (postgresql+psycopg://...)")
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--turns", type=int, default=3)
    a = ap.parse_args()
    run = uuid.uuid4().hex[:8]
    t0 = time.monotonic()
    out: dict[str, object] = {"run": run, **converse(a.url, a.model, a.conversations, a.turns, run)}
    out["seconds"] = round(time.monotonic() - t0, 1)
    time.sleep(1.0)  # a next state is written just after the response that carried it
    out.update(account(a.db, run, a.conversations, a.turns))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
