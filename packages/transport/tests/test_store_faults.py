"""Faults: a full pool, a lost master, a dead segment holder, injected failures.

Each must end in a typed status, quickly, with nothing half-written readable afterwards.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from hybridkv.transport.errors import Status, StoreUnavailable, raise_on_failure
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.store import Store
from hybridkv.transport.testing import StartHolder, StartMaster, mooncake_config, stalled

OK = Status.OK


def keys_of(tag: str, count: int) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"fault-{tag}-{run}-{i}" for i in range(count)]


def put_all(store: Store, keys: list[str], data: np.ndarray) -> list[Status]:
    return store.batch_put_whole(
        keys, [[data.ctypes.data]] * len(keys), [[data.nbytes]] * len(keys)
    )


def get_one(store: Store, key: str, size: int) -> tuple[Status, np.ndarray]:
    out = np.full(size, 0xAB, dtype=np.uint8)
    return store.batch_get_whole([key], [[out.ctypes.data]], [[size]])[0], out


def fill_with_sessions(store: Store, object_size: int, limit: int = 1000) -> list[str]:
    """Open put sessions until the pool refuses one; return the keys that got space."""
    opened: list[str] = []
    for key in keys_of("fill", limit):
        status = store.put_session_start([key], [object_size])[0]
        if status is Status.NO_SPACE:
            return opened
        assert status is OK
        opened.append(key)
    raise AssertionError(f"{limit} objects of {object_size} B fitted; the pool is not bounded")


# -- in-memory store ------------------------------------------------------------------


def test_memory_capacity_reports_no_space_and_frees_on_revoke_and_remove() -> None:
    store = MemoryStore(capacity=10_000, lease_ttl_s=0)
    data = np.arange(4000, dtype=np.uint8)
    assert put_all(store, keys_of("a", 3), data) == [OK, OK, Status.NO_SPACE]
    opened = fill_with_sessions(store, 1000)
    assert len(opened) == 2
    assert store.put_session_revoke(opened) == [OK, OK]
    assert store.used_bytes == 8000
    assert store.open_put_sessions() == set()


def test_memory_fail_next_hits_only_matching_keys_for_the_given_calls() -> None:
    store = MemoryStore()
    data = np.arange(100, dtype=np.uint8)
    doomed, fine = keys_of("doomed", 1)[0], keys_of("fine", 1)[0]
    store.fail_next("batch_put_whole", {doomed}, Status.TRANSFER_FAILED, calls=2)
    assert put_all(store, [doomed, fine], data) == [Status.TRANSFER_FAILED, OK]
    assert put_all(store, [doomed], data) == [Status.TRANSFER_FAILED]
    assert store.batch_is_readable([doomed, fine]) == [False, True]
    assert put_all(store, [doomed], data) == [OK]  # the fault is used up

    store.fail_next(
        "get_session_start", lambda key: key.startswith("fault-fine"), Status.RPC_FAILED
    )
    assert store.get_session_start([doomed, fine]) == [OK, Status.RPC_FAILED]
    store.get_session_end([doomed])
    assert store.open_get_sessions() == set()


def test_memory_fail_next_refuses_nonsense() -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="unknown operation"):
        store.fail_next("put", {"k"}, Status.NO_SPACE)
    with pytest.raises(ValueError, match="failure status"):
        store.fail_next("put_ranges", {"k"}, Status.OK)


def test_memory_failed_range_write_then_revoke_leaves_nothing() -> None:
    store = MemoryStore()
    data = np.arange(256, dtype=np.uint8)
    key = keys_of("half", 1)[0]
    assert store.put_session_start([key], [512]) == [OK]
    assert store.put_ranges([key], [[data.ctypes.data]], [[256]], [[0]]) == [OK]
    store.fail_next("put_ranges", {key}, Status.TRANSFER_FAILED)
    assert store.put_ranges([key], [[data.ctypes.data]], [[256]], [[256]]) == [
        Status.TRANSFER_FAILED
    ]
    assert store.put_session_revoke([key]) == [OK]
    assert store.batch_is_readable([key]) == [False]
    assert store.open_put_sessions() == set()
    assert store.used_bytes == 0


# -- real Mooncake ----------------------------------------------------------------------


def test_full_pool_reports_no_space_and_revoked_sessions_give_it_back(
    start_mooncake_master: StartMaster,
) -> None:
    master = start_mooncake_master()
    store = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=16 << 20))
    try:
        assert store.put_session_start(keys_of("huge", 1), [32 << 20]) == [Status.NO_SPACE]
        opened = fill_with_sessions(store, 1 << 20)
        assert 8 <= len(opened) <= 16, len(opened)
        data = np.ones(1 << 20, dtype=np.uint8)
        assert put_all(store, keys_of("late", 1), data) == [Status.NO_SPACE]
        with pytest.raises(Exception, match="NO_SPACE"):
            raise_on_failure("put", opened[:1], [Status.NO_SPACE])

        assert store.put_session_revoke(opened) == [OK] * len(opened)
        assert store.batch_is_readable(opened) == [False] * len(opened)
        # The space came back, and the revoked keys can be written again.
        assert put_all(store, opened[:4], data) == [OK] * 4
        assert store.batch_is_readable(opened[:4]) == [True] * 4
    finally:
        store.close()


def test_lost_master_fails_calls_fast_and_recovery_follows_a_restart(
    start_mooncake_master: StartMaster,
) -> None:
    master = start_mooncake_master()
    store = MooncakeStore.connect(mooncake_config(master.address))
    data = np.arange(4096, dtype=np.uint8)
    try:
        before = keys_of("before", 2)
        assert put_all(store, before, data) == [OK, OK]
        master.kill()

        timings = []
        for attempt in range(6):
            started = time.monotonic()
            statuses = put_all(store, keys_of(f"down{attempt}", 2), data)
            with pytest.raises(StoreUnavailable, match="batch_is_readable of 'fault-before"):
                store.batch_is_readable(before)  # no answer, which is not a miss
            timings.append(time.monotonic() - started)
            assert statuses == [Status.RPC_FAILED] * 2
        print("calls with the master down took", [f"{t:.3f} s" for t in timings])
        with pytest.raises(StoreUnavailable, match="RPC_FAILED"):
            raise_on_failure("put", ["x"], [Status.RPC_FAILED])
        with pytest.raises(StoreUnavailable, match="remove_by_prefix of 'before"):
            store.remove_by_prefix("before")
        assert sum(timings) < 30  # the raw client spends ~4 s per call reconnecting

        restarted = start_mooncake_master(rpc_port=master.rpc_port)
        assert restarted.address == master.address
        deadline, after = time.monotonic() + 30, keys_of("after", 1)
        while put_all(store, after, data) != [OK]:
            assert time.monotonic() < deadline, "client never reconnected to the new master"
            time.sleep(0.5)
        print(f"reconnected {30 - (deadline - time.monotonic()):.1f} s after the restart")
        status, out = get_one(store, after[0], 4096)
        assert status is OK
        assert np.array_equal(out, data)
    finally:
        store.close()


def test_dead_holder_fails_reads_fast_without_garbage(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder
) -> None:
    master = start_mooncake_master(client_ttl_s=2)
    holder = start_segment_holder(master.address, "32MB")
    store = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=0))
    data = np.arange(8192, dtype=np.uint8)
    try:
        whole, ranged, half_written = keys_of("held", 3)
        assert put_all(store, [whole, ranged], data) == [OK, OK]
        assert store.get_session_start([ranged]) == [OK]
        assert store.put_session_start([half_written], [8192]) == [OK]
        assert store.put_ranges([half_written], [[data.ctypes.data]], [[4096]], [[0]]) == [OK]
        holder.kill()

        started = time.monotonic()
        status, out = get_one(store, whole, 8192)
        ranged_out = np.full(4096, 0xAB, dtype=np.uint8)
        ranged_status = store.get_ranges([ranged], [[ranged_out.ctypes.data]], [[4096]], [[0]])
        store.get_session_end([ranged])
        write_status = store.put_ranges(
            [half_written], [[data.ctypes.data + 4096]], [[4096]], [[4096]]
        )
        elapsed = time.monotonic() - started
        print(f"whole get {status.name}, ranged get {ranged_status[0].name}, ranged put "
              f"{write_status[0].name} after the holder died, in {elapsed:.3f} s")  # fmt: skip
        assert status is Status.TRANSFER_FAILED
        assert ranged_status == [Status.TRANSFER_FAILED]
        assert write_status == [Status.TRANSFER_FAILED]
        assert not np.array_equal(out, data)
        assert not np.array_equal(ranged_out, data[:4096])
        assert elapsed < 30

        # The half-written object is revoked; nothing of it is ever readable.
        revoke = store.put_session_revoke([half_written])
        print("revoke of the session on the dead segment:", revoke[0].name)
        assert store.batch_is_readable([half_written]) == [False]

        # Once the master drops the dead segment (client_ttl 2 s) the keys read as gone,
        # and with a new holder the same keys can be stored again.
        deadline = time.monotonic() + 30
        while store.batch_is_readable([whole, ranged]) != [False, False]:
            assert time.monotonic() < deadline, "dead segment's objects never went away"
            time.sleep(0.5)
        start_segment_holder(master.address, "32MB")
        assert put_all(store, [whole, ranged, half_written], data) == [OK] * 3
        status, out = get_one(store, half_written, 8192)
        assert status is OK
        assert np.array_equal(out, data)
    finally:
        store.close()


def test_a_stalled_holder_fails_transfers_within_the_store_timeout_and_writes_nothing_late(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder
) -> None:
    """A holder that stops answering (SIGSTOP) held a get or a put for Mooncake's 30 s;
    now `store_timeout_s`. The connection is dropped, so the holder's late reply, once it
    runs again, never lands in the reader's buffer (which vLLM may have reused)."""
    master = start_mooncake_master()
    holder = start_segment_holder(master.address, "32MB")
    config = mooncake_config(master.address, global_segment_size=0, store_timeout_s=2)
    store = MooncakeStore.connect(config)
    data = np.arange(8192, dtype=np.uint8)
    try:
        whole, half_written = keys_of("stalled-holder", 2)
        assert put_all(store, [whole], data) == [OK]
        assert store.put_session_start([half_written], [8192]) == [OK]
        with stalled(holder.pid):
            started = time.monotonic()
            status, out = get_one(store, whole, 8192)
            read_s = time.monotonic() - started
            write_status = store.put_ranges([half_written], [[data.ctypes.data]], [[8192]], [[0]])
            elapsed = time.monotonic() - started
        print(f"against a stalled holder: get {status.name} in {read_s:.2f} s, ranged put "
              f"{write_status[0].name}, both in {elapsed:.2f} s")  # fmt: skip
        assert status is Status.TRANSFER_FAILED
        assert write_status == [Status.TRANSFER_FAILED]
        assert elapsed < 30  # each alone took Mooncake's 30 s before
        time.sleep(1)  # the holder runs again: nothing of its late reply arrives
        assert (out == 0xAB).all()

        assert store.put_session_revoke([half_written]) == [OK]
        assert store.batch_is_readable([half_written]) == [False]
        status, out = get_one(store, whole, 8192)  # the holder is back, its object intact
        assert status is OK
        assert np.array_equal(out, data)
    finally:
        store.close()


