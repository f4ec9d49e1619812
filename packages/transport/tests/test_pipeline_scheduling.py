"""Backlog bound, prefetch depth, batch splitting, draining on error and on close."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from _engine_drive import unique_prefix
from _engine_stores import GateEvent, RecordingStore
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.transport.batches import GroupBatch
from hybridkv.transport.device_events import CpuEvent
from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.layerwise_staged_reads import LayerClaims
from hybridkv.transport.layout import CacheEntry, GroupLayout
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.ownership import BlockTransfer, Claim, Direction
from hybridkv.transport.pipeline import Granularity, PipelineOptions, PoolPressure
from hybridkv.transport.writes import Writes

LAYERS = 12
BLOCK = 256


@pytest.fixture
def memory() -> np.ndarray:
    return np.arange(LAYERS * 16 * BLOCK, dtype=np.uint32).astype(np.uint8).reshape(LAYERS, 16, -1)


def deep_layout(memory: np.ndarray) -> GroupLayout:
    """One group over 12 layers, one cache per layer."""
    return GroupLayout(
        0,
        [
            CacheEntry(layer, "kv", memory[layer].ctypes.data, BLOCK, BLOCK, num_blocks=16)
            for layer in range(LAYERS)
        ],
    )


def block_major_layout(memory: np.ndarray) -> GroupLayout:
    """The same group over [block][layer] memory: each object is one run of it."""
    stride = LAYERS * BLOCK
    return GroupLayout(
        0,
        [
            CacheEntry(layer, "kv", memory[0, layer].ctypes.data, BLOCK, stride, num_blocks=16)
            for layer in range(LAYERS)
        ],
    )


def saves(count: int, prefix: str) -> list[BlockTransfer]:
    return [BlockTransfer(f"{prefix}-{i}", 0, i, prefix, i) for i in range(count)]


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="backlog must be >= 0"):
        PipelineOptions(backlog=-1)
    with pytest.raises(ValueError, match="staging_bytes must be >= 0"):
        PipelineOptions(staging_bytes=-1)
    with pytest.raises(ValueError, match=r"max_transfer_bytes must be >= 0 \(0: no limit\)"):
        PipelineOptions(max_transfer_bytes=-1)
    with pytest.raises(ValueError, match="granularity"):
        PipelineOptions(granularity="block")  # type: ignore[arg-type]
    assert PipelineOptions() == PipelineOptions(
        backlog=8, prefetch_layers=2, max_transfer_blocks=0, max_transfer_bytes=0,
        granularity="staged", staging_bytes=256 << 20, full_pool_pause_s=1.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"full_pool_pause_s must be >= 0 \(0: never pause\)"):
        PipelineOptions(full_pool_pause_s=-0.5)
    with pytest.raises(ValueError, match="full_pool_pause_s must be >= 0"):
        PipelineOptions(full_pool_pause_s=math.nan)
    with pytest.raises(ValueError, match="full_pool_pause_s must be finite"):
        PipelineOptions(full_pool_pause_s=math.inf)
    with pytest.raises(ValueError, match="max_transfer_pieces must be >= 0"):
        PipelineOptions(max_transfer_pieces=-1)


@given(
    st.lists(st.tuples(st.integers(1, 100), st.integers(1, 8)), max_size=40),
    st.integers(0, 5),
    st.integers(0, 300),
    st.integers(0, 12),
)
def test_split_covers_the_batch_in_order_within_limits(
    items: list[tuple[int, int]], max_blocks: int, max_bytes: int, max_pieces: int
) -> None:
    options = PipelineOptions(
        max_transfer_blocks=max_blocks,
        max_transfer_bytes=max_bytes,
        max_transfer_pieces=max_pieces,
    )
    sizes = [size for size, _ in items]
    pieces = [count for _, count in items]
    parts = options.split(sizes, pieces)
    assert [i for part in parts for i in range(len(sizes))[part]] == list(range(len(sizes)))
    for part in parts:
        assert sizes[part]
        if len(sizes[part]) > 1:  # a single item over a limit still goes alone
            assert not max_blocks or len(sizes[part]) <= max_blocks
            assert not max_bytes or sum(sizes[part]) <= max_bytes
            assert not max_pieces or sum(pieces[part]) <= max_pieces
        if part.stop < len(sizes):  # and a slice only ends where the next item would not fit
            grown = slice(part.start, part.stop + 1)
            assert (
                (max_blocks and len(sizes[grown]) > max_blocks)
                or (max_bytes and sum(sizes[grown]) > max_bytes)
                or (max_pieces and sum(pieces[grown]) > max_pieces)
            )


def test_backlog_never_exceeds_its_bound(memory: np.ndarray) -> None:
    store = RecordingStore(put_delay_s=0.01)
    options = PipelineOptions(backlog=3)
    with TransferEngine(store, [deep_layout(memory)], options) as engine:
        step = engine.begin_layerwise(saves=saves(4, unique_prefix()))
        for layer in range(LAYERS):
            step.save_layer(layer, CpuEvent())
            assert engine.backlog.outstanding <= 3
            step.checkpoint()
        assert step.finish().ok
        assert engine.backlog.peak == 3  # reached, never passed
        assert engine.backlog.outstanding == 0


@pytest.mark.parametrize("granularity", ["staged", "layer"])
def test_backlog_zero_leaves_no_save_outstanding_at_a_checkpoint(
    memory: np.ndarray, granularity: Granularity
) -> None:
    store = RecordingStore(put_delay_s=0.01)
    options = PipelineOptions(backlog=0, granularity=granularity)
    with TransferEngine(store, [deep_layout(memory)], options) as engine:
        step = engine.begin_layerwise(saves=saves(4, unique_prefix()))
        for layer in range(LAYERS):
            step.save_layer(layer, CpuEvent())
            step.checkpoint()
            assert engine.backlog.outstanding == 0
        assert step.finish().ok
        assert engine.backlog.peak == 1  # one save at a time, drained at each checkpoint


def test_a_save_never_reads_a_layer_before_its_event(memory: np.ndarray) -> None:
    store = RecordingStore()
    prefix = unique_prefix()
    with TransferEngine(store, [deep_layout(memory)]) as engine:
        step = engine.begin_layerwise(saves=saves(2, prefix))
        gate = GateEvent()
        step.save_layer(0, gate)
        assert gate.waited.wait(timeout=10)
        memory[0, :2] = 7  # the "kernel" finishes writing layer 0 only now
        gate.fire()
        for layer in range(1, LAYERS):
            step.save_layer(layer, CpuEvent())
        assert step.finish().ok
    flat = np.zeros(BLOCK * LAYERS, dtype=np.uint8)
    [status] = store.batch_get_whole([f"{prefix}-1"], [[flat.ctypes.data]], [[flat.size]])
    assert status.ok
    assert (flat[:BLOCK] == 7).all()


# (granularity, block-major caches): objects that move whole, once their group completes
ONE_PIECE_SAVES = [("group", False), ("group", True), ("staged", True)]


@pytest.mark.parametrize(("granularity", "block_major"), ONE_PIECE_SAVES)
def test_a_group_put_whole_waits_for_every_layer_event(
    memory: np.ndarray, granularity: Granularity, block_major: bool
) -> None:
    """Layers that move no bytes before their group completes are not handed to the send
    thread one by one; the put still waits for each of their events."""
    caches = memory.transpose(1, 0, 2).copy() if block_major else memory
    layout = block_major_layout(caches) if block_major else deep_layout(caches)
    assert layout.contiguous == block_major
    layer_zero = caches[:2, 0] if block_major else caches[0, :2]
    store = RecordingStore()
    prefix = unique_prefix()
    with TransferEngine(store, [layout], PipelineOptions(granularity=granularity)) as engine:
        step = engine.begin_layerwise(saves=saves(2, prefix))
        gate = GateEvent()
        step.save_layer(0, gate)
        for layer in range(1, LAYERS):
            step.save_layer(layer, CpuEvent())
        assert gate.waited.wait(timeout=10)
        layer_zero[:] = 7  # the "kernel" finishes writing layer 0 only now
        gate.fire()
        assert step.finish().ok
    flat = np.zeros(BLOCK * LAYERS, dtype=np.uint8)
    [status] = store.batch_get_whole([f"{prefix}-1"], [[flat.ctypes.data]], [[flat.size]])
    assert status.ok
    assert (flat[:BLOCK] == 7).all()


@pytest.mark.parametrize(
    ("granularity", "block_major", "handed_layers"),
    [
        *((granularity, block_major, [5, 11]) for granularity, block_major in ONE_PIECE_SAVES),
        ("staged", False, list(range(LAYERS))),  # each layer is copied into staging
        ("layer", False, list(range(LAYERS))),  # each layer's ranges are put
        ("layer", True, list(range(LAYERS))),
    ],
)
def test_the_send_thread_gets_a_layer_only_to_move_bytes_or_complete_a_group(
    memory: np.ndarray, granularity: Granularity, block_major: bool, handed_layers: list[int]
) -> None:
    """Two groups, on layers 0-5 and 0-11: where nothing is copied or ranged before a
    group completes, the send thread is woken at layers 5 and 11 only."""
    caches = memory.transpose(1, 0, 2).copy() if block_major else memory
    full = block_major_layout(caches) if block_major else deep_layout(caches)
    short = GroupLayout(1, [entry for entry in full.entries if entry.layer <= 5])
    prefix = unique_prefix()
    transfers = [
        *saves(2, prefix),
        *(BlockTransfer(f"{prefix}-s{i}", 1, i, prefix, i) for i in range(2)),
    ]
    store = RecordingStore()
    with TransferEngine(store, [full, short], PipelineOptions(granularity=granularity)) as engine:
        step = engine.begin_layerwise(saves=transfers)
        handed = []
        for layer in range(LAYERS):
            before = len(step._jobs)
            step.save_layer(layer, CpuEvent())
            if len(step._jobs) > before:
                handed.append(layer)
        result = step.finish()
    assert result.ok
    assert handed == handed_layers
    assert store.batch_is_readable([t.key for t in transfers]) == [True] * 4


def test_loads_prefetch_only_the_configured_layers_ahead(memory: np.ndarray) -> None:
    store = RecordingStore()
    prefix = unique_prefix()
    layout = deep_layout(memory)
    with TransferEngine(store, [layout]) as engine:
        engine.save(saves(3, prefix)).wait(timeout=10)
        options = PipelineOptions(prefetch_layers=2, granularity="layer")
        with TransferEngine(store, [layout], options) as reader:
            step = reader.begin_layerwise(loads=saves(3, prefix))
            until(lambda: store.count("get_ranges") >= 3)
            time.sleep(0.1)
            assert store.count("get_ranges") == 3  # layer 0 plus 2 ahead, no more
            step.wait_layer_loaded(4)
            time.sleep(0.1)
            assert store.count("get_ranges") == 7  # up to layer 4 + 2
            assert step.finish().ok
            assert store.count("get_ranges") == LAYERS
    offsets = [row[0] for row in store.read_offsets]
    assert offsets == [layer * BLOCK for layer in range(LAYERS)]  # in layer order


def two_group_layouts(array: np.ndarray) -> list[GroupLayout]:
    """Group 0 over every layer (rows 0-7), group 1 over layers 0-5 only (rows 8-15)."""
    short = [
        CacheEntry(layer, "short", array[layer, 8:].ctypes.data, BLOCK, BLOCK, num_blocks=8)
        for layer in range(6)
    ]
    return [deep_layout(array), GroupLayout(1, short)]


def before_copies(
    monkeypatch: pytest.MonkeyPatch, hook: Callable[[GroupBatch, Sequence[int] | None], None]
) -> None:
    """Run `hook(batch, entries)` before every copy between caches and staging."""
    copy_rows = GroupBatch.copy_rows

    def hooked(
        batch: GroupBatch,
        rows: np.ndarray,
        into_staging: bool,
        entries: Sequence[int] | None = None,
    ) -> None:
        hook(batch, entries)
        copy_rows(batch, rows, into_staging, entries)

    monkeypatch.setattr(GroupBatch, "copy_rows", hooked)


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_staged_loads_scatter_the_due_layer_here_and_the_rest_from_the_last_down(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the fetch is in, the layer read scatters the layer due now, and a second
    thread scatters the others from the last layer down until the two meet; a group's
    slab is freed once all of its layers are scattered, whoever scattered them."""
    copies: list[tuple[str, int, int]] = []  # (thread, group, layer)

    def record(batch: GroupBatch, entries: Sequence[int] | None) -> None:
        for index in entries or ():
            layer = batch.layout.entries[index].layer
            copies.append((threading.current_thread().name, batch.layout.group_id, layer))

    target = np.zeros_like(memory)
    prefix = unique_prefix()
    moved = [
        *saves(4, prefix),
        *(BlockTransfer(f"{prefix}-s{i}", 1, i, prefix, i) for i in range(3)),
    ]
    store = RecordingStore()
    with TransferEngine(store, two_group_layouts(memory)) as writer:
        assert writer.save(moved).wait(timeout=10).ok
    options = PipelineOptions(prefetch_layers=0)  # no read of a later layer is queued
    with TransferEngine(store, two_group_layouts(target), options) as reader:
        pool = reader.staging
        assert pool is not None
        before_copies(monkeypatch, record)
        step = reader.begin_layerwise(loads=moved)
        assert step.wait_layer_loaded(0) == {}
        assert store.count("batch_get_whole") == 1  # every object, fetched at once
        assert until(lambda: pool.in_use == 0)  # every layer scattered, every slab freed
        np.testing.assert_array_equal(target[:, :4], memory[:, :4])
        np.testing.assert_array_equal(target[:6, 8:11], memory[:6, 8:11])
        assert step.finish().ok
        assert pool.in_use == 0
    assert not target[:, 4:8].any()
    assert not target[:, 11:].any()
    assert not target[6:, 8:].any()
    here = [(group, layer) for thread, group, layer in copies if thread == "hybridkv-receive"]
    there = [(group, layer) for thread, group, layer in copies if thread != "hybridkv-receive"]
    assert here == [(0, 0), (1, 0)]
    assert there == [(0, 11), (0, 10), (0, 9), (0, 8), (0, 7), (0, 6)] + [
        (group, layer) for layer in range(5, 0, -1) for group in (0, 1)
    ]


