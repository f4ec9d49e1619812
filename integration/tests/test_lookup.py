from __future__ import annotations

import logging
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from conftest import attention, groups, model_config

from hybridkv.integration import lookup
from hybridkv.integration.lookup import (
    LOOPBACK,
    SECRET_ENV,
    LookupClient,
    LookupServer,
    claim_socket,
    is_private,
    lookup_secret,
    remove_socket,
    socket_path,
    wire,
)
from hybridkv.integration.lookup import client as lookup_client
from hybridkv.integration.lookup.channel import make_private
from hybridkv.integration.lookup.wire import encode
from hybridkv.transport.testing import free_ports


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


def answer_once_free(client: LookupClient, keys: list[str]) -> list[bool] | None:
    """The first answer once the server got through a timed-out request (misses before)."""
    for _ in range(100):
        answer = client.query(keys)
        if answer is not None:
            return answer
        time.sleep(0.05)
    return None


def test_while_a_timed_out_lookup_is_unanswered_lookups_are_misses_not_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pool slower than the timeout: sending on would queue lookups the server answers
    long after their callers gave up, and every one would wait out the timeout."""
    asked: list[list[str]] = []
    released = threading.Event()

    def slow_once(keys: Sequence[str]) -> list[bool]:
        asked.append(list(keys))
        if "slow" in keys:
            released.wait(5.0)
        return _readable(keys)

    server = LookupServer(slow_once)
    client = LookupClient(server.address, timeout_ms=100)
    with caplog.at_level(logging.WARNING):
        assert client.query(["slow"]) is None
        assert client.query(["yes"]) is None
    assert "still busy with a timed-out request" in caplog.text
    released.set()
    assert answer_once_free(client, ["yes", "no"]) == [True, False]
    assert asked == [["slow"], ["yes", "no"]]  # the lookup made while busy never went out
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
        assert client.query(["yes"]) is None  # not sent: the first is still unanswered
    assert time.monotonic() - started < 2.0
    assert "timed out" in caplog.text
    assert "still busy with a timed-out request" in caplog.text
    client.close()
    silent.close(0)
    context.term()


def test_unpublished_server_is_a_miss() -> None:
    client = LookupClient(lambda: None, timeout_ms=100)
    assert client.query(["yes"]) is None
    client.close()


def test_a_socket_that_cannot_connect_is_a_miss_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = LookupClient(lambda: "nowhere://at-all", timeout_ms=100)
    with caplog.at_level(logging.WARNING):
        assert client.query(["yes"]) is None
        assert client.remove() is None
    assert "could not connect" in caplog.text
    client.close()


def test_an_answer_stands_when_tidying_up_after_it_fails(server: LookupServer) -> None:
    def refused() -> None:
        raise PermissionError("the socket's file is not ours to remove")

    client = LookupClient(lambda: server.address, timeout_ms=2000, answered=refused)
    assert client.query(["yes", "no"]) == [True, False]
    assert client.query(["yes"]) == [True]
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


def test_the_lookup_socket_sits_where_only_this_user_can_reach_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any local user can reach a loopback port and, through it, remove this model's pool
    objects; a Unix socket in a 0700 directory of this user's keeps them out."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = socket_path("engine-dp0")
    assert path.parent.parent == tmp_path
    assert socket_path("engine-dp1") != path  # each engine its own
    assert not is_private(path.parent)  # not there yet
    make_private(path.parent)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    make_private(path.parent)  # a killed instance's directory is taken over
    path.parent.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        make_private(path.parent)
    path.parent.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    path.parent.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match=str(path.parent)):
        make_private(path.parent)


def test_a_socket_another_instance_listens_on_is_refused_and_a_dead_one_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two instances on one host given one engine id would share the socket path: the
    second must not bind over the first's live socket (its scheduler's lookups and resets
    would reach the wrong worker); a socket left by a killed worker is taken over."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = socket_path("shared-dp0")
    claim_socket(path, "shared-dp0")
    running = LookupServer(_readable, f"ipc://{path}")
    with pytest.raises(RuntimeError, match=r"'shared-dp0'.*its own kv_transfer_config engine_id"):
        claim_socket(path, "shared-dp0")
    running.close()
    assert path.exists()  # left behind, as by a killed worker
    claim_socket(path, "shared-dp0")
    second = LookupServer(_readable, f"ipc://{path}")
    client = LookupClient(lambda: f"ipc://{path}", timeout_ms=2000)
    assert client.query(["yes", "no"]) == [True, False]
    client.close()
    second.close()


def test_a_socket_path_too_long_for_unix_sockets_is_refused_naming_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ("d" * 100)))
    with pytest.raises(ValueError, match="set TMPDIR shorter, or set lookup_rpc_port"):
        socket_path("engine-dp0")


def test_the_scheduler_takes_the_socket_s_path_once_answered_and_keeps_its_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lookups before worker rank 0 listens are misses. The first answer removes the
    socket and its directory (nobody else can connect, and nothing is left if the workers
    are killed); the connection serves on, across a timed-out lookup."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    released = threading.Event()

    def slow_then_fast(keys: Sequence[str]) -> list[bool]:
        if "slow" in keys:
            released.wait(5.0)
        return _readable(keys)

    path = socket_path("engine-dp0")
    client = LookupClient(
        lambda: f"ipc://{path}" if path.exists() else None,
        timeout_ms=200,
        answered=lambda: remove_socket(path),
    )
    assert client.query(["yes"]) is None  # not listening yet
    make_private(path.parent)
    server = LookupServer(slow_then_fast, f"ipc://{path}")
    assert server.address == f"ipc://{path}"
    assert client.query(["slow"]) is None  # timed out, unanswered
    assert path.exists()
    released.set()
    assert answer_once_free(client, ["yes-again", "no"]) == [True, False]  # not the late one
    assert list(tmp_path.iterdir()) == []
    assert client.query(["yes", "no", "yes-too"]) == [True, False, True]
    client.close()
    server.close()


@pytest.mark.parametrize("moe", [False, True])
def test_data_parallel_engines_on_one_host_take_their_own_lookup_port(
    vllm_specs: Any, moe: bool
) -> None:
    """vLLM resets data_parallel_rank to 0 in each DP engine of a dense model (they run
    independently; data_parallel_index keeps the rank): with a fixed lookup_rpc_port both
    engines took the same port and the second one's worker failed to bind it."""
    from vllm.config import KVTransferConfig, ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv.integration.connector import HybridKVConnector

    port = free_ports(2)
    kv_cache_config = vllm_specs.KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=groups(vllm_specs, (["a"], attention(vllm_specs))),
    )
    connectors = []
    for rank in (0, 1):
        parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank)
        parallel.data_parallel_index = rank  # what vLLM's run_engine_core does, then:
        if not moe:
            parallel.reconfigure_for_independent_dp_rank()
        vllm_config: Any = SimpleNamespace(
            parallel_config=parallel,
            kv_transfer_config=KVTransferConfig(
                kv_connector="HybridKVConnector",
                kv_role="kv_both",
                engine_id=f"engine_dp{rank}",
                kv_connector_extra_config={"lookup_rpc_port": port, "store": "memory"},
            ),
            cache_config=SimpleNamespace(
                get_resolved_kv_cache_layout=lambda: SimpleNamespace(name="NHD"),
                cache_dtype="auto",
            ),
            model_config=model_config(model="tiny"),
            load_config=SimpleNamespace(load_format="auto", download_dir=None),
            speculative_config=None,
            kv_events_config=None,
        )
        connectors.append(HybridKVConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config))
    endpoints = [connector._channel.endpoint for connector in connectors]
    assert endpoints == [f"tcp://{LOOPBACK}:{port}", f"tcp://{LOOPBACK}:{port + 1}"]
    assert [connector._channel.instance for connector in connectors] == [
        "engine_dp0-dp0",
        "engine_dp1-dp1",
    ]
    servers = [LookupServer(_readable, endpoint) for endpoint in endpoints]  # both bind
    for server in servers:
        server.close()


