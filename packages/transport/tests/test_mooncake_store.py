"""MooncakeStore's guards around the real client: setup, missing API, use after close."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from hybridkv.transport import mooncake_store
from hybridkv.transport.errors import (
    Status,
    StoreClosed,
    StoreError,
    StoreUnavailable,
    UnsupportedClient,
)
from hybridkv.transport.master import MasterProcess, free_port
from hybridkv.transport.mooncake_client import prepare_environment
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.testing import (
    StartHolder,
    StartMaster,
    mooncake_config,
    require_mooncake,
)


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port that accepts connections but never speaks Mooncake's protocol."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


def test_importing_the_package_does_not_import_mooncake() -> None:
    code = (
        "import sys, hybridkv.transport, hybridkv.transport.mooncake_store, "
        "hybridkv.transport.master, hybridkv.transport.holder, hybridkv.transport.segment_holder, "
        "hybridkv.transport.memory_store; "
        "print(sorted(m for m in sys.modules if m.startswith('mooncake')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("hostname", "advertised"),
    [("127.0.0.1", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("node-7", None), ("1234", None),
     ("1.2.3.4.5", None), ("::1", None)],
)  # fmt: skip
def test_the_transfer_engine_is_told_the_host_only_when_it_is_an_ipv4_address(
    monkeypatch: pytest.MonkeyPatch, hostname: str, advertised: str | None
) -> None:
    """Mooncake reads MC_TCP_BIND_ADDRESS as an IPv4 address: a host name (or digits that
    are none) is left for it to resolve."""
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    prepare_environment(mooncake_config("127.0.0.1:1", local_hostname=hostname))
    assert os.environ.get("MC_TCP_BIND_ADDRESS") == advertised


def test_a_bind_address_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.2")
    prepare_environment(mooncake_config("127.0.0.1:1", local_hostname="127.0.0.1"))
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.2"


def test_the_store_timeout_sets_each_of_mooncake_s_deadlines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mooncake waits 30 s for a master's reply or a holder's transfer; each client reads
    its deadlines at setup, so the config's, not whatever an earlier client left, apply."""
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "30000")
    for variable in ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC"):
        monkeypatch.setenv(variable, "30")
    prepare_environment(mooncake_config("127.0.0.1:1", store_timeout_s=3))
    assert os.environ["MC_RPC_TIMEOUT_MS"] == "3000"
    assert os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == "3"
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "3"


def test_connect_with_the_master_down_fails_fast() -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="does not accept connections"):
        MooncakeStore.connect(mooncake_config(f"127.0.0.1:{free_port()}"))
    print(f"setup with master down refused after {time.monotonic() - started:.3f} s")


def test_connect_to_something_that_is_not_a_master_fails_in_bounded_time(
    silent_listener: int,
) -> None:
    require_mooncake()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"setup .* failed"):
        MooncakeStore.connect(mooncake_config(f"127.0.0.1:{silent_listener}"))
    elapsed = time.monotonic() - started
    print(f"setup against a silent port failed after {elapsed:.1f} s")
    assert elapsed < 60  # with the client's default 20 setup retries this takes minutes


def test_a_client_without_the_range_api_is_refused(
    monkeypatch: pytest.MonkeyPatch, silent_listener: int
) -> None:
    require_mooncake()
    import mooncake.store

    class OldClient:
        def setup(self) -> int:
            raise AssertionError("must not be set up")

        def batch_is_exist(self) -> None: ...

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", OldClient)
    with pytest.raises(UnsupportedClient, match=r"lacks close, register_buffer, .*range/session"):
        MooncakeStore.connect(mooncake_config(f"127.0.0.1:{silent_listener}"))


def test_missing_mooncake_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, silent_listener: int
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(UnsupportedClient, match=r"install hybridkv-transport\[mooncake\]"):
        MooncakeStore.connect(mooncake_config(f"127.0.0.1:{silent_listener}"))


