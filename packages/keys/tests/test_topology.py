from __future__ import annotations

import pytest

from hybridkv.keys import (
    Entry,
    GroupReads,
    ObjectMap,
    Piece,
    Source,
    Span,
    TopologyMismatch,
    plan_reads,
)

KV = 64  # unsharded bytes per block of one cache in these examples
UNIT = 16  # bytes per head per block


def attention(layer: str, start: int, count: int, cache: str = "kv") -> Entry:
    return Entry(layer, cache, count * UNIT, Span(start, count, UNIT))


def state(layer: str, length: int = KV) -> Entry:
    return Entry(layer, "ssm", length)


def obj(*entries: Entry, stage: int = 0, group: int = 0, shard: int = 0) -> ObjectMap:
    return ObjectMap(stage, group, shard, entries)


def test_object_map_offsets_are_prefix_sums_of_the_lengths() -> None:
    layout = obj(state("a", 8), attention("a", 0, 2), state("b", 4))
    assert layout.offsets == (0, 8, 8 + 2 * UNIT)
    assert layout.size == 8 + 2 * UNIT + 4


def test_a_stage_reads_its_layers_out_of_the_single_stage_object() -> None:
    whole = obj(*(state(f"layers.{i}") for i in range(4)))
    second_stage = obj(state("layers.2"), state("layers.3"), stage=1)
    (reads,) = plan_reads([second_stage], [whole])
    assert reads == GroupReads(
        group=0,
        sources=(Source(0, 0, 0, (Piece(2 * KV, KV, 0, 0), Piece(3 * KV, KV, 1, 0))),),
    )


def test_uneven_stages_fill_a_reader_stage_from_both_writer_stages() -> None:
    writer = [
        obj(state("layers.0"), stage=0),
        obj(state("layers.1"), state("layers.2"), state("layers.3"), stage=1),
    ]
    reader = obj(state("layers.0"), state("layers.1"), state("layers.2"))
    (reads,) = plan_reads([reader], writer)
    assert reads.sources == (
        Source(0, 0, 0, (Piece(0, KV, 0, 0),)),
        Source(1, 0, 0, (Piece(0, KV, 1, 0), Piece(KV, KV, 2, 0))),
    )


def test_two_tp_shards_combine_into_one_rank_by_head_ranges() -> None:
    writer = [
        obj(attention("l0", 0, 2), attention("l1", 0, 2), shard=0),
        obj(attention("l0", 2, 2), attention("l1", 2, 2), shard=1),
    ]
    reader = obj(attention("l0", 0, 4), attention("l1", 0, 4))
    (reads,) = plan_reads([reader], writer)
    assert reads.sources == (
        Source(0, 0, 0, (Piece(0, 2 * UNIT, 0, 0), Piece(2 * UNIT, 2 * UNIT, 1, 0))),
        Source(0, 0, 1, (Piece(0, 2 * UNIT, 0, 2 * UNIT), Piece(2 * UNIT, 2 * UNIT, 1, 2 * UNIT))),
    )


def test_one_tp_object_splits_into_the_heads_of_each_rank() -> None:
    writer = [obj(attention("l0", 0, 4), attention("l1", 0, 4))]
    rank_1 = obj(attention("l0", 2, 2), attention("l1", 2, 2), shard=1)
    (reads,) = plan_reads([rank_1], writer)
    assert reads.sources == (
        Source(0, 0, 0, (Piece(2 * UNIT, 2 * UNIT, 0, 0), Piece(6 * UNIT, 2 * UNIT, 1, 0))),
    )


def test_adjacent_pieces_of_one_entry_merge_into_one_copy() -> None:
    writer = [obj(attention("l0", 0, 4, "k"), attention("l0", 0, 4, "v"))]
    reader = obj(attention("l0", 0, 4, "k"), attention("l0", 0, 4, "v"))
    (reads,) = plan_reads([reader], writer)
    assert reads.sources == (
        Source(0, 0, 0, (Piece(0, 4 * UNIT, 0, 0), Piece(4 * UNIT, 4 * UNIT, 1, 0))),
    )


