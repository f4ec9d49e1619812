"""plan_reads against an oracle: a whole model's bytes, written out under one random
topology and read back under another, must land exactly where the reader's caches hold
them."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.keys import Entry, ObjectMap, Span, plan_reads

TP_SIZES = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class Cache:
    name: str
    unit_bytes: int | None  # None: unsharded, `length` bytes on every rank
    length: int = 0


@dataclass(frozen=True)
class Group:
    units: int  # KV heads of the group's sharded caches, in the whole model
    caches: tuple[Cache, ...]


@dataclass(frozen=True)
class Model:
    groups: tuple[Group, ...]
    layer_groups: tuple[int, ...]  # the group of each layer

    def layer(self, index: int) -> str:
        return f"model.layers.{index}.mixer"

    def whole_bytes(self, group: Group, cache: Cache) -> int:
        return cache.length if cache.unit_bytes is None else group.units * cache.unit_bytes


@dataclass(frozen=True)
class Topology:
    tp: int
    stages: tuple[tuple[int, int], ...]  # [start, end) layers of each stage

    def storing(self, group: Group) -> int:
        """How vLLM's HeadPlan cuts a group's units into stored objects."""
        return math.gcd(min(group.units, self.tp), self.tp)

    def shard_of(self, group: Group, tp_rank: int) -> int:
        return tp_rank // (self.tp // self.storing(group))

    def object(self, model: Model, stage: int, group_id: int, shard: int) -> ObjectMap | None:
        """What this topology stores per block of a group on a stage for a storing shard
        (None: the stage holds none of the group's layers)."""
        start, end = self.stages[stage]
        group = model.groups[group_id]
        layers = [i for i in range(start, end) if model.layer_groups[i] == group_id]
        if not layers:
            return None
        per_shard = group.units // self.storing(group)
        entries = tuple(
            Entry(model.layer(i), cache.name, cache.length)
            if cache.unit_bytes is None
            else Entry(
                model.layer(i),
                cache.name,
                per_shard * cache.unit_bytes,
                Span(shard * per_shard, per_shard, cache.unit_bytes),
            )
            for i in layers
            for cache in group.caches
        )
        return ObjectMap(stage, group_id, shard, entries)


def compatible(units: int, tp: int) -> bool:
    """vLLM shards heads evenly or replicates whole heads."""
    return units % tp == 0 or tp % units == 0


@st.composite
def caches(draw: st.DrawFn) -> tuple[Cache, ...]:
    names = draw(st.lists(st.sampled_from("kvscx"), min_size=1, max_size=3, unique=True))
    return tuple(
        Cache(name, None, draw(st.integers(1, 9)))
        if draw(st.booleans())
        else Cache(name, draw(st.integers(1, 5)))
        for name in names
    )


@st.composite
def stages(draw: st.DrawFn, layers: int) -> tuple[tuple[int, int], ...]:
    count = draw(st.integers(1, min(4, layers)))
    cuts = (
        sorted(draw(st.sets(st.integers(1, layers - 1), min_size=count - 1, max_size=count - 1)))
        if count > 1
        else []
    )
    bounds = [0, *cuts, layers]
    return tuple(itertools.pairwise(bounds))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Model, Topology, Topology, bytes]:
    writer_tp, reader_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    units = [u for u in range(1, 13) if compatible(u, writer_tp) and compatible(u, reader_tp)]
    groups = tuple(
        Group(draw(st.sampled_from(units)), draw(caches())) for _ in range(draw(st.integers(1, 3)))
    )
    layers = draw(st.integers(1, 7))
    layer_groups = tuple(draw(st.integers(0, len(groups) - 1)) for _ in range(layers))
    model = Model(groups, layer_groups)
    writer = Topology(writer_tp, draw(stages(layers)))
    reader = Topology(reader_tp, draw(stages(layers)))
    size = sum(model.whole_bytes(groups[g], c) for g in layer_groups for c in groups[g].caches)
    reference = random.Random(draw(st.integers(0, 2**32))).randbytes(size)
    return model, writer, reader, reference


def whole_model(model: Model, reference: bytes) -> dict[tuple[str, str], bytes]:
    """Every cache's bytes per block in the whole model, keyed by (layer, cache)."""
    out, offset = {}, 0
    for index, group_id in enumerate(model.layer_groups):
        group = model.groups[group_id]
        for cache in group.caches:
            size = model.whole_bytes(group, cache)
            out[(model.layer(index), cache.name)] = reference[offset : offset + size]
            offset += size
    return out


def held(entry: Entry, whole: dict[tuple[str, str], bytes]) -> bytes:
    """What a rank holding `entry` has in that cache: its units, or the whole cache."""
    data = whole[(entry.layer, entry.cache)]
    if entry.span is None:
        return data
    span = entry.span
    return data[span.start * span.unit_bytes : (span.start + span.count) * span.unit_bytes]


def serialise(layout: ObjectMap, whole: dict[tuple[str, str], bytes]) -> bytes:
    return b"".join(held(entry, whole) for entry in layout.entries)


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), data=st.data())
def test_every_reader_rank_fills_exactly_the_bytes_its_caches_hold(
    scenario: tuple[Model, Topology, Topology, bytes], data: st.DataObject
) -> None:
    model, writer, reader, reference = scenario
    whole = whole_model(model, reference)
    written = []
    for stage in range(len(writer.stages)):
        for group_id, group in enumerate(model.groups):
            for shard in range(writer.storing(group)):
                layout = writer.object(model, stage, group_id, shard)
                if layout is None:
                    continue
                # The writer's own entry order is its business: alignment is by name.
                entries = tuple(data.draw(st.permutations(layout.entries)))
                written.append(ObjectMap(stage, group_id, shard, entries))
    stored = {layout.ident: serialise(layout, whole) for layout in written}

    for tp_rank in range(reader.tp):
        for stage in range(len(reader.stages)):
            wanted = [
                layout
                for g, group in enumerate(model.groups)
                if (layout := reader.object(model, stage, g, reader.shard_of(group, tp_rank)))
            ]
            for layout, reads in zip(wanted, plan_reads(wanted, written), strict=True):
                assert reads.group == layout.group
                filled = [bytearray(entry.length) for entry in layout.entries]
                times = [[0] * entry.length for entry in layout.entries]
                for source in reads.sources:
                    blob = stored[(source.stage, source.group, source.shard)]
                    for piece in source.pieces:
                        src = blob[piece.src_offset : piece.src_offset + piece.length]
                        assert len(src) == piece.length
                        dst = slice(piece.dst_offset, piece.dst_offset + piece.length)
                        filled[piece.dst_entry][dst] = src
                        for i in range(dst.start, dst.stop):
                            times[piece.dst_entry][i] += 1
                for entry, got, counts in zip(layout.entries, filled, times, strict=True):
                    assert len(got) == entry.length
                    assert set(counts) == {1}, f"{entry.layer}/{entry.cache} not filled once"
                    assert bytes(got) == held(entry, whole), f"{entry.layer}/{entry.cache}"
