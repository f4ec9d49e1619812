"""Partial reads: a reader block filled from parts of several writer objects (keys).

The writer objects are another topology's (TP shards, pipeline stages), serialised from one
reference of the whole model; `hybridkv.keys.plan_reads` says which of their bytes the
reader wants, turned into partial layouts as the integration does. Every read mode must
land exactly those bytes, write nothing else (guard bytes around and between the pieces),
and fail a block if any of its keys fails. Runs on the in-memory store and a real Mooncake
master (the `store` fixture).
"""

from __future__ import annotations

import itertools
import uuid
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.keys import Entry, GroupReads, ObjectMap, Span, plan_reads
from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.integrity import IntegrityKey, TaggedStore
from hybridkv.transport.layout import CacheEntry, GroupLayout
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.outcome import TransferResult
from hybridkv.transport.ownership import BlockTransfer
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.store import Store

GUARD = 0xA5
UNIT = 16  # bytes per head per block
HEADS = 4
STATE = 40
NUM_BLOCKS = 6
READER_BLOCKS = [4, 1, 3]  # local block of each logical block the test loads
GROUP = 0
FIRST_PARTIAL_ID = 100
# (how: engine.load or a layerwise step, granularity)
MODES = [(how, g) for how in ("load", "step") for g in ("staged", "layer", "group")]


def heads(layer: str, cache: str, start: int, count: int) -> Entry:
    return Entry(layer, cache, count * UNIT, Span(start, count, UNIT))


def state(layer: str) -> Entry:
    return Entry(layer, "state", STATE)


def extra(layer: str) -> Entry:
    """A cache the reader does not hold (another group's layer): bytes it must not write."""
    return Entry(layer, "extra", 24)


@dataclass(frozen=True)
class Scenario:
    writer: tuple[ObjectMap, ...]
    reader: ObjectMap  # what the reader rank holds of group GROUP
    block_major: bool  # reader caches one run of memory per block (else one array each)


def tp2_writer() -> tuple[ObjectMap, ...]:
    return tuple(
        ObjectMap(
            0,
            GROUP,
            shard,
            (
                heads("l0", "k", 2 * shard, 2),
                heads("l0", "v", 2 * shard, 2),
                heads("l1", "k", 2 * shard, 2),
                extra("l7"),
                heads("l1", "v", 2 * shard, 2),
                state("l1"),
            ),
        )
        for shard in (0, 1)
    )


def whole_heads(layer: str) -> tuple[Entry, Entry]:
    return heads(layer, "k", 0, HEADS), heads(layer, "v", 0, HEADS)


SCENARIOS = {
    # Writer TP=2, reader TP=1: each block needs both shards' keys; each shard's object
    # holds a cache the reader lacks, and the state is read from shard 0 only.
    "tp2-to-tp1": Scenario(
        tp2_writer(),
        ObjectMap(0, GROUP, 0, (*whole_heads("l0"), *whole_heads("l1"), state("l1"))),
        block_major=False,
    ),
    # Writer TP=1, reader rank 1 of TP=2 with block-major caches: k and v of a layer lie
    # back to back in memory, but their pieces do not in the object (a gap of heads).
    "tp1-to-tp2-block-major": Scenario(
        (ObjectMap(0, GROUP, 0, (*whole_heads("l0"), extra("l7"), *whole_heads("l1"))),),
        ObjectMap(
            0,
            GROUP,
            1,
            tuple(heads(layer, cache, 2, 2) for layer in ("l0", "l1") for cache in "kv"),
        ),
        block_major=True,
    ),
    # Writer PP=2, reader PP=1: each block needs both stages' keys, each whole.
    "pp2-to-pp1": Scenario(
        (
            ObjectMap(0, GROUP, 0, whole_heads("l0")),
            ObjectMap(1, GROUP, 0, (*whole_heads("l1"), state("l1"))),
        ),
        ObjectMap(0, GROUP, 0, (*whole_heads("l0"), *whole_heads("l1"), state("l1"))),
        block_major=False,
    ),
}


class ReaderCaches:
    """The reader rank's caches: guard bytes everywhere until a load writes them."""

    def __init__(self, reader: ObjectMap, block_major: bool) -> None:
        self.reader = reader
        sizes = [entry.length for entry in reader.entries]
        self.padding = 8
        if block_major:
            stride = sum(sizes) + self.padding
            memory = np.full((NUM_BLOCKS, stride), GUARD, dtype=np.uint8)
            self.memory = [memory]
            starts = np.cumsum([0, *sizes[:-1]])
            self.views = [memory[:, s : s + n] for s, n in zip(starts, sizes, strict=True)]
        else:
            self.memory = [
                np.full((NUM_BLOCKS, n + self.padding), GUARD, dtype=np.uint8) for n in sizes
            ]
            self.views = [array[:, :n] for array, n in zip(self.memory, sizes, strict=True)]
        self.entries = [
            CacheEntry(
                layer=int(entry.layer[1:]),
                name=entry.cache,
                base_ptr=int(view.ctypes.data),
                block_bytes=entry.length,
                block_stride=view.strides[0],
                num_blocks=NUM_BLOCKS,
            )
            for entry, view in zip(reader.entries, self.views, strict=True)
        ]

    def written(self) -> np.ndarray:
        """Which bytes of the reader's memory differ from the guard."""
        return np.concatenate([(array != GUARD).ravel() for array in self.memory])


