"""Staged transfers copy KV between caches and staging slabs by runs of consecutive blocks,
falling back to indexed copies for fragmented batches; whatever the block ids, slab sizes
and mode, the objects stored and the blocks loaded must equal the token-free oracle
(`Caches.block_bytes`: each entry's bytes at its prefix-sum offset)."""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from _engine_drive import PER_LAYER_OR_IN_PLACE, load, read_object, save, unique_prefix
from _engine_model import ALL_GROUPS, Caches, transfers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.errors import Status
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.staging import ALIGNMENT, STORE_CALL_NICENESS, Slab, StagingPool

NUM_BLOCKS = 48


@st.composite
def block_lists(draw: st.DrawFn) -> list[int]:
    """Distinct local block ids made of runs (the usual vLLM case) and scattered ids."""
    pieces: list[int] = []
    free = list(range(NUM_BLOCKS))
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.sampled_from(free)) if free else None
        if start is None:
            break
        length = draw(st.integers(1, 20))
        run = list(itertools.takewhile(set(free).__contains__, range(start, start + length)))
        pieces += run
        free = [b for b in free if b not in run]
    return pieces


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    writer=st.fixed_dictionaries({g: block_lists() for g in (0, 1, 2)}),
    reader_seed=st.integers(0, 2**32 - 1),
    write_mode=st.sampled_from(["whole", "staged"]),
    read_mode=st.sampled_from(["whole", "staged"]),
    slab_objects=st.sampled_from([1, 3, 8, 1000]),  # staging room, in largest objects
    source_major=st.sets(st.sampled_from([0, 1, 2])),  # groups moved in place, no staging
    target_major=st.sets(st.sampled_from([0, 1, 2])),
)
def test_staged_copies_match_the_oracle_for_any_block_ids(
    writer: dict[int, list[int]],
    reader_seed: int,
    write_mode: str,
    read_mode: str,
    slab_objects: int,
    source_major: set[int],
    target_major: set[int],
) -> None:
    store = MemoryStore()
    source = Caches(NUM_BLOCKS, seed=reader_seed, block_major=source_major)
    target = Caches(NUM_BLOCKS, block_major=target_major)
    source.fill()
    staging = slab_objects * max(layout.object_size for layout in source.layouts)
    options = PipelineOptions(granularity="staged", staging_bytes=staging)
    prefix = unique_prefix()
    saves = transfers(writer, prefix=prefix)
    with TransferEngine(store, source.layouts, options) as engine:
        assert save(engine, saves, write_mode).ok
    for transfer in saves:
        size = source.layouts[transfer.group].object_size
        assert read_object(store, transfer.key, size) == source.block_bytes(
            transfer.group, transfer.local_block
        )
    rng = random.Random(reader_seed)
    reader = {}
    for group, blocks in writer.items():  # a run elsewhere, or scattered ids
        start = rng.randrange(NUM_BLOCKS - len(blocks) + 1)
        run = list(range(start, start + len(blocks)))
        reader[group] = run if rng.random() < 0.5 else rng.sample(range(NUM_BLOCKS), len(blocks))
    with TransferEngine(store, target.layouts, options) as engine:
        assert load(engine, transfers(reader, "reader", prefix), read_mode).ok
    for group, blocks in writer.items():
        for source_block, target_block in zip(blocks, reader[group], strict=True):
            assert target.block_bytes(group, target_block) == source.block_bytes(
                group, source_block
            )


