"""The `Store` contract, run against the in-memory store and a real Mooncake pool alike."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.transport.errors import InvalidRequestError, Status, StoreClosed
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.store import Store
from hybridkv.transport.testing import StartHolder, StartMaster, mooncake_config

OK = Status.OK


def fresh_key(tag: str = "k") -> str:
    return f"contract-{tag}-{uuid.uuid4().hex}"


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def pieces_of(array: np.ndarray, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Pointers and lengths of consecutive slices of `array`."""
    ptrs, offset = [], 0
    for size in sizes:
        ptrs.append(array.ctypes.data + offset)
        offset += size
    return ptrs, list(sizes)


def put_whole(store: Store, key: str, data: np.ndarray, split: Sequence[int] = ()) -> Status:
    ptrs, sizes = pieces_of(data, split or [data.nbytes])
    return store.batch_put_whole([key], [ptrs], [sizes])[0]


def get_whole(store: Store, key: str, size: int) -> tuple[Status, np.ndarray]:
    out = np.zeros(size, dtype=np.uint8)
    status = store.batch_get_whole([key], [[out.ctypes.data]], [[size]])[0]
    return status, out


def commit_with_session(store: Store, key: str, data: np.ndarray) -> None:
    assert store.put_session_start([key], [data.nbytes]) == [OK]
    assert store.put_ranges([key], [[data.ctypes.data]], [[data.nbytes]], [[0]]) == [OK]
    assert store.put_session_end([key]) == [OK]


def test_open_put_session_is_invisible_until_end(store: Store) -> None:
    key, data = fresh_key(), pattern(4096, 1)
    assert store.put_session_start([key], [data.nbytes]) == [OK]
    assert store.put_ranges([key], [[data.ctypes.data]], [[4096]], [[0]]) == [OK]
    assert store.batch_is_readable([key]) == [False]
    assert get_whole(store, key, 4096)[0] is Status.NOT_READY
    assert store.get_session_start([key]) == [Status.NOT_READY]

    assert store.put_session_end([key]) == [OK]
    assert store.batch_is_readable([key]) == [True]
    status, out = get_whole(store, key, 4096)
    assert status is OK
    assert np.array_equal(out, data)


def test_revoked_session_leaves_nothing_and_the_key_can_be_put_again(store: Store) -> None:
    key, data = fresh_key(), pattern(2048, 2)
    assert store.put_session_start([key], [data.nbytes]) == [OK]
    assert store.put_ranges([key], [[data.ctypes.data]], [[1024]], [[0]]) == [OK]
    assert store.put_session_revoke([key]) == [OK]
    assert store.batch_is_readable([key]) == [False]
    assert get_whole(store, key, 2048)[0] is Status.NOT_FOUND
    assert store.put_session_revoke([key]) == [Status.INVALID]
    assert store.put_session_end([key]) == [Status.INVALID]

    commit_with_session(store, key, data)
    assert np.array_equal(get_whole(store, key, 2048)[1], data)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    piece_sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_ranged_writes_and_reads_are_byte_exact_at_any_offset(
    store: Store, piece_sizes: list[int], seed: int, data: st.DataObject
) -> None:
    """Pieces written in any order at their offsets read back, by any ranges, exactly."""
    key, total = fresh_key("range"), sum(piece_sizes)
    source = pattern(total, seed)
    offsets = [sum(piece_sizes[:i]) for i in range(len(piece_sizes))]
    order = data.draw(st.permutations(range(len(piece_sizes))))
    assert store.put_session_start([key], [total]) == [OK]
    # One call per piece in shuffled order, as a layer-by-layer save writes them.
    for i in order:
        ptr = source.ctypes.data + offsets[i]
        assert store.put_ranges([key], [[ptr]], [[piece_sizes[i]]], [[offsets[i]]]) == [OK]
    assert store.put_session_end([key]) == [OK]

    starts = data.draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=4))
    ranges = [(start, data.draw(st.integers(1, total - start))) for start in starts]
    outs = [np.zeros(length, dtype=np.uint8) for _, length in ranges]
    assert store.get_session_start([key]) == [OK]
    got = store.get_ranges(
        [key],
        [[out.ctypes.data for out in outs]],
        [[length for _, length in ranges]],
        [[start for start, _ in ranges]],
    )
    store.get_session_end([key])
    assert got == [OK]
    for (start, length), out in zip(ranges, outs, strict=True):
        assert np.array_equal(out, source[start : start + length])


