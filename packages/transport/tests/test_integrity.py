"""Integrity tags: what a tagged store writes, and that changed bytes never load.

Runs against the in-memory store and a real Mooncake master (the `store` fixture); the
tampering goes through the store itself, as any client of the pool could do it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from _engine_drive import engine_for, load, save, unique_prefix
from _engine_model import Caches, transfers

from hybridkv.transport.errors import InvalidRequestError, Status
from hybridkv.transport.integrity import HEADER_BYTES, IntegrityKey, TaggedStore
from hybridkv.transport.store import Store

SECRET = b"a deployment secret of 32 bytes!"
SIZE = 4096
BLOCKS = {0: [1, 4], 1: [0, 2], 2: [3, 5]}


@pytest.fixture
def tagged(store: Store) -> Iterator[TaggedStore]:
    wrapped = TaggedStore(store, IntegrityKey(SECRET))
    yield wrapped
    wrapped._headers.release()  # the fixture closes the store itself


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def put(store: Store, key: str, data: np.ndarray) -> Status:
    [status] = store.batch_put_whole([key], [[data.ctypes.data]], [[data.nbytes]])
    return status


def get(store: Store, key: str, size: int) -> tuple[Status, np.ndarray]:
    out = np.zeros(size, dtype=np.uint8)
    [status] = store.batch_get_whole([key], [[out.ctypes.data]], [[size]])
    return status, out


def test_a_tagged_object_loads_as_written_with_its_header_in_front(
    store: Store, tagged: TaggedStore
) -> None:
    key, data = unique_prefix(), payload(1)
    assert put(tagged, key, data).ok
    status, out = get(tagged, key, SIZE)
    assert status.ok
    assert np.array_equal(out, data)
    status, raw = get(store, key, HEADER_BYTES + SIZE)  # as stored: header, then the bytes
    assert status.ok
    assert np.array_equal(raw[HEADER_BYTES:], data)


def test_off_means_no_tag_the_object_is_its_bytes(store: Store) -> None:
    key, data = unique_prefix(), payload(2)
    assert put(store, key, data).ok
    status, raw = get(store, key, SIZE)
    assert status.ok
    assert np.array_equal(raw, data)


@pytest.mark.parametrize("where", [HEADER_BYTES, HEADER_BYTES + SIZE - 1, 0, 40])
def test_bytes_changed_in_the_pool_fail_the_load(
    store: Store, tagged: TaggedStore, where: int
) -> None:
    """A client without the secret rewrites the object (payload, tag or length byte)."""
    key, data = unique_prefix(), payload(3)
    assert put(tagged, key, data).ok
    status, raw = get(store, key, HEADER_BYTES + SIZE)
    assert status.ok
    raw[where] ^= 0x01
    assert store.batch_remove([key], force=True) == [Status.OK]
    assert put(store, key, raw).ok
    status, _ = get(tagged, key, SIZE)
    assert status is Status.TAG_MISMATCH


def test_a_tag_made_with_another_secret_fails_the_load(store: Store, tagged: TaggedStore) -> None:
    key, data = unique_prefix(), payload(4)
    other = TaggedStore(store, IntegrityKey(b"another secret, also 32 bytes..."))
    try:
        assert put(other, key, data).ok
    finally:
        other._headers.release()
    status, _ = get(tagged, key, SIZE)
    assert status is Status.TAG_MISMATCH


def test_an_untagged_object_never_loads_as_tagged(store: Store, tagged: TaggedStore) -> None:
    key = unique_prefix()
    assert put(store, key, payload(5)).ok
    status, _ = get(tagged, key, SIZE)
    assert not status.ok
    data = payload(6)  # an untagged object of the tagged size: its "header" is no tag
    big = np.concatenate([payload(7)[:HEADER_BYTES], data])
    key = unique_prefix()
    assert put(store, key, big).ok
    status, _ = get(tagged, key, SIZE)
    assert status is Status.TAG_MISMATCH


def test_a_tampered_object_fails_the_engine_s_load_of_that_block_only(
    store: Store, tagged: TaggedStore
) -> None:
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=1)
    source.fill()
    saves = transfers(BLOCKS, prefix=prefix)
    with engine_for(tagged, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    victim = saves[0]
    size = HEADER_BYTES + source.layouts[victim.group].object_size
    status, raw = get(store, victim.key, size)
    assert status.ok
    raw[-1] ^= 0xFF
    assert store.batch_remove([victim.key], force=True) == [Status.OK]
    assert put(store, victim.key, raw).ok

    target = Caches(num_blocks=8, seed=2)
    loads = transfers(BLOCKS, request_id="reader", prefix=prefix)
    with engine_for(tagged, target, "whole") as reader:
        loaded = load(reader, loads, "whole")
    assert loaded.failed_keys == [victim.key]
    assert loaded.blamed_keys == [victim.key]  # the object's fault: quarantined
    assert loaded.failed_blocks == {victim.group: {loads[0].local_block}}
    for done in loads[1:]:
        source_block = next(t.local_block for t in saves if t.key == done.key)
        assert target.block_bytes(done.group, done.local_block) == source.block_bytes(
            done.group, source_block
        )


def test_ranged_transfers_are_refused_a_tag_covers_whole_objects(tagged: TaggedStore) -> None:
    with pytest.raises(InvalidRequestError, match="whole"):
        tagged.put_session_start(["k"], [SIZE])
    with pytest.raises(InvalidRequestError, match="whole"):
        tagged.get_ranges(["k"], [[1]], [[1]], [[0]])


def test_the_secret_comes_from_the_environment_never_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HKV_TEST_SECRET", raising=False)
    with pytest.raises(ValueError, match=r"HKV_TEST_SECRET.*unset"):
        IntegrityKey.from_env("HKV_TEST_SECRET")
    monkeypatch.setenv("HKV_TEST_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        IntegrityKey.from_env("HKV_TEST_SECRET")
    monkeypatch.setenv("HKV_TEST_SECRET", SECRET.decode())
    assert "deployment" not in repr(IntegrityKey.from_env("HKV_TEST_SECRET"))