def partial_layouts(reads: GroupReads, caches: ReaderCaches, sizes: dict) -> list[GroupLayout]:
    """One partial layout per writer object the reader's block needs (the integration's
    part: a `Piece` of `plan_reads` is a piece of a local cache entry)."""
    return [
        GroupLayout.partial(
            FIRST_PARTIAL_ID + index,
            reads.group,
            sizes[(source.stage, source.group, source.shard)],
            [
                (caches.entries[p.dst_entry].piece(p.dst_offset, p.length), p.src_offset)
                for p in source.pieces
            ],
        )
        for index, source in enumerate(reads.sources)
    ]


def reference(layout: ObjectMap, block: int) -> bytes:
    """The whole model's bytes of one cache in one logical block, cut to `layout`'s
    spans: the same for every topology that holds them."""
    out = []
    for entry in layout.entries:
        whole = HEADS * UNIT if entry.span is not None else entry.length
        seed = zlib.crc32(f"{entry.layer}/{entry.cache}/{block}".encode())
        data = np.random.default_rng(seed).integers(0, 256, whole, dtype=np.uint8).tobytes()
        if entry.span is not None:
            data = data[entry.span.start * UNIT : entry.span.stop * UNIT]
        out.append(data)
    return b"".join(out)


def key(prefix: str, layout: ObjectMap | tuple[int, int, int], block: int) -> str:
    stage, group, shard = layout.ident if isinstance(layout, ObjectMap) else layout
    return f"{prefix}@pp:{stage}@group:{group}@head:{shard}@{block}"


def unique_key_prefix() -> str:
    return f"partial-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def prefix() -> str:
    return unique_key_prefix()


def put_writer_objects(store: Store, prefix: str, scenario: Scenario, skip: set[str]) -> None:
    keys, arrays = [], []
    for layout in scenario.writer:
        for block in range(len(READER_BLOCKS)):
            if key(prefix, layout, block) in skip:
                continue
            keys.append(key(prefix, layout, block))
            arrays.append(np.frombuffer(reference(layout, block), dtype=np.uint8).copy())
    statuses = store.batch_put_whole(
        keys, [[int(a.ctypes.data)] for a in arrays], [[a.nbytes] for a in arrays]
    )
    assert all(status.ok for status in statuses), statuses


@dataclass
class Loaded:
    result: TransferResult
    caches: ReaderCaches
    layouts: list[GroupLayout]
    reads: GroupReads


def load(store: Store, prefix: str, scenario: Scenario, mode: tuple[str, str]) -> Loaded:
    how, granularity = mode
    caches = ReaderCaches(scenario.reader, scenario.block_major)
    (reads,) = plan_reads([scenario.reader], scenario.writer)
    sizes = {layout.ident: sum(e.length for e in layout.entries) for layout in scenario.writer}
    layouts = partial_layouts(reads, caches, sizes)
    # Block b of the reader's group needs one transfer per source, same local block.
    loads = [
        BlockTransfer(
            key=key(prefix, (source.stage, source.group, source.shard), block),
            group=layout.group_id,
            local_block=local,
            request_id="reader",
            block_index=block,
        )
        for source, layout in zip(reads.sources, layouts, strict=True)
        for block, local in enumerate(READER_BLOCKS)
    ]
    options = PipelineOptions(granularity=granularity)
    with TransferEngine(store, layouts, options) as engine:
        if how == "load":
            result = engine.load(loads).wait(timeout=60)
        else:
            step = engine.begin_layerwise(loads=loads)
            for layer in sorted({entry.layer for entry in caches.entries}):
                step.wait_layer_loaded(layer)
            result = step.finish()
    return Loaded(result, caches, layouts, reads)