def test_batch_of_sessions_keeps_each_key_separate(store: Store) -> None:
    keys = [fresh_key(str(i)) for i in range(3)]
    blobs = [pattern(1000 + 100 * i, 10 + i) for i in range(3)]
    assert store.put_session_start(keys, [b.nbytes for b in blobs]) == [OK] * 3
    # Write each object in two halves within one batch call.
    halves = [(b.nbytes // 2, b.nbytes - b.nbytes // 2) for b in blobs]
    assert (
        store.put_ranges(
            keys,
            [[b.ctypes.data, b.ctypes.data + h[0]] for b, h in zip(blobs, halves, strict=True)],
            [list(h) for h in halves],
            [[0, h[0]] for h in halves],
        )
        == [OK] * 3
    )
    assert store.put_session_end(keys) == [OK] * 3
    outs = [np.zeros(b.nbytes, dtype=np.uint8) for b in blobs]
    assert store.get_session_start(keys) == [OK] * 3
    got = store.get_ranges(
        keys, [[o.ctypes.data] for o in outs], [[o.nbytes] for o in outs], [[0]] * 3
    )
    store.get_session_end(keys)
    assert got == [OK] * 3
    for blob, out in zip(blobs, outs, strict=True):
        assert np.array_equal(blob, out)


def test_multi_buffer_whole_put_and_get_are_byte_exact(store: Store) -> None:
    key, data = fresh_key(), pattern(10_000, 3)
    assert put_whole(store, key, data, split=[1, 999, 5000, 4000]) is OK
    assert store.batch_is_readable([key]) == [True]
    # Read back into a different split of the same total size.
    out = np.zeros(10_000, dtype=np.uint8)
    ptrs, sizes = pieces_of(out, [7000, 3000])
    assert store.batch_get_whole([key], [ptrs], [sizes]) == [OK]
    assert np.array_equal(out, data)


def test_whole_get_needs_pieces_adding_up_to_the_object(store: Store) -> None:
    key, data = fresh_key(), pattern(4096, 4)
    assert put_whole(store, key, data) is OK
    assert get_whole(store, key, 4000)[0] is Status.INVALID
    # Mooncake fails a too-large destination in its transfer step rather than up front.
    assert get_whole(store, key, 5000)[0] in (Status.INVALID, Status.TRANSFER_FAILED)


def test_batch_is_readable_reports_each_key(store: Store) -> None:
    committed, open_key, missing = fresh_key("c"), fresh_key("o"), fresh_key("m")
    assert put_whole(store, committed, pattern(512, 5)) is OK
    assert store.put_session_start([open_key], [512]) == [OK]
    assert store.batch_is_readable([committed, open_key, missing]) == [True, False, False]
    assert store.batch_is_readable([]) == []
    assert store.put_session_revoke([open_key]) == [OK]


def test_missing_keys_are_not_found(store: Store) -> None:
    key = fresh_key("missing")
    assert get_whole(store, key, 64)[0] is Status.NOT_FOUND
    assert store.get_session_start([key]) == [Status.NOT_FOUND]
    assert store.batch_remove([key]) == [Status.NOT_FOUND]


def test_remove_deletes_and_reads_lease_objects_until_forced(store: Store) -> None:
    unread, read = fresh_key("unread"), fresh_key("read")
    for key in (unread, read):
        assert put_whole(store, key, pattern(1024, 6)) is OK
    assert store.batch_remove([unread]) == [OK]
    assert store.batch_is_readable([unread]) == [False]
    assert get_whole(store, unread, 1024)[0] is Status.NOT_FOUND

    assert get_whole(store, read, 1024)[0] is OK
    assert store.batch_remove([read]) == [Status.LEASED]
    assert store.batch_remove([read], force=True) == [OK]
    assert store.batch_is_readable([read]) == [False]


def test_remove_by_prefix_deletes_exactly_the_committed_keys_it_starts(store: Store) -> None:
    """Characters a regular expression treats specially match only themselves; a read's
    lease keeps an object unless forced; a key still being put is left alone."""
    tag = uuid.uuid4().hex
    prefix = f"m.{tag}(1)@"
    mine = [f"{prefix}{i}" for i in range(3)]
    others = [f"mX{tag}(1)@0", f"m.{tag}1@0", f"m.{tag}(1)X0", f"n{prefix}0"]
    for key in (*mine, *others):
        assert put_whole(store, key, pattern(512, 9)) is OK
    opened = f"{prefix}open"
    assert store.put_session_start([opened], [512]) == [OK]
    assert get_whole(store, mine[0], 512)[0] is OK  # leased now

    assert store.remove_by_prefix(prefix) == 2
    assert store.batch_is_readable(mine) == [True, False, False]
    assert store.remove_by_prefix(prefix, force=True) == 1
    assert store.batch_is_readable([*mine, *others]) == [False] * 3 + [True] * 4
    assert store.remove_by_prefix(prefix, force=True) == 0

    data = pattern(512, 10)  # the open put was left alone: it still commits
    assert store.put_ranges([opened], [[data.ctypes.data]], [[512]], [[0]]) == [OK]
    assert store.put_session_end([opened]) == [OK]
    assert np.array_equal(get_whole(store, opened, 512)[1], data)
    assert store.batch_remove([*others, opened], force=True) == [OK] * 5
    with pytest.raises(InvalidRequestError, match="empty prefix"):
        store.remove_by_prefix("")


def test_put_of_an_existing_key_keeps_the_old_bytes(store: Store) -> None:
    key, old, new = fresh_key(), pattern(2048, 7), pattern(2048, 8)
    assert put_whole(store, key, old) is OK
    assert put_whole(store, key, new) is OK  # Mooncake reports success ...
    assert np.array_equal(get_whole(store, key, 2048)[1], old)  # ... and keeps the old value
    assert store.put_session_start([key], [2048]) == [Status.EXISTS]
    assert np.array_equal(get_whole(store, key, 2048)[1], old)


def test_a_key_repeated_in_one_session_start_is_exists(store: Store) -> None:
    key = fresh_key()
    assert store.put_session_start([key, key], [256, 256]) == [OK, Status.EXISTS]
    assert store.put_session_start([key], [256]) == [Status.INVALID]  # already open
    assert store.put_session_revoke([key]) == [OK]


def test_an_open_put_session_belongs_to_the_client_that_opened_it(
    two_clients: tuple[Store, Store],
) -> None:
    """Two instances storing one prefix at once: the first to open a key writes it; the
    other can neither open, write, end nor revoke it, and its whole put changes nothing."""
    first, second = two_clients
    key, mine, theirs = fresh_key(), pattern(2048, 10), pattern(2048, 11)
    assert first.put_session_start([key], [2048]) == [OK]
    assert second.put_session_start([key], [2048]) == [Status.EXISTS]
    assert second.put_ranges([key], [[theirs.ctypes.data]], [[2048]], [[0]]) == [Status.INVALID]
    assert second.put_session_end([key]) == [Status.INVALID]
    assert second.put_session_revoke([key]) == [Status.INVALID]
    assert put_whole(second, key, theirs) is OK  # Mooncake says OK and keeps the session
    assert second.batch_is_readable([key]) == [False]
    assert first.put_ranges([key], [[mine.ctypes.data]], [[2048]], [[0]]) == [OK]
    assert first.put_session_end([key]) == [OK]
    status, out = get_whole(second, key, 2048)
    assert status is OK
    assert np.array_equal(out, mine)


def test_a_whole_put_over_a_revoked_session_of_another_client_left_nothing(
    two_clients: tuple[Store, Store],
) -> None:
    first, second = two_clients
    key, data = fresh_key(), pattern(1024, 12)
    assert first.put_session_start([key], [1024]) == [OK]
    assert put_whole(second, key, data) is OK
    assert first.put_session_revoke([key]) == [OK]
    assert second.batch_is_readable([key]) == [False]  # the OK above stored nothing
    assert put_whole(second, key, data) is OK
    assert first.batch_is_readable([key]) == [True]
    assert np.array_equal(get_whole(first, key, 1024)[1], data)


DISCARD_S = 1  # the master's put_start_discard_timeout_sec, shortened from 30 s


@pytest.fixture(params=["memory", "mooncake"])
def discarding_clients(
    request: pytest.FixtureRequest,
    start_mooncake_master: StartMaster,
    start_segment_holder: StartHolder,
) -> Iterator[tuple[Store, Store]]:
    """Two clients of a pool whose master discards put sessions open DISCARD_S."""
    if request.param == "memory":
        memory = MemoryStore(put_discard_s=DISCARD_S)
        other = memory.another_client()
        yield memory, other
        other.close()
        memory.close()
        return
    flag = f"--put_start_discard_timeout_sec={DISCARD_S}"
    master = start_mooncake_master(extra_args=[flag])
    start_segment_holder(master.address)
    first = MooncakeStore.connect(mooncake_config(master.address))
    second = MooncakeStore.connect(mooncake_config(master.address))
    yield first, second
    second.close()
    first.close()


def test_another_client_takes_over_a_put_session_left_open_past_the_discard_timeout(
    discarding_clients: tuple[Store, Store],
) -> None:
    """A writer that stalls (or died without closing) does not hold its keys for good:
    past the master's discard timeout another client may write them; the old writer's
    ranges then land nowhere, and its end and revoke fail."""
    first, second = discarding_clients
    mine, theirs = pattern(1024, 20), pattern(1024, 21)
    taken, revoked, whole, kept, own = (fresh_key(tag) for tag in "trwko")
    stale = [taken, revoked, whole, kept, own]
    assert first.put_session_start(stale, [1024] * 5) == [OK] * 5
    time.sleep(DISCARD_S + 0.5)
    young = fresh_key("y")
    assert first.put_session_start([young], [1024]) == [OK]
    assert second.put_session_start([young], [1024]) == [Status.EXISTS]  # not stale yet
    assert first.put_session_start([own], [1024]) == [Status.INVALID]  # its own: still open

    commit_with_session(second, taken, theirs)
    assert second.put_session_start([revoked], [1024]) == [OK]
    assert second.put_session_revoke([revoked]) == [OK]
    assert put_whole(second, whole, theirs) is OK

    assert first.put_ranges([taken], [[mine.ctypes.data]], [[1024]], [[0]]) == [OK]  # nowhere
    assert first.put_session_end([taken]) == [Status.OTHER]
    assert first.put_session_revoke([taken]) == [Status.OTHER]
    assert first.put_session_end([revoked]) == [Status.NOT_FOUND]
    assert first.put_session_end([whole]) == [Status.OTHER]
    for key in (kept, own, young):  # nobody took them: the sessions still commit
        assert first.put_ranges([key], [[mine.ctypes.data]], [[1024]], [[0]]) == [OK]
        assert first.put_session_end([key]) == [OK]
    assert second.batch_is_readable([revoked]) == [False]
    for key, data in [(taken, theirs), (whole, theirs), (kept, mine), (own, mine), (young, mine)]:
        status, out = get_whole(second, key, 1024)
        assert status is OK
        assert np.array_equal(out, data), key


def test_ranged_calls_need_a_session_and_in_bounds_ranges(store: Store) -> None:
    key, data = fresh_key(), pattern(4096, 9)
    ptr = data.ctypes.data
    assert store.put_ranges([key], [[ptr]], [[16]], [[0]]) == [Status.INVALID]
    assert store.put_session_start([key], [4096]) == [OK]
    assert store.put_ranges([key], [[ptr]], [[200]], [[4000]]) == [Status.INVALID]
    assert store.put_ranges([key], [[ptr]], [[96]], [[4000]]) == [OK]  # ends exactly at the end
    assert store.put_session_end([key]) == [OK]
    assert store.put_ranges([key], [[ptr]], [[16]], [[0]]) == [Status.INVALID]  # committed

    out = np.zeros(4096, dtype=np.uint8)
    assert store.get_ranges([key], [[out.ctypes.data]], [[16]], [[0]]) == [Status.INVALID]
    assert store.get_session_start([key]) == [OK]
    assert store.get_ranges([key], [[out.ctypes.data]], [[200]], [[4000]]) == [Status.INVALID]
    assert store.get_ranges([key], [[out.ctypes.data]], [[96]], [[4000]]) == [OK]
    store.get_session_end([key])
    assert np.array_equal(out[:96], data[:96])
    assert store.get_ranges([key], [[out.ctypes.data]], [[16]], [[0]]) == [Status.INVALID]


LEASE_S = 0.3


@pytest.fixture(params=["memory", "mooncake"])
def short_lease_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A store of the test's own whose reads lease objects for LEASE_S seconds."""
    if request.param == "memory":
        memory = MemoryStore(lease_ttl_s=LEASE_S)
        yield memory
        memory.close()
        return
    master = request.getfixturevalue("start_mooncake_master")(lease_ttl_ms=int(LEASE_S * 1e3))
    request.getfixturevalue("start_segment_holder")(master.address)
    mooncake = MooncakeStore.connect(mooncake_config(master.address))
    yield mooncake
    mooncake.close()


def test_a_get_session_reads_while_its_lease_lasts_and_its_object_stays(
    short_lease_store: Store,
) -> None:
    """A pinned object's ranges come from the replica the pin found: once the lease the pin
    took has expired they fail (TRANSFER_FAILED) until pinned again, and once the object
    is removed they fail (Mooncake answers TRANSFER_FAILED or INVALID)."""
    store, key, data = short_lease_store, fresh_key("lease"), pattern(4096, 11)
    out = np.zeros(4096, dtype=np.uint8)

    def read() -> Status:
        out[:] = 0
        [status] = store.get_ranges([key], [[out.ctypes.data]], [[4096]], [[0]])
        return status

    assert put_whole(store, key, data) is OK
    assert store.get_session_start([key]) == [OK]
    assert read() is OK
    assert np.array_equal(out, data)
    time.sleep(3 * LEASE_S)
    assert read() is Status.TRANSFER_FAILED
    store.get_session_end([key])
    assert store.get_session_start([key]) == [OK]
    assert read() is OK
    assert np.array_equal(out, data)
    time.sleep(3 * LEASE_S)  # unleased: removable without force
    assert store.batch_remove([key]) == [OK]
    assert not read().ok
    store.get_session_end([key])


def test_malformed_batches_are_refused_before_any_io(store: Store) -> None:
    key, data = fresh_key(), pattern(64, 10)
    with pytest.raises(InvalidRequestError, match="2 keys but 1"):
        store.batch_put_whole([key, fresh_key()], [[data.ctypes.data]], [[64]])
    with pytest.raises(InvalidRequestError, match="disagree"):
        store.batch_put_whole([key], [[data.ctypes.data]], [[32, 32]])
    with pytest.raises(InvalidRequestError, match="1 keys but 2 sizes"):
        store.put_session_start([key], [64, 64])
    assert store.batch_is_readable([key]) == [False]


def test_empty_batches_do_nothing(store: Store) -> None:
    assert store.batch_put_whole([], [], []) == []
    assert store.put_session_start([], []) == []
    assert store.batch_remove([]) == []


def test_every_call_after_close_raises_store_closed(closable_store: Store) -> None:
    store = closable_store
    key, data = fresh_key(), pattern(256, 11)
    assert put_whole(store, key, data) is OK
    store.close()
    store.close()  # idempotent
    ptrs, sizes = [[data.ctypes.data]], [[256]]
    calls: list[Callable[[], object]] = [
        lambda: store.register_buffer(data.ctypes.data, 256),
        lambda: store.batch_is_readable([key]),
        lambda: store.batch_put_whole([key], ptrs, sizes),
        lambda: store.batch_get_whole([key], ptrs, sizes),
        lambda: store.put_session_start([key], [256]),
        lambda: store.put_ranges([key], ptrs, sizes, [[0]]),
        lambda: store.put_session_end([key]),
        lambda: store.put_session_revoke([key]),
        lambda: store.get_session_start([key]),
        lambda: store.get_ranges([key], ptrs, sizes, [[0]]),
        lambda: store.get_session_end([key]),
        lambda: store.batch_remove([key]),
        lambda: store.remove_by_prefix(key),
    ]
    for call in calls:
        with pytest.raises(StoreClosed):
            call()
