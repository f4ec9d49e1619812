"""The P/D router against fake vLLM servers: tiny in-process HTTP apps, one per server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from starlette.routing import Host, Router

from hybridkv.integration.cli import main
from hybridkv.integration.router.app import build_app

PREFILL = ["http://prefill-0:8100", "http://prefill-1:8100"]
DECODE = ["http://decode-0:8200", "http://decode-1:8200"]
DOWN = "http://down:8300"
EVENTS = [b'data: {"n": 0}\n\n', b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class FakeServer:
    """A vLLM API server's surface: records what it was sent, answers in its name."""

    def __init__(self, url: str, status: int = 200) -> None:
        self.name = httpx.URL(url).host
        self.status = status
        self.received: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.app = FastAPI()
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.add_api_route(path, self.complete, methods=["POST"])
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.app.add_api_route("/health", self.health, methods=["GET"])

    async def complete(self, request: Request) -> Response:
        body = await request.json()
        self.received.append((request.url.path, body, dict(request.headers)))
        if self.status != 200:
            error = {"error": {"message": f"{self.name} refused", "code": self.status}}
            return JSONResponse(error, status_code=self.status)
        if body.get("stream"):
            return StreamingResponse(iter(EVENTS), media_type="text/event-stream")
        return JSONResponse({"server": self.name, "choices": [{"text": "x"}]})

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name}]})

    async def health(self) -> Response:
        return Response(status_code=self.status)


class Servers(httpx.AsyncBaseTransport):
    """Reaches the fake servers by host name; one host refuses connections."""

    def __init__(self, servers: list[FakeServer]) -> None:
        hosts = Router([Host(server.name, app=server.app) for server in servers])
        self._transport = httpx.ASGITransport(app=hosts)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == httpx.URL(DOWN).host:
            raise httpx.ConnectError("connection refused", request=request)
        return await self._transport.handle_async_request(request)


def routed(
    servers: list[FakeServer], prefill: list[str] = PREFILL, decode: list[str] = DECODE
) -> TestClient:
    return TestClient(build_app(prefill, decode, transport=Servers(servers)))


@pytest.fixture
def fleet() -> dict[str, FakeServer]:
    return {url: FakeServer(url) for url in PREFILL + DECODE}


@pytest.fixture
def client(fleet: dict[str, FakeServer]) -> Iterator[TestClient]:
    with routed(list(fleet.values())) as client:
        yield client


def test_a_completion_is_prefilled_for_one_token_then_decoded_as_sent(
    client: TestClient, fleet: dict[str, FakeServer]
) -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "min_tokens": 2, "logprobs": 5}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200
    assert reply.json()["server"] == "decode-0"
    [(path, prefilled, _)] = fleet[PREFILL[0]].received
    assert path == "/v1/completions"
    assert prefilled == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "stream": False,
        "logprobs": 5,
    }
    assert [(p, b) for p, b, _ in fleet[DECODE[0]].received] == [("/v1/completions", body)]


def test_a_chat_prefill_asks_one_token_whatever_limit_the_client_set(
    client: TestClient, fleet: dict[str, FakeServer]
) -> None:
    body = {**CHAT, "max_completion_tokens": 8}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    [(path, prefilled, _)] = fleet[PREFILL[0]].received
    assert path == "/v1/chat/completions"
    assert prefilled["max_tokens"] == 1
    assert "max_completion_tokens" not in prefilled
    assert fleet[DECODE[0]].received[0][1] == body


def test_servers_of_each_kind_are_taken_in_turn(
    client: TestClient, fleet: dict[str, FakeServer]
) -> None:
    answered = [client.post("/v1/chat/completions", json=CHAT).json()["server"] for _ in range(4)]
    assert answered == ["decode-0", "decode-1", "decode-0", "decode-1"]
    assert [len(fleet[url].received) for url in PREFILL + DECODE] == [2, 2, 2, 2]