class HeldScatters:
    """Holds the second scatter thread at each copy: it says it entered and waits for
    `release`; then it copies (or raises `error`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: BaseException | None = None):
        self.entered = threading.Event()
        self.release = threading.Event()

        def hold(batch: GroupBatch, entries: Sequence[int] | None) -> None:
            if threading.current_thread().name.startswith("hybridkv-scatter"):
                self.entered.set()
                assert self.release.wait(10)
                if error is not None:
                    raise error

        before_copies(monkeypatch, hold)


def test_a_failed_second_scatter_thread_fails_the_load_and_frees_every_slab(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer read waiting on the second thread's layer wakes when that thread fails."""
    target = np.zeros_like(memory)
    moved = saves(4, unique_prefix())
    store = RecordingStore()
    with TransferEngine(store, [deep_layout(memory)]) as writer:
        assert writer.save(moved).wait(timeout=10).ok
    with TransferEngine(store, [deep_layout(target)], PipelineOptions(prefetch_layers=0)) as reader:
        held = HeldScatters(monkeypatch, MemoryError("no memory for the copy"))
        step = reader.begin_layerwise(loads=moved)
        assert step.wait_layer_loaded(0) == {}
        assert held.entered.wait(10)  # it claimed layer 11 and is copying it
        threading.Timer(0.2, held.release.set).start()  # fails while layer 11 is awaited
        with pytest.raises(RuntimeError, match="layer 11 was not scattered"):
            step.wait_layer_loaded(LAYERS - 1)
        assert step._load_outcome.failed_blocks() == {0: {0, 1, 2, 3}}
        with pytest.raises(RuntimeError, match="not scattered"):
            step.finish()
        assert reader.staging is not None
        assert reader.staging.in_use == 0
    np.testing.assert_array_equal(target[: LAYERS - 1, :4], memory[: LAYERS - 1, :4])
    assert not target[LAYERS - 1].any()