class CallRecordingStore(MemoryStore):
    """Notes each whole-object call: (operation, keys, most pieces of one key), every
    local address it reads or writes, and the niceness of the thread making it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []
        self.pointers: list[int] = []
        self.niceness: list[int] = []

    def _note(self, operation: str, keys: Any, ptrs: Any) -> None:
        self.calls.append((operation, len(keys), max(map(len, ptrs))))
        self.pointers += [pointer for pieces in ptrs for pointer in pieces]
        self.niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def batch_put_whole(self, keys: Any, ptrs: Any, sizes: Any) -> list[Status]:
        self._note("put", keys, ptrs)
        return super().batch_put_whole(keys, ptrs, sizes)

    def batch_get_whole(self, keys: Any, ptrs: Any, sizes: Any) -> list[Status]:
        self._note("get", keys, ptrs)
        return super().batch_get_whole(keys, ptrs, sizes)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
@PER_LAYER_OR_IN_PLACE
@pytest.mark.parametrize("mode", ["whole", "staged"])
def test_staged_store_calls_run_below_the_callers_priority(
    mode: str, block_major: tuple[int, ...]
) -> None:
    """Mooncake's calls spin while they wait: they must not outrank the staging copies,
    nor, for objects moved in place, Mooncake's own transfer threads."""
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    store = CallRecordingStore()
    source = Caches(8, seed=1, block_major=block_major)
    target = Caches(8, block_major=block_major)
    source.fill()
    options = PipelineOptions(granularity="staged")
    saves = transfers({0: [0, 1], 1: [2], 2: [3]}, prefix=unique_prefix())
    with TransferEngine(store, source.layouts, options) as engine:
        assert save(engine, saves, mode).ok
    with TransferEngine(store, target.layouts, options) as engine:
        assert load(engine, saves, mode).ok
    assert len(store.niceness) >= 2
    assert all(nice == min(19, caller + STORE_CALL_NICENESS) for nice in store.niceness)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller


def round_trip(store: MemoryStore, options: PipelineOptions, write_mode: str, read_mode: str,
               hold_pool: bool = False) -> None:  # fmt: skip
    """Save 3 x 7 blocks, load them elsewhere; `hold_pool`: the staging pools are full."""
    source, target = Caches(NUM_BLOCKS, seed=3), Caches(NUM_BLOCKS)
    source.fill()
    written = {group: list(range(group, group + 7)) for group in (0, 1, 2)}
    read = {group: list(range(20 + group * 7, 27 + group * 7)) for group in (0, 1, 2)}
    prefix = unique_prefix()
    for caches, blocks, mode in ((source, written, write_mode), (target, read, read_mode)):
        with TransferEngine(store, caches.layouts, options) as engine:
            assert engine.staging is not None
            held = engine.staging.allocate(options.staging_bytes, 1) if hold_pool else None
            moved = transfers(blocks, prefix=prefix)
            assert (save if caches is source else load)(engine, moved, mode).ok
            if held is not None:
                engine.staging.free(held)
    for group, blocks in written.items():
        for source_block, target_block in zip(blocks, read[group], strict=True):
            assert target.block_bytes(group, target_block) == source.block_bytes(
                group, source_block
            )