def _rebind(address: str, readable: Any = _readable, **options: Any) -> LookupServer:
    """A server on `address` once the killed one's listener is gone (bounded retries)."""
    for _ in range(50):
        try:
            return LookupServer(readable, address, **options)
        except zmq.ZMQError:
            time.sleep(0.05)
    raise AssertionError(f"{address} never freed")


def _killed_after_a_lost_request(address: str, client: LookupClient) -> None:
    """A server that takes the client's request and dies without answering."""
    context = zmq.Context()
    dying = context.socket(zmq.REP)
    dying.setsockopt(zmq.LINGER, 0)
    dying.bind(address)
    assert client.query(["yes"]) is None  # timed out, unanswered
    assert dying.poll(2000, zmq.POLLIN)  # it was delivered, then lost with the server
    dying.close(0)
    context.term()  # the listener is closed once this returns


def test_a_server_restarted_on_its_port_answers_lookups_within_a_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reply lost with its server never comes: lookups are misses for one timeout period
    after the time-out, then go to whatever listens there now (they stayed misses
    forever, 'still busy with a timed-out request')."""
    address = f"tcp://{LOOPBACK}:{free_ports(1)}"
    client = LookupClient(address, timeout_ms=1000)
    _killed_after_a_lost_request(address, client)
    timed_out = time.monotonic()  # a little after the client's time-out
    restarted = _rebind(address)
    try:
        with caplog.at_level(logging.WARNING):
            assert client.query(["yes"]) is None  # within the period: not sent
            time.sleep(max(0.0, timed_out + 1.0 - time.monotonic()))
            assert client.query(["yes", "no"]) == [True, False]  # the first one after it
        assert "still busy with a timed-out request" in caplog.text
        assert "counted as lost" in caplog.text
        assert client.query(["no", "yes"]) == [False, True]
    finally:
        client.close()
        restarted.close()


def test_a_removal_after_a_lost_reply_is_bounded_by_one_timeout() -> None:
    """remove() waited its whole 60 s for the lost reply, then gave up without asking."""
    address = f"tcp://{LOOPBACK}:{free_ports(1)}"
    client = LookupClient(address, timeout_ms=1000)
    _killed_after_a_lost_request(address, client)
    timed_out = time.monotonic()
    restarted = _rebind(address, remove=Removal())
    try:
        assert client.remove() == 20
        assert time.monotonic() - timed_out < 1.0 + 1.0  # the period, then its answer
        assert client.query(["yes"]) == [True]
    finally:
        client.close()
        restarted.close()


def _raw_request(address: str, *frames: bytes, timeout_ms: int = 2000) -> bytes | None:
    """One request of a foreign peer (a REQ socket, no hybridkv client): its reply, if any."""
    context = zmq.Context()
    raw = context.socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        raw.send_multipart(list(frames))
        return raw.recv() if raw.poll(timeout_ms, zmq.POLLIN) else None
    finally:
        raw.close(0)
        context.term()


def test_requests_over_the_caps_are_refused_cheaply_and_the_server_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 9.5 MiB request of empty keys cost the server 160 MiB (two lists of 10M items):
    past the key cap it is refused from the message's header; past the size cap ZMQ drops
    the peer before the server sees a byte of it."""
    import tracemalloc

    import msgspec

    asked: list[int] = []

    def counted(keys: Sequence[str]) -> list[bool]:
        asked.append(len(keys))
        return _readable(keys)

    server = LookupServer(counted)
    many = msgspec.msgpack.encode({"type": "lookup", "keys": [""] * 10_000_000})
    assert 9 << 20 < len(many) < lookup.MAX_REQUEST_BYTES
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING):
            reply = _raw_request(server.address, many)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply is not None
    assert f"length <= {lookup.MAX_REQUEST_KEYS}".encode() in reply
    assert "hybridkv lookup request refused" in caplog.text
    assert peak < 3 * len(many)  # the message and its copies, no list of its keys
    oversized = msgspec.msgpack.encode({"type": "lookup", "keys": ["y" * (17 << 20)]})
    assert _raw_request(server.address, oversized, timeout_ms=500) is None
    assert b"more than one message part" in (_raw_request(server.address, b"\x80", b"") or b"")
    assert asked == []
    client = LookupClient(server.address, timeout_ms=2000)
    try:
        assert client.query(["yes", "no"]) == [True, False]
    finally:
        client.close()
        server.close()


