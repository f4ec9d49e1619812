"""Pytest fixtures for a real Mooncake pool, shared by every hybridkv test suite.

Load with `pytest_plugins = ["hybridkv.transport.testing"]` in a conftest. Fixtures:
- `mooncake_master`: a real master on free loopback ports for the whole session;
- `segment_holder`: a holder lending 64 MiB to that master for the whole session;
- `start_mooncake_master`, `start_segment_holder`: factories for tests that kill or fill
  their own (everything started is stopped at the end of the test);
- `mooncake_store`: a client of the session master, closed after the test;
- `shared_mooncake_store`: one client for the whole session;
- `store`, `closable_store`: parametrized over "memory" and "mooncake", for contract tests.
Under `HYBRIDKV_REQUIRE_REAL=1` a missing Mooncake fails these tests instead of skipping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from hybridkv.transport.config import MooncakeConfig
from hybridkv.transport.errors import StoreError
from hybridkv.transport.master import LOOPBACK, MasterProcess, free_port
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.mooncake_client import load_client_class
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.segment_holder import SegmentHolder
from hybridkv.transport.store import Store

REQUIRE_REAL_ENV = "HYBRIDKV_REQUIRE_REAL"
HOLDER_SIZE = 64 << 20
CLIENT_SEGMENT_SIZE = 64 << 20
CLIENT_BUFFER_SIZE = 16 << 20

StartMaster = Callable[..., MasterProcess]
StartHolder = Callable[..., SegmentHolder]


def real_required() -> bool:
    return os.environ.get(REQUIRE_REAL_ENV, "") not in ("", "0")


def require_real(reason: str) -> NoReturn:
    """Skip a test that needs a real component, or fail it when CI demands real parts."""
    if real_required():
        pytest.fail(f"{REQUIRE_REAL_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def require_mooncake() -> None:
    """Return only if the real Mooncake client and master can be used here."""
    try:
        load_client_class()
    except StoreError as exc:
        require_real(str(exc))


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports nobody listens on right now (as
    data-parallel engines take a configured port plus their rank)."""
    for _ in range(100):
        start = free_port()
        if all(_bindable(port) for port in range(start + 1, start + count)):
            return start
    raise RuntimeError(f"no {count} consecutive free loopback ports")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:  # taken, or past 65535
            return False
    return True


@contextlib.contextmanager
def stalled(pid: int, timeout_s: float = 5.0) -> Iterator[None]:
    """`pid` stopped (SIGSTOP) inside, running again (SIGCONT) after: a stalled master or
    holder. Entered once every thread has stopped: a busy machine may take a moment to
    stop each, and meanwhile the process still answers requests."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"process {pid} not stopped after {timeout_s} s")
            time.sleep(0.01)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rpartition(")")[2].split()[0])
        except OSError:
            continue  # the thread exited
    return bool(states) and all(state in "Tt" for state in states)


def mooncake_config(master_address: str, **overrides: Any) -> MooncakeConfig:
    """Client settings for tests: loopback, TCP, small segment and buffer."""
    values: dict[str, Any] = {
        "master_server_address": master_address,
        "global_segment_size": CLIENT_SEGMENT_SIZE,
        "local_buffer_size": CLIENT_BUFFER_SIZE,
        "local_hostname": LOOPBACK,
    }
    values.update(overrides)
    return MooncakeConfig(**values)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    # Hypothesis' per-example deadline is a timed assertion: on shared, loaded cores it
    # fails examples that are slow, not wrong. Speed is the benchmarks' business.
    with contextlib.suppress(ImportError):
        from hypothesis import settings

        settings.register_profile("hybridkv", deadline=None)
        settings.load_profile("hybridkv")


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    require_mooncake()
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with MasterProcess.start(log_path=log) as master:
        yield master


@pytest.fixture(scope="session")
def segment_holder(
    mooncake_master: MasterProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SegmentHolder]:
    log = tmp_path_factory.mktemp("mooncake") / "holder.log"
    with SegmentHolder.start(mooncake_master.address, HOLDER_SIZE, log_path=log) as holder:
        yield holder


@pytest.fixture
def start_mooncake_master(tmp_path: Path) -> Iterator[StartMaster]:
    """Start masters (logs under the test's tmp_path); all are stopped after the test."""
    require_mooncake()
    started: list[MasterProcess] = []

    def start(**options: Any) -> MasterProcess:
        options.setdefault("log_path", tmp_path / f"master-{len(started)}.log")
        master = MasterProcess.start(**options)
        started.append(master)
        return master

    yield start
    for master in started:
        master.stop()


@pytest.fixture
def start_segment_holder(tmp_path: Path) -> Iterator[StartHolder]:
    """Start holders (logs under the test's tmp_path); all are stopped after the test."""
    require_mooncake()
    started: list[SegmentHolder] = []

    def start(
        master_address: str | None, size: int | str | None = HOLDER_SIZE, **options: Any
    ) -> SegmentHolder:
        options.setdefault("log_path", tmp_path / f"holder-{len(started)}.log")
        holder = SegmentHolder.start(master_address, size, **options)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.stop()


@pytest.fixture
def mooncake_store(mooncake_master: MasterProcess) -> Iterator[MooncakeStore]:
    """A client of its own, closed after the test (closing one takes Mooncake ~2 s)."""
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    yield store
    store.close()


@pytest.fixture(scope="session")
def shared_mooncake_store(mooncake_master: MasterProcess) -> Iterator[MooncakeStore]:
    """One client for the whole session, for tests that neither close it nor kill its pool."""
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    yield store
    store.close()


@pytest.fixture(scope="session")
def second_mooncake_store(mooncake_master: MasterProcess) -> Iterator[MooncakeStore]:
    """Another client of the session's pool, as a second instance would have."""
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    yield store
    store.close()


@pytest.fixture(params=["memory", "mooncake"])
def two_clients(request: pytest.FixtureRequest) -> Iterator[tuple[Store, Store]]:
    """Two clients of one pool, of each backend in turn (the Mooncake ones shared)."""
    if request.param == "memory":
        first = MemoryStore()
        second = first.another_client()
        yield first, second
        second.close()
        first.close()
    else:
        yield (
            request.getfixturevalue("shared_mooncake_store"),
            request.getfixturevalue("second_mooncake_store"),
        )


@pytest.fixture(params=["memory", "mooncake"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each backend in turn (the Mooncake one shared: do not close it; see `closable_store`)."""
    if request.param == "memory":
        memory = MemoryStore()
        yield memory
        memory.close()
    else:
        yield request.getfixturevalue("shared_mooncake_store")


@pytest.fixture(params=["memory", "mooncake"])
def closable_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each backend in turn, a store of the test's own that it may close."""
    if request.param == "memory":
        memory = MemoryStore()
        yield memory
        memory.close()
    else:
        yield request.getfixturevalue("mooncake_store")
