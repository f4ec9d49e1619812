"""The router's HTTP app: each completion is prefilled on one server, decoded on another.

The prefill server computes the prompt with `max_tokens=1` and stores its KV in the pool;
the decode server, sent the original request, finds the prompt's KV there and loads it.
No KV passes through the router: it only orders the two requests and relays the decode
server's reply as it comes (streamed or not).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

# Generation may take as long as the request asks: only connecting is bounded.
TIMEOUT = httpx.Timeout(None, connect=10.0)
# Headers a client sends that the servers must see too (authentication, tracing).
FORWARDED_HEADERS = ("authorization", "x-request-id")
# Keys that would ask the prefill server for more than one token, or to stream.
PREFILL_DROPPED = ("max_completion_tokens", "min_tokens", "stream_options")
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


class RoundRobin:
    """Servers of one kind, taken in turn."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = tuple(url.rstrip("/") for url in urls)
        self._turns = itertools.cycle(self.urls)

    def next(self) -> str:
        return next(self._turns)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: the prompt computed, one token generated."""
    kept = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    return {**kept, "max_tokens": 1, "stream": False}


def _error(status: int, message: str) -> JSONResponse:
    """An error in the shape vLLM's OpenAI server answers with."""
    kind = "BadRequestError" if status < 500 else "BadGatewayError"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _relayed(reply: httpx.Response) -> Response:
    return Response(
        reply.content,
        status_code=reply.status_code,
        media_type=reply.headers.get("content-type"),
    )


class Router:
    """Sends requests to the servers: completions to a prefill then a decode server."""

    def __init__(self, prefill: RoundRobin, decode: RoundRobin, client: httpx.AsyncClient):
        self.prefill = prefill
        self.decode = decode
        self.client = client

    async def complete(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {
            name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers
        }
        path = request.url.path
        prefill = self.prefill.next()
        try:
            prefilled = await self.client.post(
                prefill + path, json=prefill_body(body), headers=headers
            )
        except httpx.HTTPError as exc:
            return _error(502, f"prefill server {prefill} failed: {exc!r}")
        if prefilled.is_error:
            return _relayed(prefilled)
        decode = self.decode.next()
        outgoing = self.client.build_request("POST", decode + path, json=body, headers=headers)
        try:
            reply = await self.client.send(outgoing, stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"decode server {decode} failed: {exc!r}")
        if reply.is_error:
            await reply.aread()
            await reply.aclose()
            return _relayed(reply)
        return StreamingResponse(
            self._relay(reply),
            status_code=reply.status_code,
            media_type=reply.headers.get("content-type"),
            background=BackgroundTask(reply.aclose),
        )

    async def _relay(self, reply: httpx.Response) -> AsyncIterator[bytes]:
        """The decode server's bytes as they arrive (server-sent events unchanged); its
        connection is released however the relay ends (a client gone mid-stream too)."""
        try:
            async for chunk in reply.aiter_raw():
                yield chunk
        finally:
            await reply.aclose()

    async def models(self) -> Response:
        decode = self.decode.next()
        try:
            return _relayed(await self.client.get(decode + "/v1/models"))
        except httpx.HTTPError as exc:
            return _error(502, f"decode server {decode} failed: {exc!r}")

    async def health(self) -> Response:
        """Ready when every server is: a load balancer then sends nothing to a router
        whose servers are still starting or gone."""
        servers = (*self.prefill.urls, *self.decode.urls)
        answers = await asyncio.gather(*(self._healthy(url) for url in servers))
        down = [url for url, healthy in zip(servers, answers, strict=True) if not healthy]
        if down:
            return _error(503, f"not ready: {', '.join(down)}")
        return Response(status_code=200)

    async def _healthy(self, url: str) -> bool:
        try:
            return (await self.client.get(url + "/health")).is_success
        except httpx.HTTPError:
            return False


def build_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The router over these servers' base URLs (`transport`: how it reaches them;
    tests pass in-process ones)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(transport=transport, timeout=TIMEOUT) as client:
            app.state.router = Router(RoundRobin(prefill), RoundRobin(decode), client)
            yield

    app = FastAPI(title="hybridkv router", lifespan=lifespan)

    async def complete(request: Request) -> Response:
        router: Router = request.app.state.router
        return await router.complete(request)

    async def models(request: Request) -> Response:
        router: Router = request.app.state.router
        return await router.models()

    async def health(request: Request) -> Response:
        router: Router = request.app.state.router
        return await router.health()

    for path in COMPLETION_PATHS:
        app.add_api_route(path, complete, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    return app
