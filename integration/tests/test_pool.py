"""Opening the pool: the embedded master's address reaches every tensor-parallel rank
through the group's broadcast (no file), a rank 0 that cannot start one makes the other
ranks fail at once instead of waiting for it, and a rank on another host (which rank
0's loopback does not reach) refuses to start."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import require

from hybridkv.integration import pool as pool_module
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.pool import Broadcast, EmbeddedMaster, Pool, SharedMaster, open_pool
from hybridkv.transport import MasterProcess, MooncakeConfig, MooncakeStore, Status
from hybridkv.transport.integrity import TaggedStore

RANKS = 2


class ThreadGroup:
    """The broadcast of a tensor-parallel group whose ranks are this process's threads."""

    def __init__(self, ranks: int) -> None:
        self._barrier = threading.Barrier(ranks)
        self._value: EmbeddedMaster | SharedMaster | None = None
        self.sent: list[EmbeddedMaster | SharedMaster | None] = []

    def broadcast(self, rank: int) -> Broadcast:
        def broadcast(
            value: EmbeddedMaster | SharedMaster | None,
        ) -> EmbeddedMaster | SharedMaster | None:
            if rank == 0:
                self._value = value
                self.sent.append(value)
            self._barrier.wait(timeout=60)
            return self._value

        return broadcast


RANK = threading.local()  # the rank a thread of `_open_all` plays


def _open_all(group: ThreadGroup) -> list[Pool | BaseException]:
    def open_rank(rank: int) -> Pool | BaseException:
        RANK.value = rank
        try:
            return open_pool(ConnectorConfig(), rank, group.broadcast(rank))
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(RANKS) as ranks:
        return list(ranks.map(open_rank, range(RANKS)))


@pytest.fixture(autouse=True)
def _embedded(monkeypatch: pytest.MonkeyPatch) -> None:
    require("mooncake.store")
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)


def test_every_rank_joins_the_master_rank_zero_started(caplog: pytest.LogCaptureFixture) -> None:
    group = ThreadGroup(RANKS)
    with caplog.at_level(logging.INFO, logger="hybridkv"):
        pools = _open_all(group)
    try:
        first, second = pools
        assert isinstance(first, Pool)
        assert isinstance(second, Pool)
        assert first.master is not None
        assert second.master is None
        assert group.sent == [EmbeddedMaster(socket.gethostname(), first.master.address)]
        # rank 0 alone logs the versions that run and the master
        started = [r.getMessage() for r in caplog.records if "hybridkv-keys" in r.getMessage()]
        assert len(started) == 1
        assert started[0].endswith(f"master {first.master.address}")
        assert "hybridkv-integration " in started[0]
        # one pool: what rank 0 stores, rank 1 reads
        assert isinstance(first.store, MooncakeStore)
        data = np.arange(4096, dtype=np.uint8)
        first.store.register_buffer(data.ctypes.data, data.nbytes)
        [status] = first.store.batch_put_whole(["shared"], [[data.ctypes.data]], [[data.nbytes]])
        assert status is Status.OK
        assert second.store.batch_is_readable(["shared"]) == [True]
        first.store.unregister_buffer(data.ctypes.data)
    finally:
        for pool in reversed(pools):
            if isinstance(pool, Pool):
                pool.close()
    assert not first.master.running()  # closing rank 0 stopped it


def test_other_ranks_fail_at_once_when_rank_zero_cannot_start_a_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no mooncake_master binary")

    monkeypatch.setattr(pool_module.MasterProcess, "start", refuse)
    group = ThreadGroup(RANKS)
    first, second = _open_all(group)
    assert isinstance(first, OSError)
    assert isinstance(second, RuntimeError)
    assert "rank 0 could not start the embedded mooncake_master" in str(second)
    assert group.sent == [None]


def test_a_rank_on_another_host_refuses_the_embedded_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each rank's thread is a host of its own.
    monkeypatch.setattr(socket, "gethostname", lambda: threading.current_thread().name)
    group = ThreadGroup(RANKS)
    pools = _open_all(group)
    first, second = pools
    try:
        assert isinstance(first, Pool)
        assert isinstance(second, RuntimeError)
        [sent] = group.sent
        assert sent is not None
        assert f"loopback of {sent.host}, which TP rank 1 on " in str(second)
        assert "MOONCAKE_CONFIG_PATH" in str(second)
    finally:
        if isinstance(first, Pool):
            first.close()


@pytest.mark.parametrize("configured", [(True, False), (False, True), (True, True)])
def test_ranks_that_see_different_pools_refuse_to_start_instead_of_waiting(
    configured: tuple[bool, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor may not pass MOONCAKE_CONFIG_PATH to every worker: a rank seeing
    another pool than rank 0 (none, or another master) would wait for rank 0 forever, or
    store into a pool the others never read."""
    master = MasterProcess.start()
    addresses = [master.address, "127.0.0.1:1"]
    configs = [
        MooncakeConfig(master_server_address=address) if wanted else None
        for address, wanted in zip(addresses, configured, strict=True)
    ]
    monkeypatch.setattr(pool_module, "mooncake_config_from_env", lambda: configs[RANK.value])
    first, second = _open_all(ThreadGroup(RANKS))
    try:
        assert isinstance(first, Pool)
        assert isinstance(second, RuntimeError)
        seen = addresses[1] if configured[1] else "none"
        assert f"TP rank 1 is configured with {seen}" in str(second)
        assert "every worker must see the same file" in str(second)
    finally:
        if isinstance(first, Pool):
            first.close()
        master.stop()


@pytest.mark.parametrize(
    ("store", "named"), [("mooncake", "an embedded master"), ("memory", "the memory store")]
)
def test_pipeline_stages_need_a_shared_master(store: str, named: str) -> None:
    """Each stage's rank 0 would start a pool of its own: the stages' objects would never
    meet, and no stage would hit."""
    with pytest.raises(RuntimeError, match=f"{named} serves one pipeline stage only"):
        open_pool(ConnectorConfig(store=store), 0, ThreadGroup(1).broadcast(0), pp_size=2)


def test_with_a_secret_the_pool_tags_its_objects_and_closing_it_keeps_the_shared_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HKV_POOL_SECRET", "0123456789abcdef0123456789abcdef")
    config = ConnectorConfig(store="memory", integrity_secret_env="HKV_POOL_SECRET")
    pool = open_pool(config, 0, ThreadGroup(1).broadcast(0))
    plain = pool_module.process_memory_store()
    assert isinstance(pool.store, TaggedStore)
    assert pool.store.inner is plain
    data = np.arange(256, dtype=np.uint8)
    assert pool.store.batch_put_whole(["tagged"], [[data.ctypes.data]], [[256]]) == [Status.OK]
    out = np.zeros(256, dtype=np.uint8)  # read untagged: the object is larger than its bytes
    assert plain.batch_get_whole(["tagged"], [[out.ctypes.data]], [[256]]) != [Status.OK]
    pool.close()
    assert plain.batch_is_readable(["tagged"]) == [True]  # still open, shared
