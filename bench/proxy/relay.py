"""A minimal Python HTTP relay (aiohttp server + aiohttp client): the floor for a Python hop."""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    a = ap.parse_args()

    async def start(app: web.Application) -> None:
        app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["s"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app["s"].request(
            request.method, a.upstream + request.path, data=body,
            headers={"Content-Type": "application/json"},
        ) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/v1/models", relay)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
