"""Byte-exact round trips of the example layout, every write mode x every read mode.

Runs against the in-memory store and a real Mooncake master (the `store` fixture), and
checks the object itself as stored, so whole and ranged writes are proven to agree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from _engine_drive import MODES, LayerCheck, engine_for, load, read_object, save, unique_prefix
from _engine_model import ALL_GROUPS, NUM_LAYERS, Caches, transfers

from hybridkv.transport import mooncake_store, store_calls
from hybridkv.transport.device_events import CpuEvent
from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.layerwise_step import LayerwiseStep
from hybridkv.transport.layout import CacheEntry, GroupLayout
from hybridkv.transport.master import MasterProcess
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.ownership import BlockTransfer
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.store import Store
from hybridkv.transport.testing import mooncake_config

WRITER_BLOCKS = {0: [1, 4, 6], 1: [0, 2], 2: [7, 3, 5, 2]}
READER_BLOCKS = {0: [5, 0, 2], 1: [6, 1], 2: [0, 4, 1, 7]}


@pytest.fixture
def reader_store(store: Store, request: pytest.FixtureRequest) -> Iterator[Store]:
    """For Mooncake, a second client (another instance reading over TCP)."""
    if not isinstance(store, MooncakeStore):
        yield store
        return
    master: MasterProcess = request.getfixturevalue("mooncake_master")
    second = MooncakeStore.connect(mooncake_config(master.address))
    yield second
    second.close()


@pytest.mark.parametrize(("write_mode", "read_mode"), list(itertools.product(MODES, MODES)))
def test_round_trip_is_byte_exact_across_modes(
    store: Store, reader_store: Store, write_mode: str, read_mode: str
) -> None:
    round_trip(store, reader_store, write_mode, read_mode)


STAGED = ("whole", "staged")


@pytest.mark.parametrize(("write_mode", "read_mode"), list(itertools.product(STAGED, STAGED)))
def test_staging_smaller_than_the_batch_round_trips_in_waves(
    store: Store, reader_store: Store, write_mode: str, read_mode: str
) -> None:
    largest = max(layout.object_size for layout in Caches(num_blocks=8).layouts)
    round_trip(store, reader_store, write_mode, read_mode, staging_bytes=largest * 5 // 2)


@pytest.mark.parametrize(("write_mode", "read_mode"), list(itertools.product(STAGED, STAGED)))
def test_staged_calls_in_many_parts_round_trip(
    store: Store,
    reader_store: Store,
    write_mode: str,
    read_mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One part per key: each part of a staged call is copied while the next one moves."""
    monkeypatch.setattr(store_calls, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(store_calls, "OVERLAP_PARTS", 1000)
    round_trip(store, reader_store, write_mode, read_mode)


@pytest.mark.parametrize(
    ("write_mode", "read_mode", "source_major", "target_major"),
    [
        ("whole", "whole", ALL_GROUPS, ALL_GROUPS),
        ("staged", "staged", ALL_GROUPS, ()),
        ("staged", "staged", (), ALL_GROUPS),
        ("staged", "whole", (0, 2), (1,)),
        ("layer", "staged", (0, 2), ALL_GROUPS),
        ("group", "layer", ALL_GROUPS, (0, 2)),
    ],
)
def test_block_major_caches_round_trip_the_same_objects(
    store: Store,
    reader_store: Store,
    write_mode: str,
    read_mode: str,
    source_major: tuple[int, ...],
    target_major: tuple[int, ...],
) -> None:
    """Objects moved in place (one piece each) equal those gathered from per-layer tensors,
    whichever layout each side has."""
    round_trip(store, reader_store, write_mode, read_mode, source_major, target_major)


def round_trip(
    store: Store,
    reader_store: Store,
    write_mode: str,
    read_mode: str,
    source_major: tuple[int, ...] = (),
    target_major: tuple[int, ...] = (),
    **options: int,
) -> None:
    """Save WRITER_BLOCKS, check the stored objects, load them into READER_BLOCKS
    (`*_major`: the groups whose caches are block-major on that side)."""
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=1, block_major=source_major)
    target = Caches(num_blocks=8, seed=2, block_major=target_major)
    source.fill()
    saves = transfers(WRITER_BLOCKS, prefix=prefix)
    with engine_for(store, source, write_mode, **options) as writer:
        saved = save(writer, saves, write_mode)
    assert saved.ok
    assert not saved.failed_blocks
    assert not saved.skipped_keys
    assert saved.bytes == sum(
        len(WRITER_BLOCKS[layout.group_id]) * layout.object_size for layout in source.layouts
    )
    for transfer in saves:  # the object as stored: entries at their prefix-sum offsets
        size = source.layouts[transfer.group].object_size
        assert read_object(reader_store, transfer.key, size) == source.block_bytes(
            transfer.group, transfer.local_block
        )

    loads = transfers(READER_BLOCKS, request_id="reader", prefix=prefix)
    remap = {
        (group, WRITER_BLOCKS[group][index]): block
        for group, blocks in READER_BLOCKS.items()
        for index, block in enumerate(blocks)
    }
    with engine_for(reader_store, target, read_mode, **options) as reader:
        loaded = load(reader, loads, read_mode, LayerCheck(source, target, remap))
    assert loaded.ok
    assert loaded.bytes == saved.bytes
    for (group, source_block), target_block in remap.items():
        assert target.block_bytes(group, target_block) == source.block_bytes(group, source_block)
    untouched = set(range(8)) - set(READER_BLOCKS[0])
    assert all(target.block_bytes(0, block) == bytes(2048) for block in untouched)
    assert not any(padding.any() for padding in target.padding.values())  # no overrun


