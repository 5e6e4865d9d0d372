"""The fleet's router: one OpenAI-compatible URL in front of N servers. Each request goes
whole to the server its route picks (routing.py), its answer streamed back byte for byte;
the router keeps each server's requests in flight, which the prefix route weighs."""

from __future__ import annotations

import json
import logging
from typing import Sequence

import aiohttp
from aiohttp import web

from services.tools.bench.fleet.routing import Route, prompt_text

log = logging.getLogger(__name__)
_PASSED = ("Content-Type", "Cache-Control")


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return web.json_response(body, status=status)


class Router:
    def __init__(self, backends: Sequence[str], route: Route) -> None:
        self.backends = [b.rstrip("/") for b in backends]
        self.route = route
        self.in_flight = [0] * len(self.backends)
        self.sent = [0] * len(self.backends)
        self._http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._proxy)
        app.router.add_post("/v1/completions", self._proxy)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        # No total timeout: an answer streams as long as it takes; the client bounds it.
        # A connection per request: a pooled one the server has closed meanwhile would fail
        # a request it never saw (one in 150 did, a ClientOSError, before this).
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def _close(self, app: web.Application) -> None:
        if self._http:
            await self._http.close()

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._http
        async with self._http.get(f"{self.backends[0]}/v1/models") as up:
            body = await up.read()
            return web.Response(body=body, status=up.status, content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"servers": len(self.backends), "in_flight": self.in_flight, "sent": self.sent}
        )

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        assert self._http
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the server answers it (a 400 of its own)
        i = self.route.pick(prompt_text(body), self.in_flight)
        self.in_flight[i] += 1
        self.sent[i] += 1
        try:
            return await self._forward(request, raw, i)
        finally:
            self.in_flight[i] -= 1

    async def _forward(self, request: web.Request, raw: bytes, i: int) -> web.StreamResponse:
        assert self._http
        url = f"{self.backends[i]}{request.path}"
        resp: web.StreamResponse | None = None
        try:
            async with self._http.post(
                url, data=raw, headers={"Content-Type": "application/json"}
            ) as up:
                resp = web.StreamResponse(
                    status=up.status, headers={k: up.headers[k] for k in _PASSED if k in up.headers}
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except ConnectionResetError:  # the client left (it stops reading at [DONE])
            return resp if resp is not None else _error(499, "client closed the request")
        except aiohttp.ClientError as exc:
            log.warning("server %d (%s): %s", i, url, exc)
            if resp is not None:  # mid-answer: the stream ends without [DONE]
                return resp
            return _error(502, f"fleet server {i} failed: {type(exc).__name__}")