def test_replicated_heads_are_read_from_the_one_object_that_stores_them() -> None:
    # Two KV heads at TP=4: storing shards 0 and 1 hold head 0 and head 1.
    writer = [obj(attention("l0", head, 1), shard=head) for head in (0, 1)]
    rank_3 = obj(attention("l0", 1, 1), shard=1)
    rank_0_of_tp_1 = obj(attention("l0", 0, 2))
    assert plan_reads([rank_3, rank_0_of_tp_1], writer) == (
        GroupReads(0, (Source(0, 0, 1, (Piece(0, UNIT, 0, 0),)),)),
        GroupReads(
            0,
            (
                Source(0, 0, 0, (Piece(0, UNIT, 0, 0),)),
                Source(0, 0, 1, (Piece(0, UNIT, 0, UNIT),)),
            ),
        ),
    )


def test_unsharded_states_are_read_whole_from_the_lowest_object_holding_them() -> None:
    writer = [obj(attention("l0", s, 1), state("l0"), shard=s) for s in (1, 0)]
    reader = obj(state("l0"), attention("l0", 0, 2))
    (reads,) = plan_reads([reader], writer)
    assert reads.sources == (
        Source(0, 0, 0, (Piece(0, UNIT, 1, 0), Piece(UNIT, KV, 0, 0))),
        Source(0, 0, 1, (Piece(0, UNIT, 1, UNIT),)),
    )


def test_overlapping_writer_units_are_taken_from_the_lowest_object() -> None:
    writer = [obj(attention("l0", 0, 3), shard=0), obj(attention("l0", 1, 3), shard=1)]
    (reads,) = plan_reads([obj(attention("l0", 0, 4))], writer)
    assert reads.sources == (
        Source(0, 0, 0, (Piece(0, 3 * UNIT, 0, 0),)),
        Source(0, 0, 1, (Piece(2 * UNIT, UNIT, 0, 3 * UNIT),)),
    )


def test_reader_groups_keep_their_own_ids_and_order() -> None:
    writer = [obj(state("a"), group=5), obj(state("b"), group=2)]
    reads = plan_reads([obj(state("b"), group=7), obj(state("a"), group=1)], writer)
    assert [(r.group, [(s.group) for s in r.sources]) for r in reads] == [(7, [2]), (1, [5])]


@pytest.mark.parametrize(
    ("reader", "writer", "reason"),
    [
        (obj(state("l1")), [obj(state("l0"))], "layer l1 cache ssm: no writer object holds it"),
        (
            obj(attention("l0", 0, 4)),
            [obj(attention("l0", 0, 2))],
            r"layer l0 cache kv: no writer object holds units \[2, 4\)",
        ),
        (
            obj(Entry("l0", "kv", 64, Span(0, 4, 16))),
            [obj(Entry("l0", "kv", 64, Span(0, 2, 32)))],
            "layer l0 cache kv: 16 bytes per unit here, 32 in writer object",
        ),
        (
            obj(state("l0", 64)),
            [obj(state("l0", 32))],
            r"layer l0 cache ssm: unsharded length 64 here, 32 in writer object \(0, 0, 0\)",
        ),
        (
            obj(Entry("l0", "kv", 64, Span(0, 4, 16))),
            [obj(Entry("l0", "kv", 64))],
            "layer l0 cache kv: sharded by units here, unsharded in writer object",
        ),
        (
            obj(Entry("l0", "kv", 64)),
            [obj(Entry("l0", "kv", 64, Span(0, 4, 16)))],
            "layer l0 cache kv: unsharded here, sharded by units in writer object",
        ),
    ],
    ids=[
        "layer-missing",
        "units-missing",
        "unit-bytes",
        "length",
        "writer-unsharded",
        "writer-sharded",
    ],
)
def test_a_reader_object_the_writer_cannot_fill_is_refused_with_the_reason(
    reader: ObjectMap, writer: list[ObjectMap], reason: str
) -> None:
    with pytest.raises(TopologyMismatch, match=reason):
        plan_reads([reader], writer)


def test_a_span_that_disagrees_with_its_length_is_refused() -> None:
    with pytest.raises(ValueError, match="length 60 is not its span's 4 units of 16 bytes"):
        Entry("l0", "kv", 60, Span(0, 4, 16))


def test_an_object_naming_an_entry_twice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"entries repeated: \[\('l0', 'ssm'\)\]"):
        obj(state("l0"), state("l0"))


def test_writer_objects_naming_one_object_twice_are_refused() -> None:
    with pytest.raises(ValueError, match="writer objects repeat a"):
        plan_reads([obj(state("l0"))], [obj(state("l0")), obj(state("l0"))])