def test_registering_the_same_memory_twice_is_counted_not_refused(
    mooncake_master: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines over one cache each register it; Mooncake alone would answer -600.
    (Over RDMA: TCP registers nothing, so TCP stands in for it here.)"""
    monkeypatch.setattr(mooncake_store, "UNREGISTERED_PROTOCOLS", frozenset())
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    memory = np.zeros(1 << 20, dtype=np.uint8)
    ptr = memory.ctypes.data
    try:
        store.register_buffer(ptr, memory.nbytes)
        store.register_buffer(ptr, memory.nbytes)  # counted
        store.register_buffer(ptr, 4096)  # inside the first: counted
        store.unregister_buffer(ptr)
        store.unregister_buffer(ptr)
        with pytest.raises(StoreError, match="register_buffer"):  # still registered
            store.register_buffer(ptr, memory.nbytes + 4096)
        store.unregister_buffer(ptr)  # the last registration leaves Mooncake
        with pytest.raises(StoreError, match="unregister_buffer"):
            store.unregister_buffer(ptr)
        store.register_buffer(ptr, memory.nbytes)  # free again
        store.unregister_buffer(ptr)
    finally:
        store.close()


def test_close_while_other_threads_call_never_crashes(mooncake_master: MasterProcess) -> None:
    """Calls racing close() either finish or raise StoreClosed; Mooncake never sees them."""
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    data = np.ones(4096, dtype=np.uint8)
    outcomes: list[str] = []
    start = threading.Barrier(5)

    def hammer(worker: int) -> None:
        start.wait()
        for i in range(10_000):
            key = f"race-{worker}-{i}"
            try:
                store.batch_put_whole([key], [[data.ctypes.data]], [[4096]])
                store.batch_is_readable([key])
            except StoreClosed:
                outcomes.append("closed")
                return
        outcomes.append("finished")

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    time.sleep(0.2)
    store.close()
    for thread in threads:
        thread.join(60)
    assert outcomes == ["closed"] * 4
    assert store.closed


def test_require_real_fails_instead_of_skipping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    monkeypatch.setenv("HYBRIDKV_REQUIRE_REAL", "1")
    with pytest.raises(pytest.fail.Exception, match="HYBRIDKV_REQUIRE_REAL=1 but cannot import"):
        require_mooncake()
    monkeypatch.setenv("HYBRIDKV_REQUIRE_REAL", "0")
    with pytest.raises(pytest.skip.Exception, match=r"cannot import mooncake\.store"):
        require_mooncake()


def test_preferred_segment_decides_which_process_holds_new_objects(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder
) -> None:
    """Two writers that each lend a segment beside a holder: the one preferring its own
    segment takes its objects with it when it closes; the one naming the holder's leaves
    them readable. Whole puts and put sessions alike."""
    master = start_mooncake_master()
    start_segment_holder(master.address)
    [holder] = segment_names(master)
    own = MooncakeStore.connect(mooncake_config(master.address, preferred_segment=True))
    held = MooncakeStore.connect(mooncake_config(master.address, preferred_segment=holder))
    data = np.arange(4096, dtype=np.uint8) % 251
    for writer, tag in ((own, "own"), (held, "held")):
        writer.register_buffer(data.ctypes.data, data.nbytes)
        assert writer.batch_put_whole([f"{tag}-whole"], [[data.ctypes.data]], [[4096]]) == [
            Status.OK
        ]
        assert writer.put_session_start([f"{tag}-session"], [4096]) == [Status.OK]
        assert writer.put_ranges([f"{tag}-session"], [[data.ctypes.data]], [[4096]], [[0]]) == [
            Status.OK
        ]
        assert writer.put_session_end([f"{tag}-session"]) == [Status.OK]
        writer.close()
    reader = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=0))
    out = np.zeros(4096, dtype=np.uint8)
    try:
        for key in ("held-whole", "held-session"):
            assert reader.batch_get_whole([key], [[out.ctypes.data]], [[4096]]) == [Status.OK]
            assert np.array_equal(out, data)
        for key in ("own-whole", "own-session"):
            [status] = reader.batch_get_whole([key], [[out.ctypes.data]], [[4096]])
            assert not status.ok, key
    finally:
        reader.close()


def segment_names(master: MasterProcess) -> list[str]:
    """The segments mounted in the pool, from the master's HTTP admin endpoint."""
    url = f"http://{master.host}:{master.metrics_port}/get_all_segments"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode().split()