HALF_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from hybridkv.transport.mooncake_store import MooncakeStore
    from hybridkv.transport.testing import mooncake_config

    address, key = sys.argv[1:]
    store = MooncakeStore.connect(mooncake_config(address, global_segment_size=0))
    data = np.full(8192, 0x11, dtype=np.uint8)
    assert [s.name for s in store.put_session_start([key], [8192])] == ["OK"]
    statuses = store.put_ranges([key], [[data.ctypes.data]], [[4096]], [[0]])
    assert [s.name for s in statuses] == ["OK"]
    print("half written", flush=True)
    time.sleep(600)
""")


def test_a_writer_killed_inside_a_put_session_leaves_nothing_readable(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder
) -> None:
    """A writer SIGKILLed with half of an object written (its put session open, never
    ended): no reader ever sees a byte of it; the key stays taken (a put of it is a
    no-op) until the master discards the unfinished put (`put_start_discard_timeout_sec`,
    30 s by default, 2 s here), after which it is stored whole again."""
    master = start_mooncake_master(client_ttl_s=2, extra_args=["--put_start_discard_timeout_sec=2"])
    start_segment_holder(master.address, "32MB")
    key = keys_of("killed-writer", 1)[0]
    writer = subprocess.Popen(
        [sys.executable, "-c", HALF_WRITER, master.address, key],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline() == "half written\n"
    finally:
        writer.kill()
        writer.wait()
    store = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=0))
    data = np.arange(8192, dtype=np.uint8)
    try:
        started, seen = time.monotonic(), []
        while True:
            status, out = get_one(store, key, 8192)
            if status is OK:
                break
            seen.append(status.name)
            assert (out == 0xAB).all()  # not a byte of the half-written object
            assert store.batch_is_readable([key]) == [False]
            put_all(store, [key], data)  # a no-op while the dead writer's put holds it
            assert time.monotonic() < started + 30, f"the key never came free: {set(seen)}"
            time.sleep(0.5)
        print(f"killed writer's key: gets {sorted(set(seen))}, stored whole after "
              f"{time.monotonic() - started:.1f} s")  # fmt: skip
        assert np.array_equal(out, data)
    finally:
        store.close()


def test_a_master_that_does_not_answer_in_time_gives_no_answer_not_a_miss(
    start_mooncake_master: StartMaster,
) -> None:
    """A stalled master times the client's calls out (Mooncake's RPC_TIMEOUT, -901, after
    `store_timeout_s`): no answer, as with a master that is gone, not a missing or failed
    object."""
    master = start_mooncake_master()
    store = MooncakeStore.connect(mooncake_config(master.address, store_timeout_s=1))
    data = np.arange(4096, dtype=np.uint8)
    stored = keys_of("stalled", 1)
    try:
        assert put_all(store, stored, data) == [OK]
        with stalled(master.pid):
            with pytest.raises(StoreUnavailable, match="batch_is_readable of 'fault-stalled"):
                store.batch_is_readable(stored)
            assert store.get_session_start(stored) == [Status.RPC_FAILED]
    finally:
        store.close()


def test_a_stalled_master_costs_one_timeout_not_one_per_call(
    start_mooncake_master: StartMaster,
) -> None:
    """The stalled master's kernel still accepts connections, so a port check would let
    every later call wait out the timeout again (a save step blocked for a whole 40 s
    stall this way). After the first call without an answer, calls fail at once until the
    master answers the background probe; then they go through again."""
    master = start_mooncake_master()
    store = MooncakeStore.connect(mooncake_config(master.address, store_timeout_s=2))
    data = np.arange(4096, dtype=np.uint8)
    stored = keys_of("stall-once", 1)
    try:
        assert put_all(store, stored, data) == [OK]
        with stalled(master.pid):
            started = time.monotonic()
            assert store.get_session_start(stored) == [Status.RPC_FAILED]
            first = time.monotonic() - started
            later = []
            for attempt in range(8):  # over 4 s: two timeouts' worth, eight probe intervals
                time.sleep(0.5)
                started = time.monotonic()
                assert put_all(store, keys_of(f"stall-once{attempt}", 1), data) == [
                    Status.RPC_FAILED
                ]
                later.append(time.monotonic() - started)
            print(f"first call {first:.2f} s, later", [f"{t:.3f}" for t in later])
            assert first >= 1.5  # it did wait for the master's answer
            assert max(later) < 1.0  # none waited for the 2 s timeout
        deadline = time.monotonic() + 30
        while store.get_session_start(stored) != [OK]:
            assert time.monotonic() < deadline, "calls never went through after SIGCONT"
            time.sleep(0.2)
        store.get_session_end(stored)
        print(f"through again {30 - (deadline - time.monotonic()):.1f} s after SIGCONT")
    finally:
        store.close()
