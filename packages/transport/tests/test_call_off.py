"""A save its waiter gave up on (`Ticket.call_off`) reads the caches no more.

Two staged saves queue behind a put that hangs (a stalled holder, here a gate the test
opens). Called off, neither waits for that put: the first had copied its blocks into
staging already, the second had read nothing. The caches are then overwritten (the owner
reuses the blocks) and the put goes on: the first save's objects are stored whole, as
they were when copied; the second's are never stored, and its keys count as failed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from _engine_drive import engine_for, read_object
from _engine_model import Caches, transfers

from hybridkv.transport.errors import Status
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.store import Pointers, Sizes


class GatedStore(MemoryStore):
    """Whole puts wait at a gate the test opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def batch_put_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise AssertionError("the test never opened the gate")
        return super().batch_put_whole(keys, ptrs, sizes)


def test_a_called_off_save_never_stores_what_it_had_not_read() -> None:
    store = GatedStore()
    caches = Caches(8)
    caches.fill()
    engine = engine_for(store, caches, "whole")
    first_saves = transfers({0: [0, 1]}, "first", "first")
    second_saves = transfers({0: [2, 3]}, "second", "second")
    expected = {t.key: caches.block_bytes(0, t.local_block) for t in first_saves}
    try:
        first, second = engine.save(first_saves), engine.save(second_saves)
        assert store.entered.wait(timeout=10)  # the first save's put hangs
        with pytest.raises(TimeoutError):
            first.wait(timeout=0.05)
        first.call_off()  # returns at once: the put reads staging, not the caches
        second.call_off()
        caches.fill()  # the blocks hold other KV now
        store.gate.set()
        first_result, second_result = first.wait(timeout=30), second.wait(timeout=30)
    finally:
        store.gate.set()
        engine.close()
    assert first_result.ok
    size = engine.layouts[0].object_size
    assert {key: read_object(store, key, size) for key in expected} == expected
    assert sorted(second_result.failed_keys) == sorted(t.key for t in second_saves)
    assert store.batch_is_readable([t.key for t in second_saves]) == [False, False]