def test_a_streamed_reply_passes_through_unchanged(
    client: TestClient, fleet: dict[str, FakeServer]
) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        streamed = b"".join(reply.iter_raw())
    assert streamed == b"".join(EVENTS)
    prefilled = fleet[PREFILL[0]].received[0][1]
    assert prefilled["stream"] is False
    assert "stream_options" not in prefilled
    assert fleet[DECODE[0]].received[0][1] == body


def test_client_credentials_and_request_ids_reach_both_servers(
    client: TestClient, fleet: dict[str, FakeServer]
) -> None:
    headers = {"Authorization": "Bearer k", "X-Request-Id": "r1"}
    client.post("/v1/chat/completions", json=CHAT, headers=headers)
    for url in (PREFILL[0], DECODE[0]):
        sent = fleet[url].received[0][2]
        assert (sent["authorization"], sent["x-request-id"]) == ("Bearer k", "r1")


@pytest.mark.parametrize("status", [400, 503])
def test_a_prefill_error_comes_back_with_its_status_and_nothing_is_decoded(status: int) -> None:
    prefill, decode = FakeServer(PREFILL[0], status), FakeServer(DECODE[0])
    with routed([prefill, decode], PREFILL[:1], DECODE[:1]) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == status
    assert reply.json()["error"]["message"] == "prefill-0 refused"
    assert decode.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_error_comes_back_with_its_status(stream: bool) -> None:
    prefill, decode = FakeServer(PREFILL[0]), FakeServer(DECODE[0], 400)
    with routed([prefill, decode], PREFILL[:1], DECODE[:1]) as client:
        reply = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "decode-0 refused"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_an_unreachable_server_is_a_bad_gateway_naming_it(kind: str) -> None:
    prefill, decode = FakeServer(PREFILL[0]), FakeServer(DECODE[0])
    urls = {"prefill": PREFILL[:1], "decode": DECODE[:1], kind: [DOWN]}
    with routed([prefill, decode], urls["prefill"], urls["decode"]) as client:
        reply = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert reply.status_code == 502
    assert reply.json()["error"]["message"].startswith(f"{kind} server {DOWN} failed")


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]"])
def test_a_body_that_is_no_json_object_is_refused_before_any_server(
    client: TestClient, fleet: dict[str, FakeServer], content: bytes
) -> None:
    reply = client.post("/v1/completions", content=content)
    assert reply.status_code == 400
    assert "JSON" in reply.json()["error"]["message"]
    assert all(server.received == [] for server in fleet.values())


def test_models_are_a_decode_servers(client: TestClient) -> None:
    assert client.get("/v1/models").json()["data"] == [{"id": "decode-0"}]


def test_health_is_ok_only_when_every_server_is(fleet: dict[str, FakeServer]) -> None:
    with routed(list(fleet.values())) as client:
        assert client.get("/health").status_code == 200
    fleet[DECODE[1]].status = 503
    with routed(list(fleet.values()), decode=[*DECODE, DOWN]) as client:
        reply = client.get("/health")
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == f"not ready: {DECODE[1]}, {DOWN}"


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--decode", DECODE[0]], "--prefill"),
        (["--prefill", PREFILL[0]], "--decode"),
        (["--prefill", "prefill-0:8100", "--decode", DECODE[0]], "not a server URL"),
        (["--prefill", PREFILL[0] + "/v1", "--decode", DECODE[0]], "without a path"),
        (["--prefill", PREFILL[0], "--decode", DECODE[0], "--port", "70000"], "not a port"),
    ],
)
def test_bad_arguments_are_refused_naming_what_is_wrong(
    capsys: pytest.CaptureFixture[str], argv: list[str], complaint: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", *argv])
    assert exited.value.code == 2
    assert complaint in capsys.readouterr().err


def test_the_hybridkv_command_does_not_import_the_http_stack() -> None:
    code = (
        "import sys, hybridkv.integration.cli\n"
        "print(sorted({'fastapi', 'uvicorn', 'httpx'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    ).stdout
    assert out.strip() == "[]"