def assert_landed(loaded: Loaded, failed_sources: dict[int, set[int]]) -> None:
    """Each loaded block holds the reference where its pieces go (except the pieces of
    sources failed for it, which stay guard); nothing else of the memory was written."""
    caches, reads = loaded.caches, loaded.reads
    wanted = np.zeros_like(caches.written())
    offsets = np.cumsum([0, *(array.size for array in caches.memory)])
    for block, local in enumerate(READER_BLOCKS):
        expected = reference(caches.reader, block)
        entry_offsets = np.cumsum([0, *(e.length for e in caches.reader.entries)])
        for index, source in enumerate(reads.sources):
            if index in failed_sources.get(block, set()):
                continue
            for piece in source.pieces:
                view = caches.views[piece.dst_entry]
                got = view[local, piece.dst_offset : piece.dst_offset + piece.length]
                start = entry_offsets[piece.dst_entry] + piece.dst_offset
                assert got.tobytes() == expected[start : start + piece.length], (block, piece)
                # Mark these bytes as wanted in the flat view of the memory.
                memory_index = 0 if len(caches.memory) == 1 else piece.dst_entry
                array = caches.memory[memory_index]
                flat = got.ctypes.data - array.ctypes.data + offsets[memory_index]
                wanted[flat : flat + piece.length] = True
    written = caches.written()
    assert not (written & ~wanted).any(), "bytes outside the pieces were written"


@pytest.mark.parametrize("mode", MODES, ids=["-".join(mode) for mode in MODES])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pieces_of_several_keys_land_exactly_and_nothing_else_is_written(
    store: Store, prefix: str, name: str, mode: tuple[str, str]
) -> None:
    scenario = SCENARIOS[name]
    put_writer_objects(store, prefix, scenario, skip=set())
    loaded = load(store, prefix, scenario, mode)
    assert loaded.result.ok, loaded.result
    assert not loaded.result.failed_blocks
    assert_landed(loaded, failed_sources={})


@pytest.mark.parametrize("mode", MODES, ids=["-".join(mode) for mode in MODES])
def test_a_block_fails_when_any_of_its_keys_fails(
    store: Store, prefix: str, mode: tuple[str, str]
) -> None:
    scenario = SCENARIOS["tp2-to-tp1"]
    missing = key(prefix, (0, GROUP, 1), 1)  # shard 1's object of logical block 1
    put_writer_objects(store, prefix, scenario, skip={missing})
    loaded = load(store, prefix, scenario, mode)
    assert loaded.result.failed_blocks == {GROUP: {READER_BLOCKS[1]}}
    assert loaded.result.failed_keys == [missing]
    # Shard 0's pieces of that block may land; shard 1's are never written.
    assert_landed(loaded, failed_sources={1: {1}})


@pytest.mark.parametrize("how", ["load", "step"])
def test_a_partial_object_with_no_staging_room_fails_its_block_and_is_not_read_in_place(
    prefix: str, how: str
) -> None:
    store = MemoryStore()
    scenario = SCENARIOS["tp2-to-tp1"]
    put_writer_objects(store, prefix, scenario, skip=set())
    caches = ReaderCaches(scenario.reader, scenario.block_major)
    (reads,) = plan_reads([scenario.reader], scenario.writer)
    sizes = {layout.ident: sum(e.length for e in layout.entries) for layout in scenario.writer}
    layouts = partial_layouts(reads, caches, sizes)
    loads = [
        BlockTransfer(key(prefix, (0, GROUP, shard), 0), layout.group_id, READER_BLOCKS[0])
        for shard, layout in enumerate(layouts)
    ]
    with TransferEngine(store, layouts, PipelineOptions(staging_bytes=4096)) as engine:
        assert engine.staging is not None
        taken = engine.staging.allocate(1, 4096)  # another step holds every slab
        assert taken is not None
        if how == "load":
            result = engine.load(loads).wait(timeout=60)
        else:
            step = engine.begin_layerwise(loads=loads)
            step.wait_layer_loaded(0)
            result = step.finish()
        engine.staging.free(taken)
    assert result.failed_blocks == {GROUP: {READER_BLOCKS[0]}}
    assert sorted(result.unblamed_keys) == sorted(load.key for load in loads)
    assert not caches.written().any()


def test_a_partial_layout_only_reads() -> None:
    caches = ReaderCaches(SCENARIOS["pp2-to-pp1"].reader, block_major=False)
    layout = GroupLayout.partial(FIRST_PARTIAL_ID, GROUP, 64, [(caches.entries[0], 0)])
    with TransferEngine(MemoryStore(), [layout]) as engine:
        save = BlockTransfer("k", FIRST_PARTIAL_ID, 0)
        with pytest.raises(ValueError, match="partial layout of another topology's objects"):
            engine.save([save])
        with pytest.raises(ValueError, match="it only reads"):
            engine.begin_layerwise(saves=[save])