@pytest.mark.parametrize(
    ("write_mode", "read_mode"), list(itertools.product(["whole", "staged"], repeat=2))
)
def test_a_batch_larger_than_the_staging_room_moves_in_waves_one_piece_per_key(
    write_mode: str, read_mode: str
) -> None:
    store = CallRecordingStore()
    largest = max(layout.object_size for layout in Caches(NUM_BLOCKS).layouts)
    options = PipelineOptions(granularity="staged", staging_bytes=largest * 5 // 2)
    round_trip(store, options, write_mode, read_mode)
    assert {pieces for _, _, pieces in store.calls} == {1}  # never piece by piece
    for operation in ("put", "get"):
        keys = [count for name, count, _ in store.calls if name == operation]
        assert sum(keys) == 21
        assert max(keys) <= 5  # no wave larger than the room (2.5 of the largest objects)


@pytest.mark.parametrize(
    ("write_mode", "read_mode"), list(itertools.product(["whole", "staged"], repeat=2))
)
def test_contiguous_objects_move_in_place_one_piece_each_without_staging(
    write_mode: str, read_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CallRecordingStore()
    source = Caches(NUM_BLOCKS, seed=6, block_major=ALL_GROUPS)
    target = Caches(NUM_BLOCKS, block_major=ALL_GROUPS)
    source.fill()
    moved = transfers({0: [0, 1, 2], 1: [5, 9], 2: [40, 7, 3]}, prefix=unique_prefix())
    for caches, mode in ((source, write_mode), (target, read_mode)):
        with TransferEngine(store, caches.layouts, PipelineOptions()) as engine:
            monkeypatch.setattr(engine.staging, "allocate", lambda *_: pytest.fail("staged"))
            store.pointers.clear()
            assert (save if caches is source else load)(engine, moved, mode).ok
        expected = [caches.block_address(t.group, t.local_block) for t in moved]
        assert sorted(store.pointers) == sorted(expected)  # one piece per key, in the caches
    for transfer in moved:
        assert target.block_bytes(transfer.group, transfer.local_block) == source.block_bytes(
            transfer.group, transfer.local_block
        )


def test_objects_that_find_no_staging_room_move_piece_by_piece() -> None:
    store = CallRecordingStore()
    round_trip(store, PipelineOptions(granularity="staged"), "staged", "staged", hold_pool=True)
    assert store.calls
    assert min(pieces for _, _, pieces in store.calls) > 1  # one piece per cache entry


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 5000),
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(1, 50), st.integers(1, 300), st.integers(0, 99)),
        max_size=40,
    ),
)
def test_the_pool_hands_out_disjoint_aligned_slabs_within_its_capacity(
    capacity: int, steps: list[tuple[bool, int, int, int]]
) -> None:
    pool = StagingPool(MemoryStore(), capacity)
    held: list[Slab] = []
    for allocating, rows, width, pick in steps:
        if allocating or not held:
            slab = pool.allocate(rows, width)
            if slab is None:  # no free span's aligned part holds one object
                assert all(size // ALIGNMENT * ALIGNMENT < width for _, size in pool._free)
            else:
                assert 1 <= slab.rows <= rows
                assert slab.size % ALIGNMENT == 0
                assert slab.rows * width <= slab.size < slab.rows * width + ALIGNMENT
                held.append(slab)
        else:
            pool.free(held.pop(pick % len(held)))
        spans = sorted([*pool._free, *((slab.start, slab.size) for slab in held)])
        assert all(size > 0 for _, size in spans)
        assert all(a + size <= b for (a, size), (b, _) in itertools.pairwise(spans))
        assert spans[-1][0] + spans[-1][1] <= capacity
        assert pool.in_use == sum(slab.size for slab in held)
    for slab in held:
        pool.free(slab)
    assert pool._free == [(0, capacity)]
    pool.close()


def test_a_load_that_cannot_queue_a_part_frees_no_slab_before_the_parts_queued() -> None:
    """A get thread that stops taking work (interpreter shutdown: `submit` raises) must
    not leave a queued part writing a slab that the failing load freed for reuse."""
    source, target = Caches(NUM_BLOCKS, seed=9), Caches(NUM_BLOCKS)
    source.fill()
    moved = transfers({1: list(range(6))}, prefix=unique_prefix())
    options = PipelineOptions(granularity="staged", max_transfer_blocks=2)
    slabs_held: list[int] = []

    class SlowStore(MemoryStore):
        def batch_get_whole(self, *args: Any) -> list[Status]:
            time.sleep(0.2)  # the failing load has long unwound by now, if it did not wait
            slabs_held.append(engine.staging.in_use)
            return super().batch_get_whole(*args)

    store = SlowStore()
    with TransferEngine(store, source.layouts, options) as writer:
        assert save(writer, moved, "whole").ok
    with TransferEngine(store, target.layouts, options) as engine:
        gets = engine.staging.gets
        submitted = 0

        def submit(*args: Any) -> Any:
            nonlocal submitted
            submitted += 1
            if submitted == 2:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            return gets.submit(*args)

        engine.staging.gets = SimpleNamespace(submit=submit, shutdown=gets.shutdown)  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="cannot schedule"):
            engine.load(moved).wait(10)
        assert slabs_held, "the load returned before the part it had queued ran"
        assert all(held > 0 for held in slabs_held)
        assert engine.staging.in_use == 0  # freed once the queued part was done
