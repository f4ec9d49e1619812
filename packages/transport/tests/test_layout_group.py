"""GroupLayout: order, prefix-sum offsets, per-layer pieces, and refusal of bad input."""

from __future__ import annotations

import numpy as np
import pytest
from _engine_model import SPECS, Caches
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.transport.layout import CacheEntry, GroupLayout


def entry(layer: int, name: str, nbytes: int, stride: int = 0, base: int = 4096) -> CacheEntry:
    return CacheEntry(layer, name, base, nbytes, stride or nbytes)


def test_example_layout_sizes_are_real_entry_sums_in_layer_then_name_order() -> None:
    layouts = Caches(num_blocks=4).layouts
    full, compressed, window = layouts
    assert [(e.layer, e.name) for e in compressed.entries] == [
        (1, "latent"),
        (2, "indexer"),
        (2, "latent"),
        (3, "latent"),
    ]
    assert compressed.object_size == 576 * 3 + 136
    assert [compressed.offset_of(i) for i in range(4)] == [0, 576, 712, 1288]
    assert full.object_size == 512 + 512 + 1024
    assert full.last_layer == 2
    assert window.layers == (0, 3)
    assert window.last_layer == 3
    assert compressed.entries_of_layer(2) == (1, 2)
    assert compressed.entries_of_layer(0) == ()
    assert compressed.local_layer_index(3) == 2
    assert compressed.num_blocks == 4


@given(
    st.lists(
        st.tuples(st.integers(0, 60), st.sampled_from("abcdef"), st.integers(1, 4096)),
        min_size=1,
        max_size=30,
        unique_by=lambda spec: (spec[0], spec[1]),
    )
)
def test_offsets_are_prefix_sums_and_layer_pieces_tile_the_object(
    specs: list[tuple[int, str, int]],
) -> None:
    layout = GroupLayout(7, [entry(layer, name, size) for layer, name, size in specs])
    ordered = sorted(specs)
    assert [(e.layer, e.name) for e in layout.entries] == [(s[0], s[1]) for s in ordered]
    expected = np.concatenate([[0], np.cumsum([s[2] for s in ordered])])
    assert [layout.offset_of(i) for i in range(len(ordered))] == expected[:-1].tolist()
    assert layout.object_size == expected[-1]
    assert layout.layers == tuple(sorted({s[0] for s in specs}))
    pieces = []
    for layer in layout.layers:
        ranges = layout.layer_ranges(layer)
        assert ranges is not None
        pieces.extend(zip(ranges.offsets, ranges.sizes, strict=True))
    covered = 0
    for offset, size in pieces:  # ranges of every layer, in order, cover the object once
        assert offset == covered
        covered += size
    assert covered == layout.object_size


def test_pointers_follow_block_stride_per_entry() -> None:
    layout = GroupLayout(0, [entry(0, "k", 100, 128, base=1000), entry(0, "v", 50, 64, base=9000)])
    ranges = layout.layer_ranges(0)
    assert ranges is not None
    assert ranges.pointers(np.array([0, 3], dtype=np.int64)) == [
        [1000, 9000],
        [1000 + 3 * 128, 9000 + 3 * 64],
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer": -1}, "layer must be >= 0"),
        ({"base_ptr": 0}, "base_ptr is null"),
        ({"block_bytes": 0}, "block_bytes must be > 0"),
        ({"block_stride": 10}, "would overlap"),
        ({"num_blocks": 0}, "num_blocks must be > 0"),
    ],
)
def test_bad_entries_are_refused_with_a_reason(kwargs: dict[str, int], message: str) -> None:
    values = {"layer": 0, "name": "k", "base_ptr": 64, "block_bytes": 16, "block_stride": 16}
    values.update(kwargs)
    with pytest.raises(ValueError, match=message):
        CacheEntry(**values)  # type: ignore[arg-type]


def test_duplicate_and_empty_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        GroupLayout(0, [entry(1, "k", 8), entry(1, "k", 8)])
    with pytest.raises(ValueError, match="no cache entries"):
        GroupLayout(0, [])


def test_local_block_ids_outside_the_tensors_are_refused() -> None:
    layout = Caches(num_blocks=4).layouts[0]
    layout.check_blocks([0, 3])
    with pytest.raises(ValueError, match=r"local block 4 is outside \[0, 4\)"):
        layout.check_blocks([4])
    with pytest.raises(ValueError, match="local block -1"):
        layout.check_blocks([-1])


def test_every_spec_group_is_in_the_model() -> None:
    assert [layout.group_id for layout in Caches(2).layouts] == sorted(SPECS)