def test_a_lookup_past_the_caps_goes_out_in_parts_within_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The longest legitimate lookup (a 1M-token prompt's: millions of keys) must still be
    answered: the client splits it, by key count and by size."""
    asked: list[int] = []

    def counted(keys: Sequence[str]) -> list[bool]:
        asked.append(len(keys))
        return _readable(keys)

    keys = [f"{'yes' if i % 3 else 'no'}-{i}" for i in range(2 * lookup.MAX_REQUEST_KEYS + 5)]
    server = LookupServer(counted)
    client = LookupClient(server.address, timeout_ms=5000)
    try:
        assert client.query(keys) == [key.startswith("yes") for key in keys]
        assert asked == [lookup.MAX_REQUEST_KEYS, lookup.MAX_REQUEST_KEYS, 5]
    finally:
        client.close()
        server.close()
    monkeypatch.setattr(wire, "MAX_REQUEST_BYTES", 1000)  # the server's socket too
    asked.clear()
    keys = [f"yes-{i:020d}" for i in range(100)]  # ~2.6 kB in one request
    server = LookupServer(counted)
    client = LookupClient(server.address, timeout_ms=5000)
    try:
        assert client.query(keys) == [True] * 100
        assert len(asked) == 4
        assert sum(asked) == 100
        assert client.query(["y" * 2000]) is None  # one key over the cap: a miss, not sent
        assert len(asked) == 4
    finally:
        client.close()
        server.close()


SECRET = b"correct horse battery staple"


def test_with_a_secret_only_its_holders_ask_and_answer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a fixed port any local user could look keys up and reset the pool: with a
    secret, a peer without it (or with another) completes no handshake: it gets no answer,
    removes nothing, and cannot answer in the server's place."""
    monkeypatch.setattr(lookup_client, "REMOVAL_TIMEOUT_MS", 300)
    removal = Removal()
    address = f"tcp://{LOOPBACK}:{free_ports(1)}"
    server = LookupServer(_readable, address, remove=removal, secret=SECRET)
    holder = LookupClient(address, timeout_ms=2000, secret=SECRET)
    strangers = [
        LookupClient(address, timeout_ms=300, secret=b""),
        LookupClient(address, timeout_ms=300, secret=b"another secret, long enough"),
    ]
    try:
        assert holder.query(["yes", "no"]) == [True, False]
        for stranger in strangers:
            assert stranger.query(["yes"]) is None
            assert stranger.remove() is None
        assert _raw_request(address, encode(lookup.RemoveRequest()), timeout_ms=300) is None
        assert removal.calls == 0
        assert holder.remove() == 20
        assert removal.calls == 1
    finally:
        for client in (holder, *strangers):
            client.close()
        server.close()
    squatter = _rebind(address, secret=b"")  # took the port: holders do not trust it
    holder = LookupClient(address, timeout_ms=300, secret=SECRET)
    try:
        assert holder.query(["yes"]) is None
    finally:
        holder.close()
        squatter.close()


def test_the_secret_comes_from_the_environment_and_a_short_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert lookup_secret({}) is None
    with pytest.raises(ValueError, match=f"{SECRET_ENV} must be at least 16 characters"):
        lookup_secret({SECRET_ENV: "short"})
    with caplog.at_level(logging.WARNING):  # a fixed port without one: said at start-up
        open_port = LookupServer(_readable, f"tcp://{LOOPBACK}:{free_ports(1)}")
    open_port.close()
    assert SECRET_ENV in caplog.text
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    server = LookupServer(_readable)
    holder = LookupClient(server.address, timeout_ms=2000)
    stranger = LookupClient(server.address, timeout_ms=300, secret=b"")
    try:
        assert holder.query(["yes"]) == [True]
        assert stranger.query(["yes"]) is None
    finally:
        holder.close()
        stranger.close()
        server.close()