def test_a_partial_object_larger_than_the_staging_buffer_is_refused_at_start() -> None:
    caches = ReaderCaches(SCENARIOS["pp2-to-pp1"].reader, block_major=False)
    layout = GroupLayout.partial(FIRST_PARTIAL_ID, GROUP, 8192, [(caches.entries[0], 64)])
    with pytest.raises(ValueError, match="its 8192 B objects do not fit staging_bytes 4096"):
        TransferEngine(MemoryStore(), [layout], PipelineOptions(staging_bytes=4096))
    # Ranged reads need no staging.
    TransferEngine(MemoryStore(), [layout], PipelineOptions(granularity="layer")).close()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_staged_partial_reads_check_the_integrity_tag_of_each_whole_object(
    prefix: str, name: str
) -> None:
    tagged = TaggedStore(MemoryStore(), IntegrityKey(b"a deployment secret of 32 bytes."))
    scenario = SCENARIOS[name]
    put_writer_objects(tagged, prefix, scenario, skip=set())
    loaded = load(tagged, prefix, scenario, ("load", "staged"))
    assert loaded.result.ok, loaded.result
    assert_landed(loaded, failed_sources={})


@st.composite
def cut_objects(draw: st.DrawFn) -> tuple[list[int], bool, list[list[tuple[int, int, int]]]]:
    """Reader cache sizes, whether they are block-major, and writer objects as lists of
    chunks (reader entry or -1 for bytes nobody reads here, offset in it, length)."""
    sizes = draw(st.lists(st.integers(1, 48), min_size=1, max_size=4))
    objects: list[list[tuple[int, int, int]]] = [[] for _ in range(draw(st.integers(1, 3)))]
    for index, size in enumerate(sizes):
        cuts = sorted(draw(st.sets(st.integers(1, size - 1), max_size=3))) if size > 1 else []
        bounds = [0, *cuts, size]
        for start, stop in itertools.pairwise(bounds):
            owner = draw(st.integers(0, len(objects) - 1))
            objects[owner].append((index, start, stop - start))
    for chunks in objects:
        chunks += [(-1, 0, n) for n in draw(st.lists(st.integers(1, 16), max_size=2))]
    shuffled = [draw(st.permutations(chunks)) for chunks in objects if chunks]
    return sizes, draw(st.booleans()), shuffled


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=cut_objects(), mode=st.sampled_from(MODES), seed=st.integers(0, 2**32 - 1))
def test_any_cut_of_reader_caches_into_writer_objects_reads_back_exactly(
    cut: tuple[list[int], bool, list[list[tuple[int, int, int]]]],
    mode: tuple[str, str],
    seed: int,
) -> None:
    sizes, block_major, objects = cut
    reader = ObjectMap(0, GROUP, 0, tuple(Entry(f"l{i}", "c", n) for i, n in enumerate(sizes)))
    caches = ReaderCaches(reader, block_major)
    rng = np.random.default_rng(seed)
    expected = [rng.integers(0, 256, (len(READER_BLOCKS), n), dtype=np.uint8) for n in sizes]
    store, prefix = MemoryStore(), unique_key_prefix()
    layouts, loads = [], []
    for number, chunks in enumerate(objects):
        pieces, blobs, offset = [], [], 0
        for index, start, length in chunks:
            if index >= 0:
                pieces.append((caches.entries[index].piece(start, length), offset))
                blobs.append(expected[index][:, start : start + length])
            else:
                blobs.append(rng.integers(0, 256, (len(READER_BLOCKS), length), dtype=np.uint8))
            offset += length
        data = np.ascontiguousarray(np.concatenate(blobs, axis=1))
        keys = [f"{prefix}@{number}@{block}" for block in range(len(READER_BLOCKS))]
        ptrs = [[int(data[block].ctypes.data)] for block in range(len(READER_BLOCKS))]
        assert all(s.ok for s in store.batch_put_whole(keys, ptrs, [[offset]] * len(keys)))
        if not pieces:
            continue
        layout = GroupLayout.partial(FIRST_PARTIAL_ID + number, GROUP, offset, pieces)
        layouts.append(layout)
        loads += [
            BlockTransfer(keys[block], layout.group_id, local, "reader", block)
            for block, local in enumerate(READER_BLOCKS)
        ]
    how, granularity = mode
    with TransferEngine(store, layouts, PipelineOptions(granularity=granularity)) as engine:
        if how == "load":
            result = engine.load(loads).wait(timeout=60)
        else:
            step = engine.begin_layerwise(loads=loads)
            for layer in range(len(sizes)):
                step.wait_layer_loaded(layer)
            result = step.finish()
    assert result.ok, result
    for index, view in enumerate(caches.views):
        assert (view[READER_BLOCKS] == expected[index]).all()
    untouched = sorted(set(range(NUM_BLOCKS)) - set(READER_BLOCKS))
    assert all((view[untouched] == GUARD).all() for view in caches.views)
    for array in caches.memory:  # padding after each block's caches
        assert (array[:, array.shape[1] - caches.padding :] == GUARD).all()