def test_a_groups_slab_is_freed_once_all_of_its_layers_are_scattered(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = unique_prefix()
    moved = [
        *saves(4, prefix),
        *(BlockTransfer(f"{prefix}-s{i}", 1, i, prefix, i) for i in range(3)),
    ]
    store = RecordingStore()
    with TransferEngine(store, two_group_layouts(memory)) as writer:
        assert writer.save(moved).wait(timeout=10).ok
    target = np.zeros_like(memory)
    options = PipelineOptions(prefetch_layers=0)
    with TransferEngine(store, two_group_layouts(target), options) as reader:
        pool = reader.staging
        assert pool is not None
        held = HeldScatters(monkeypatch)
        step = reader.begin_layerwise(loads=moved)
        assert step.wait_layer_loaded(0) == {}
        both = pool.in_use
        assert held.entered.wait(10)  # holding layer 11 of the long group
        assert step.wait_layer_loaded(5) == {}  # the short group's last layer, read here
        assert 0 < pool.in_use < both  # its slab is free, the long group's is not
        held.release.set()
        assert step.finish().ok
        assert pool.in_use == 0
    np.testing.assert_array_equal(target[:, :4], memory[:, :4])
    np.testing.assert_array_equal(target[:6, 8:11], memory[:6, 8:11])


def test_a_step_ends_without_waiting_for_a_second_thread_that_never_started(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool has one scatter thread: a step whose own is queued behind another step's
    (held here) reads every layer itself and ends without waiting for it."""
    first, second = unique_prefix(), unique_prefix()
    store = RecordingStore()
    with TransferEngine(store, [deep_layout(memory)]) as writer:
        assert writer.save([*saves(4, first), *saves(4, second)]).wait(timeout=10).ok
    targets = np.zeros_like(memory), np.zeros_like(memory)
    options = PipelineOptions(prefetch_layers=0)
    layouts = [deep_layout(targets[0]), GroupLayout(1, deep_layout(targets[1]).entries)]
    with TransferEngine(store, layouts, options) as reader:
        held = HeldScatters(monkeypatch)
        early = reader.begin_layerwise(loads=saves(4, first))
        assert early.wait_layer_loaded(0) == {}
        assert held.entered.wait(10)
        late = reader.begin_layerwise(
            loads=[
                BlockTransfer(t.key, 1, t.local_block, t.request_id, t.block_index)
                for t in saves(4, second)
            ]
        )
        ended = threading.Thread(target=late.finish)
        ended.start()
        ended.join(5)
        assert not ended.is_alive()
        held.release.set()
        assert early.finish().ok
        assert late.finish().ok
        assert reader.staging is not None
        assert reader.staging.in_use == 0
    for target in targets:
        np.testing.assert_array_equal(target[:, :4], memory[:, :4])


def test_with_no_second_thread_to_be_had_the_reads_scatter_every_layer(
    memory: np.ndarray,
) -> None:
    """As at interpreter exit, when the pool's scatter thread can no longer start."""
    moved = saves(4, unique_prefix())
    store = RecordingStore()
    with TransferEngine(store, [deep_layout(memory)]) as writer:
        assert writer.save(moved).wait(timeout=10).ok
    target = np.zeros_like(memory)
    with TransferEngine(store, [deep_layout(target)]) as reader:
        assert reader.staging is not None
        reader.staging.scatters.shutdown()
        step = reader.begin_layerwise(loads=moved)
        for layer in range(LAYERS):
            assert step.wait_layer_loaded(layer) == {}
        assert step.finish().ok
        assert reader.staging.in_use == 0
    np.testing.assert_array_equal(target[:, :4], memory[:, :4])


@given(
    st.integers(1, 12).flatmap(
        lambda count: st.tuples(
            st.just(count),
            st.lists(st.sets(st.integers(0, count - 1), min_size=1), min_size=1, max_size=4),
            st.lists(st.booleans(), min_size=2 * count, max_size=2 * count),
        )
    )
)
def test_layer_claims_give_each_layer_to_one_thread_and_complete_each_group_once(
    case: tuple[int, list[set[int]], list[bool]],
) -> None:
    """Any interleaving of the in-order reads and the second thread: the reads take a
    prefix of the layers, the second thread the rest from the last down, and a group
    completes exactly when its last layer is scattered."""
    count, groups, turns = case
    layers = [10 * index for index in range(count)]  # layer numbers need not be indices
    claims = LayerClaims(
        layers, {g: [layers[i] for i in members] for g, members in enumerate(groups)}
    )
    front: list[int] = []
    back: list[int] = []
    completed: list[int] = []
    scattered: set[int] = set()
    reading = 0
    for turn in turns:
        if turn and reading < count:
            layer = layers[reading]
            reading += 1
            if claims.claim_front(layer):
                front.append(layer)
            else:
                claims.wait(layer)  # already scattered by the other thread
                assert layer in scattered
                continue
        elif (layer := claims.claim_back()) is not None:
            back.append(layer)
        else:
            continue
        done = claims.scattered(layer)
        scattered.add(layer)
        completed += done
        for group in done:
            assert {layers[i] for i in groups[group]} <= scattered
    while (layer := claims.claim_back()) is not None:
        back.append(layer)
        scattered.add(layer)
        completed += claims.scattered(layer)
    assert front == layers[: len(front)]
    assert back == layers[len(front) :][::-1]
    assert sorted(completed) == list(range(len(groups)))


def test_large_batches_are_split_by_blocks_and_bytes(memory: np.ndarray) -> None:
    store = RecordingStore()
    options = PipelineOptions(
        max_transfer_blocks=4, max_transfer_bytes=3 * BLOCK, granularity="layer"
    )
    with TransferEngine(store, [deep_layout(memory)], options) as engine:
        step = engine.begin_layerwise(saves=saves(10, unique_prefix()))
        for layer in range(LAYERS):
            step.save_layer(layer, CpuEvent())
        assert step.finish().ok
    sizes = [count for name, count in store.calls if name == "put_ranges"]
    assert sizes == [3, 3, 3, 1] * LAYERS


def test_close_drains_every_queued_transfer_and_stops_its_threads(memory: np.ndarray) -> None:
    store = RecordingStore(put_delay_s=0.005)
    prefix = unique_prefix()
    engine = TransferEngine(store, [deep_layout(memory)], PipelineOptions(granularity="layer"))
    tickets = [engine.save(saves(16, f"{prefix}-{i}")) for i in range(5)]
    step = engine.begin_layerwise(saves=saves(16, f"{prefix}-step"))
    for layer in range(LAYERS - 1):  # the last layer never comes: the step is revoked
        step.save_layer(layer, CpuEvent())
    engine.close()
    assert all(ticket.done for ticket in tickets)
    assert all(ticket.wait().ok for ticket in tickets)
    assert store.open_put_sessions() == set()
    assert engine.outstanding("save") == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("hybridkv-")]
    with pytest.raises(RuntimeError, match="closed"):
        engine.save(saves(1, prefix))


@pytest.mark.parametrize("direction", ["save", "load"])
def test_a_transfer_racing_close_is_queued_before_the_threads_stop(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch, direction: Direction
) -> None:
    """A `close()` between a transfer's checks and its queueing would stop the threads
    after its keys were claimed and its count begun: nothing would settle or end them."""
    engine = TransferEngine(MemoryStore(), [deep_layout(memory)], PipelineOptions())
    check = engine._check
    closer = threading.Thread(target=engine.close)

    def check_then_close(transfers: Sequence[BlockTransfer]) -> None:
        check(transfers)
        closer.start()
        closer.join(timeout=0.5)  # closes at once unless the transfer holds the engine lock

    monkeypatch.setattr(engine, "_check", check_then_close)
    transfer = engine.save if direction == "save" else engine.load
    ticket = transfer(saves(2, unique_prefix()))
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert ticket.done
    assert engine.outstanding(direction) == 0


def test_a_concurrent_close_returns_only_once_the_first_has_drained(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever thread's `close()` returns, its caller may free the caches at once."""
    engine = TransferEngine(MemoryStore(), [deep_layout(memory)], PipelineOptions())
    gate = GateEvent()
    ticket = engine.save(saves(1, unique_prefix()), ready=gate)
    draining = threading.Event()
    close_sender = engine._sender.close

    def signal_then_close_sender() -> None:
        draining.set()
        close_sender()

    monkeypatch.setattr(engine._sender, "close", signal_then_close_sender)
    saved_when_second_returned: list[bool] = []

    def close_again() -> None:
        engine.close()
        saved_when_second_returned.append(ticket.done)

    first = threading.Thread(target=engine.close)
    second = threading.Thread(target=close_again)
    first.start()
    assert draining.wait(timeout=10)
    second.start()
    second.join(timeout=0.5)  # returns at once unless it waits for the first close
    gate.fire()
    first.join(timeout=10)
    second.join(timeout=10)
    assert not first.is_alive()
    assert not second.is_alive()
    assert saved_when_second_returned == [True]


def record_settles(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first written key of each save, in the order its writes settle."""
    settled: list[str] = []
    settle = engine._settle

    def recording(claim: Claim, writes: Writes) -> None:
        settled.append(claim.write[0].key)
        settle(claim, writes)

    monkeypatch.setattr(engine, "_settle", recording)
    return settled


def test_close_finishes_open_steps_in_the_order_they_began(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's saves may ride on an earlier step's writes: that one must end first."""
    engine = TransferEngine(MemoryStore(), [deep_layout(memory)], PipelineOptions())
    settled = record_settles(engine, monkeypatch)
    keys = [f"step-{i}" for i in range(16)]
    for i, key in enumerate(keys):
        engine.begin_layerwise(saves=[BlockTransfer(key, 0, i, key, 0)])
    engine.close()
    assert settled == keys


def test_concurrent_finishes_of_a_step_settle_it_once_and_share_its_result(
    memory: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close()` while the model thread is inside `finish()`: one set of end jobs."""
    engine = TransferEngine(
        MemoryStore(), [deep_layout(memory)], PipelineOptions(granularity="layer")
    )
    settled = record_settles(engine, monkeypatch)
    step = engine.begin_layerwise(saves=saves(1, unique_prefix()))
    gate = GateEvent()
    step.save_layer(0, gate)
    results: list[object] = []
    finisher = threading.Thread(target=lambda: results.append(step.finish()))
    closer = threading.Thread(target=engine.close)
    finisher.start()
    time.sleep(0.2)  # both wait for the gated layer
    closer.start()
    time.sleep(0.2)
    gate.fire()
    finisher.join(timeout=10)
    closer.join(timeout=10)
    assert not finisher.is_alive()
    assert not closer.is_alive()
    assert len(settled) == 1
    assert engine.outstanding("save") == 0
    assert step.finish() is results[0]


@pytest.mark.parametrize("block_major", [False, True], ids=["per-layer", "block-major"])
@pytest.mark.parametrize("granularity", ["staged", "layer", "group"])
def test_a_load_never_writes_the_caches_before_its_ready_event(
    memory: np.ndarray, granularity: Granularity, block_major: bool
) -> None:
    """`ready` stands for earlier device work on the blocks (vLLM zeroing them): a staged
    load may fetch into staging before it, but nothing lands in the caches until it fired.
    Block-major caches (each object one run of memory) are fetched straight into them."""
    target = np.zeros((16, LAYERS * BLOCK) if block_major else memory.shape, dtype=np.uint8)
    if block_major:
        entries = [
            CacheEntry(layer, "kv", target[:, layer * BLOCK :].ctypes.data, BLOCK, LAYERS * BLOCK)
            for layer in range(LAYERS)
        ]
        layout = GroupLayout(0, entries)
        assert layout.contiguous
    else:
        layout = deep_layout(target)
    store = RecordingStore()
    prefix = unique_prefix()
    with TransferEngine(store, [deep_layout(memory)]) as engine:
        assert engine.save(saves(3, prefix)).wait(timeout=10).ok
    with TransferEngine(store, [layout], PipelineOptions(granularity=granularity)) as reader:
        gate = GateEvent()
        step = reader.begin_layerwise(loads=saves(3, prefix), ready=gate)
        try:
            assert gate.waited.wait(timeout=10)
            time.sleep(0.1)
            assert not target.any()
        finally:
            gate.fire()
        for layer in range(LAYERS):
            step.wait_layer_loaded(layer)
        assert step.finish().ok
    for layer in range(LAYERS):
        loaded = (
            target[:3, layer * BLOCK : (layer + 1) * BLOCK] if block_major else target[layer, :3]
        )
        assert np.array_equal(loaded, memory[layer, :3])


def test_only_a_save_that_moved_bytes_ends_a_full_pool_pause() -> None:
    pressure = PoolPressure(pause_s=60)
    pressure.settled(no_space=True, took=True)  # some keys fit, one was refused
    assert pressure.paused()
    pressure.settled(no_space=False, took=False)  # moved nothing: every key already stored
    assert pressure.paused()
    pressure.settled(no_space=False, took=True)
    assert not pressure.paused()
    never = PoolPressure(pause_s=0)
    never.settled(no_space=True, took=False)
    assert not never.paused()  # a zero pause never pauses