@pytest.mark.parametrize("mode", MODES)
def test_keys_already_in_the_pool_are_skipped_not_rewritten(store: Store, mode: str) -> None:
    prefix = unique_prefix()
    first, second = Caches(num_blocks=8, seed=3), Caches(num_blocks=8, seed=4)
    first.fill()
    second.fill()
    saves = transfers({0: [0, 1], 1: [2], 2: [3]}, prefix=prefix)
    with engine_for(store, first, mode) as engine:
        assert save(engine, saves, mode).ok
    with engine_for(store, second, mode) as engine:
        again = save(engine, transfers({0: [0, 1], 1: [2], 2: [3]}, "other", prefix), mode)
    assert sorted(again.skipped_keys) == sorted(t.key for t in saves)
    assert again.bytes == 0
    for transfer in saves:
        size = first.layouts[transfer.group].object_size
        assert read_object(store, transfer.key, size) == first.block_bytes(
            transfer.group, transfer.local_block
        )


@pytest.mark.parametrize("late_mode", MODES)
def test_two_instances_saving_one_prefix_at_once_store_each_object_once(
    two_clients: tuple[Store, Store], late_mode: str
) -> None:
    """Two instances computed the same prefix (same bytes) and save it at the same time:
    one holds its put sessions open across its layers ("layer"), the other saves all of
    it meanwhile, in each mode. The late one fails nothing and stores nothing. Layer by
    layer, its session starts say EXISTS and none of its keys is readable at its commit:
    all are contended (the first may still revoke: they are not the late one's to
    announce or keep as stored). Its whole puts are answered OK over the open sessions
    and count as stored (checking them would lease every object just written). The first
    commits every object; nothing stays open and every object reads back exactly."""
    first_store, second_store = two_clients
    blocks = {0: [0, 1], 1: [2], 2: [3, 4]}
    saves, late_saves, early, late = same_prefix_twice(blocks, seed=5)
    with engine_for(first_store, early, "layer", backlog=0) as first:
        step = saved_first_layer(first, saves)
        with engine_for(second_store, late, late_mode) as second:
            meanwhile = save(second, late_saves, late_mode)
        for layer in range(1, NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
            step.checkpoint()
        committed = step.finish()
    assert meanwhile.ok
    assert not meanwhile.skipped_keys
    if late_mode == "layer":  # its sessions could not start: nothing moved
        assert sorted(meanwhile.contended_keys) == sorted(t.key for t in saves)
        assert meanwhile.bytes == 0
    else:
        assert not meanwhile.contended_keys
    assert committed.ok
    assert not committed.skipped_keys
    assert_stored(second_store, saves, early)
    if isinstance(first_store, MemoryStore):
        assert not first_store.open_put_sessions()


@pytest.mark.parametrize("again_mode", ["layer", "whole"])
def test_keys_contended_with_a_writer_that_then_revoked_are_saved_by_the_next_save(
    two_clients: tuple[Store, Store], again_mode: str
) -> None:
    """The other instance gives up on the prefix (its step ends with layers unsaved, so
    its sessions are revoked): the late one, saving layer by layer, had kept nothing as
    stored, so the same request's next save, ranged or whole, writes every object (before,
    it took them as committed and never wrote them, and none was ever readable)."""
    first_store, second_store = two_clients
    blocks = {0: [0, 1], 1: [2], 2: [3, 4]}
    saves, late_saves, early, late = same_prefix_twice(blocks, seed=6)
    with engine_for(first_store, early, "layer", backlog=0) as first:
        step = saved_first_layer(first, saves)
        with engine_for(second_store, late, "layer") as second:
            meanwhile = save(second, late_saves, "layer")
            abandoned = step.finish()
            again = save(second, late_saves, again_mode)
            owned = second.owned_blocks("late")
    assert sorted(meanwhile.contended_keys) == sorted(t.key for t in saves)
    assert sorted(abandoned.failed_keys) == sorted(t.key for t in saves)
    assert again.ok
    assert not again.contended_keys
    assert not again.skipped_keys
    assert all(block.committed for block in owned.values())
    assert len(owned) == len(saves)
    assert_stored(second_store, saves, late)


def test_a_ranged_save_skips_what_the_writer_it_met_committed_before_its_own_commit(
    two_clients: tuple[Store, Store],
) -> None:
    """Both instances save layer by layer; the late one's session starts say EXISTS. The
    first commits before the late one's last layer: at its commit the late one finds the
    objects readable and counts them skipped, as if its existence query had seen them."""
    first_store, second_store = two_clients
    blocks = {0: [0, 1], 1: [2], 2: [3, 4]}
    saves, late_saves, early, late = same_prefix_twice(blocks, seed=7)
    with (
        engine_for(first_store, early, "layer", backlog=0) as first,
        engine_for(second_store, late, "layer", backlog=0) as second,
    ):
        step = saved_first_layer(first, saves)
        other = saved_first_layer(second, late_saves)  # its session starts ran
        for layer in range(1, NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
        committed = step.finish()
        for layer in range(1, NUM_LAYERS):
            other.save_layer(layer, CpuEvent())
        skipped = other.finish()
        owned = second.owned_blocks("late")
    assert committed.ok
    assert skipped.ok
    assert sorted(skipped.skipped_keys) == sorted(t.key for t in saves)
    assert not skipped.contended_keys
    assert skipped.bytes == 0
    assert all(block.committed for block in owned.values())
    assert_stored(second_store, saves, early)


def same_prefix_twice(
    blocks: dict[int, list[int]], seed: int
) -> tuple[list[BlockTransfer], list[BlockTransfer], Caches, Caches]:
    """Saves of one prefix by two instances (requests "req" and "late"), and their caches
    holding the same bytes."""
    prefix = unique_prefix()
    early, late = Caches(num_blocks=8, seed=seed), Caches(num_blocks=8, seed=seed)
    early.fill()
    late.fill()
    return transfers(blocks, prefix=prefix), transfers(blocks, "late", prefix), early, late


def saved_first_layer(engine: TransferEngine, saves: list[BlockTransfer]) -> LayerwiseStep:
    """A layerwise step of `saves` past its first layer: its put sessions are open (with
    backlog=0 the checkpoint returns once that layer went out)."""
    step = engine.begin_layerwise(saves=saves)
    step.save_layer(0, CpuEvent())
    step.checkpoint()
    return step


def assert_stored(store: Store, saves: list[BlockTransfer], caches: Caches) -> None:
    assert store.batch_is_readable([t.key for t in saves]) == [True] * len(saves)
    for transfer in saves:
        size = caches.layouts[transfer.group].object_size
        assert read_object(store, transfer.key, size) == caches.block_bytes(
            transfer.group, transfer.local_block
        )


@pytest.mark.parametrize(
    "options",
    [
        PipelineOptions(granularity="group"),  # the engine splits at 1024 pieces
        PipelineOptions(granularity="group", max_transfer_pieces=0),  # MooncakeStore splits
        PipelineOptions(),  # staged: one piece per key
    ],
    ids=["engine-split", "store-split", "staged"],
)
def test_many_layer_whole_objects_fit_mooncakes_per_call_piece_limit(
    mooncake_master: MasterProcess, segment_holder: object, options: PipelineOptions
) -> None:
    """64 layers x 48 blocks = 3072 pieces: one Mooncake call fails keys past ~2000."""
    layers, blocks, nbytes = 64, 48, 256
    memory = np.random.default_rng(20).integers(0, 256, (layers, blocks, nbytes), np.uint8)
    target = np.zeros_like(memory)
    layouts = {
        name: [
            GroupLayout(
                0,
                [
                    CacheEntry(layer, "kv", array[layer].ctypes.data, nbytes, nbytes)
                    for layer in range(layers)
                ],
            )
        ]
        for name, array in (("source", memory), ("target", target))
    }
    prefix = unique_prefix()
    saves = [BlockTransfer(f"{prefix}-{b}", 0, b, "r", b) for b in range(blocks)]
    # Lend nothing: objects go to the holder, over TCP, as in a deployment.
    writer_store = MooncakeStore.connect(
        mooncake_config(mooncake_master.address, global_segment_size=0)
    )
    try:
        with TransferEngine(writer_store, layouts["source"], options) as engine:
            assert engine.save(saves).wait(timeout=60).ok
        with TransferEngine(writer_store, layouts["target"], options) as engine:
            assert engine.load(saves).wait(timeout=60).ok
    finally:
        writer_store.close()
    assert np.array_equal(target, memory)


def test_two_engines_over_one_cache_share_its_registration(
    mooncake_master: MasterProcess,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both register the caches without a refusal; closing both frees the memory again
    (over RDMA: TCP registers nothing, so TCP stands in for it here)."""
    monkeypatch.setattr(mooncake_store, "UNREGISTERED_PROTOCOLS", frozenset())
    caches = Caches(num_blocks=8, seed=5)
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    try:
        with caplog.at_level("WARNING", logger="hybridkv.transport"):
            first = TransferEngine(store, caches.layouts, PipelineOptions(granularity="layer"))
            second = TransferEngine(store, caches.layouts, PipelineOptions(granularity="layer"))
            first.close()
            second.close()
        assert not [record for record in caplog.records if "register" in record.message]
        array = caches.arrays[(0, 0, "k")]
        store.register_buffer(array.ctypes.data, array.nbytes)  # refused if still registered
        store.unregister_buffer(array.ctypes.data)
    finally:
        store.close()