def test_block_major_objects_are_one_piece_in_place_and_per_layer_ones_are_not() -> None:
    caches = Caches(num_blocks=4, block_major={0, 1})
    full, compressed, window = caches.layouts
    blocks = np.array([0, 3], dtype=np.int64)
    for layout in (full, compressed):
        assert layout.contiguous
        assert layout.whole.sizes == [layout.object_size]
        addresses = [caches.block_address(layout.group_id, block) for block in (0, 3)]
        assert layout.whole.pointers(blocks) == [[address] for address in addresses]
    layer_two = compressed.layer_ranges(2)  # indexer + latent of one layer: one piece
    assert layer_two is not None
    assert (layer_two.offsets, layer_two.sizes) == ([576], [136 + 576])
    assert not window.contiguous  # its own array per entry: a piece per entry
    assert window.whole.sizes == [256, 1000]


@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.sampled_from(["adjoins", "gap", "other stride"])),
        min_size=1,
        max_size=12,
    ),
    st.lists(st.integers(0, 9), min_size=1, max_size=4),
)
def test_merged_pieces_put_every_object_byte_where_its_entry_keeps_it(
    specs: list[tuple[int, str]], block_list: list[int]
) -> None:
    """Oracle: each entry alone maps object offset o + i to its block's address + i."""
    stride = 64 * len(specs) + 512
    entries, base = [], 4096
    for index, (size, placement) in enumerate(specs):
        if index and placement != "adjoins":
            base += 8  # not where the previous entry ends
        own_stride = stride + 64 if placement == "other stride" else stride
        entries.append(CacheEntry(0, f"e{index:02d}", base, size, own_stride))
        base += size
    layout = GroupLayout(3, entries)
    blocks = np.array(block_list, dtype=np.int64)
    expected = {
        (block, layout.offset_of(index) + i): entry.base_ptr + block * entry.block_stride + i
        for index, entry in enumerate(layout.entries)
        for block in block_list
        for i in range(entry.block_bytes)
    }
    whole = layout.whole
    got = {
        (block, offset + i): pointer + i
        for block, pointers in zip(block_list, whole.pointers(blocks), strict=True)
        for offset, size, pointer in zip(whole.offsets, whole.sizes, pointers, strict=True)
        for i in range(size)
    }
    assert got == expected
    breaks = sum(  # an entry starts a new piece unless it adjoins one of the same stride
        1
        for (_, placement), before, entry in zip(specs[1:], entries, entries[1:], strict=False)
        if placement != "adjoins" or entry.block_stride != before.block_stride
    )
    assert len(whole.sizes) == 1 + breaks
    assert layout.contiguous == (breaks == 0)


def test_a_partial_layout_places_its_pieces_at_their_offsets_in_the_object() -> None:
    k, v = entry(0, "k", 64, base=4096), entry(0, "v", 64, base=4096 + 64)
    layout = GroupLayout.partial(
        9, 2, 256, [(v.piece(0, 32), 160), (k.piece(0, 32), 32), (entry(1, "s", 16), 0)]
    )
    assert (layout.group_id, layout.block_group, layout.read_only) == (9, 2, True)
    assert layout.object_size == 256
    assert [layout.offset_of(i) for i in range(3)] == [32, 160, 0]
    assert layout.layers == (0, 1)
    # k's and v's pieces adjoin in memory but not in the object: two ranges, not one.
    ranges = layout.layer_ranges(0)
    assert ranges is not None
    assert (ranges.offsets, ranges.sizes) == ([32, 160], [32, 32])
    assert not layout.covers_object
    assert not layout.contiguous


def test_a_partial_layout_of_the_whole_object_in_order_moves_in_place() -> None:
    k, v = entry(0, "k", 64, base=4096), entry(0, "v", 64, base=4096 + 64)
    layout = GroupLayout.partial(9, 2, 128, [(k, 0), (v, 64)])
    assert layout.covers_object
    assert layout.contiguous
    assert GroupLayout(1, [k, v]).covers_object


def test_bad_partial_layouts_are_refused_with_the_reason() -> None:
    k = entry(0, "k", 64)
    with pytest.raises(ValueError, match=r"piece \[48, 80\) is outside its 64 B blocks"):
        k.piece(48, 32)
    with pytest.raises(ValueError, match=r"at offset 100 \(32 B\) is outside the 128 B object"):
        GroupLayout.partial(9, 2, 128, [(k.piece(0, 32), 100)])
    with pytest.raises(ValueError, match="two pieces overlap in cache 'k' of layer 0"):
        GroupLayout.partial(9, 2, 128, [(k.piece(0, 32), 0), (k.piece(16, 32), 64)])
    with pytest.raises(ValueError, match="partial layout 9 has no pieces"):
        GroupLayout.partial(9, 2, 128, [])
