from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import zmq

from hybridkv.integration.lookup import (
    LookupClient,
    LookupServer,
    publish_port,
    take_published_address,
)


def _readable(keys: Sequence[str]) -> list[bool]:
    if "boom" in keys:
        raise RuntimeError("store exploded")
    return [key.startswith("yes") for key in keys]


class Removal:
    """The server's removal of its own model's objects: 20, then a failing master."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("master exploded")
        return 20


@pytest.fixture
def server() -> LookupServer:
    server = LookupServer(_readable, remove=Removal())
    yield server
    server.close()


def test_answers_batched_query(server: LookupServer) -> None:
    client = LookupClient(server.address, timeout_ms=2000)
    assert client.query(["yes-1", "no-2", "yes-3"]) == [True, False, True]
    assert client.query([]) == []
    client.close()


def test_malformed_request_gets_error_and_server_survives(server: LookupServer) -> None:
    context = zmq.Context()
    raw = context.socket(zmq.REQ)
    raw.setsockopt(zmq.RCVTIMEO, 2000)
    raw.connect(server.address)
    for garbage in (b"\x00\xff not msgpack", b"\x81\xa4type\xa5other", b""):
        raw.send(garbage)
        reply = raw.recv()
        assert b"error" in reply
        assert b"malformed" in reply
    raw.close(0)
    context.term()
    client = LookupClient(server.address, timeout_ms=2000)
    assert client.query(["yes"]) == [True]
    client.close()


def test_store_failure_is_an_error_reply_not_a_crash(
    server: LookupServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = LookupClient(server.address, timeout_ms=2000)
    with caplog.at_level(logging.WARNING):
        assert client.query(["boom"]) is None
    assert "store exploded" in caplog.text
    assert client.query(["yes"]) == [True]
    client.close()


class _Unanswerable:
    """A store answer that raises when read (a bug below the server, not a pool failure)."""

    def __bool__(self) -> bool:
        raise ValueError("not a truth value")


def test_an_answer_that_raises_is_an_error_reply_and_the_server_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def readable(keys: Sequence[str]) -> list[object]:
        return [_Unanswerable() if key == "odd" else key.startswith("yes") for key in keys]

    server = LookupServer(readable)  # type: ignore[arg-type]
    client = LookupClient(server.address, timeout_ms=2000)
    try:
        with caplog.at_level(logging.WARNING):
            assert client.query(["odd"]) is None
        assert "not a truth value" in caplog.text
        assert client.query(["yes"]) == [True]  # the thread still answers
    finally:
        client.close()
        server.close()


def test_timeout_degrades_to_unknown(caplog: pytest.LogCaptureFixture) -> None:
    context = zmq.Context()
    silent = context.socket(zmq.REP)  # accepts, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    client = LookupClient(f"tcp://127.0.0.1:{port}", timeout_ms=100)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert client.query(["yes"]) is None
        assert client.query(["yes"]) is None  # a fresh socket after the timeout
    assert time.monotonic() - started < 2.0
    assert "timed out" in caplog.text
    client.close()
    silent.close(0)
    context.term()


def test_unpublished_server_is_a_miss() -> None:
    client = LookupClient(lambda: None, timeout_ms=100)
    assert client.query(["yes"]) is None
    client.close()


def test_removal_round_trip_and_its_failures(
    server: LookupServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = LookupClient(server.address, timeout_ms=2000)
    assert client.remove() == 20
    with caplog.at_level(logging.WARNING):
        assert client.remove() is None
    assert "master exploded" in caplog.text
    assert client.query(["yes"]) == [True]  # the server survived
    client.close()
    lookups_only = LookupServer(_readable)
    client = LookupClient(lookups_only.address, timeout_ms=2000)
    with caplog.at_level(logging.WARNING):
        assert client.remove() is None
    assert "does not remove" in caplog.text
    client.close()
    lookups_only.close()


def test_a_removal_slower_than_a_lookup_s_timeout_is_waited_for() -> None:
    """A removal walks the whole pool: a cache reset that did remove is not reported
    failed because a lookup would have timed out by then."""

    def slow_removal() -> int:
        time.sleep(0.5)
        return 7

    server = LookupServer(_readable, remove=slow_removal)
    client = LookupClient(server.address, timeout_ms=100)
    try:
        assert client.remove() == 7
        assert client.query(["yes"]) == [True]  # lookups keep their own timeout
    finally:
        client.close()
        server.close()


def test_closing_does_not_wait_on_an_answer_that_hangs(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's shutdown must not hang on a pool call that never returns."""
    release = threading.Event()

    def hung_removal() -> int:
        release.wait()
        return 0

    server = LookupServer(_readable, remove=hung_removal)
    client = LookupClient(server.address, timeout_ms=100)
    asking = threading.Thread(target=client.remove)
    asking.start()
    time.sleep(0.3)  # the server is inside the removal
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        server.close(timeout_s=0.2)
    assert time.monotonic() - started < 2.0
    assert "still answering" in caplog.text
    release.set()
    asking.join()
    client.close()


def test_the_published_port_is_read_once_and_the_file_removed(tmp_path: Path) -> None:
    path = tmp_path / "hybridkv-lookup-engine-dp0.port"
    assert take_published_address(path) is None  # not published yet
    publish_port(path, 43210)
    assert take_published_address(path) == "tcp://127.0.0.1:43210"
    assert list(tmp_path.iterdir()) == []  # no staging file either
    assert take_published_address(path) is None


def test_client_keeps_the_address_it_took_across_a_timeout(tmp_path: Path) -> None:
    """The rendezvous file is gone once read: a fresh socket after a timed-out lookup
    must reconnect to the address read then, and a client asks for it until it appears."""
    released = threading.Event()

    def slow_then_fast(keys: Sequence[str]) -> list[bool]:
        if "slow" in keys:
            released.wait(5.0)
        return _readable(keys)

    server = LookupServer(slow_then_fast)
    path = tmp_path / "hybridkv-lookup-engine-dp0.port"
    client = LookupClient(lambda: take_published_address(path), timeout_ms=200)
    assert client.query(["yes"]) is None  # not published yet
    publish_port(path, server.port)
    assert client.query(["slow"]) is None  # timed out: the socket is reset
    assert not path.exists()
    released.set()
    time.sleep(0.3)  # the server answers the abandoned request first
    assert client.query(["yes-again", "no"]) == [True, False]
    client.close()
    server.close()
