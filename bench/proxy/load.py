"""The load generator: N concurrent clients, each sending requests back to back, timing the full
response and (streaming) the first content chunk. aiohttp's client: cheap per request, so the
client does not drown out what it measures on a 2-core machine."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

WORDS = ["agent", "tool", "file", "shell", "search", "memory", "session", "context", "reply", "message", "model", "token", "server", "config", "plugin", "workspace", "channel", "cron", "heartbeat", "skill", "browser", "gateway", "policy"]


@dataclass
class Cell:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    wall: float = 0.0


def short_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Say something nice about request {i}."}]


def big_system(chars: int = 36_000, seed: int = 7) -> str:
    rng = random.Random(seed)
    out, n = [], 0
    while n < chars:
        line = " ".join(rng.choice(WORDS) for _ in range(12)) + ".\n"
        out.append(line)
        n += len(line)
    return "".join(out)


def tools(k: int = 12) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{j}",
                "description": "Runs a workspace operation. " * 12,
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "Where. " * 10},
                                   "mode": {"type": "string", "enum": ["read", "write", "list"]}},
                    "required": ["path"],
                },
            },
        }
        for j in range(k)
    ]


async def one(s: aiohttp.ClientSession, url: str, body: dict, stream: bool, cell: Cell) -> str:
    t0 = time.perf_counter()
    try:
        async with s.post(url, data=json.dumps(body), headers={"Content-Type": "application/json",
                                                              "Authorization": "Bearer sk-bench"}) as r:
            if r.status != 200:
                await r.read()
                cell.errors += 1
                return ""
            if not stream:
                data = await r.json(content_type=None)
                cell.latencies.append(time.perf_counter() - t0)
                return data["choices"][0]["message"]["content"] or ""
            text, first = [], None
            buf = b""
            async for piece in r.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                        continue
                    obj = json.loads(ev[6:])
                    for ch in obj.get("choices") or ():
                        c = ch.get("delta", {}).get("content")
                        if c:
                            if first is None:
                                first = time.perf_counter() - t0
                            text.append(c)
            cell.latencies.append(time.perf_counter() - t0)
            if first is not None:
                cell.ttfts.append(first)
            return "".join(text)
    except (TimeoutError, aiohttp.ClientError):
        cell.errors += 1
        return ""


async def run_cell(url: str, model: str, clients: int, total: int, stream: bool) -> Cell:
    cell = Cell()
    per = max(1, total // clients)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def client(c: int) -> None:
            for i in range(per):
                body = {"model": model, "messages": short_messages(c * per + i), "stream": stream,
                        "max_tokens": 32}
                await one(s, url, body, stream, cell)

        await one(s, url, {"model": model, "messages": short_messages(-1)}, False, Cell())  # warm
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        cell.wall = time.perf_counter() - t0
    return cell


async def run_conversation(url: str, model: str, turns: int, stream: bool) -> Cell:
    """One OpenClaw-sized session (10 K-token system + tools), growing turn by turn, untagged."""
    cell = Cell()
    system = {"role": "system", "content": big_system()}
    hist: list[dict] = [system]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        t0 = time.perf_counter()
        for t in range(turns):
            hist.append({"role": "user", "content": f"[Sun 2026-11-22 08:{t:02d} UTC] step {t}: keep going"})
            body = {"model": model, "messages": hist, "tools": tools(), "tool_choice": "auto",
                    "stream": stream, "max_completion_tokens": 32}
            if stream:
                body["stream_options"] = {"include_usage": True}
            text = await one(s, url, body, stream, cell)
            hist.append({"role": "assistant", "content": text})
        cell.wall = time.perf_counter() - t0
    return cell
