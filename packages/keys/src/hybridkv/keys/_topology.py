"""Which writer bytes fill which reader bytes when the two cut the model differently.

A topology (TP size, pipeline stages) decides which layers and which units (KV heads) of
each cache one object holds. Both sides describe their objects by name, as `ObjectMap`s;
`plan_reads` lines them up by (layer, cache) and by unit ranges, never by position, so a
reader of any topology can fill its own blocks from the objects another topology wrote.
Pure values and arithmetic, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

_ObjectId = tuple[int, int, int]


class Span(msgspec.Struct, frozen=True):
    """Units [start, start + count) of the model's total (KV heads of an attention cache),
    each unit_bytes long, back to back: the unit axis is outermost in the block's bytes."""

    start: int
    count: int
    unit_bytes: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.count < 1 or self.unit_bytes < 1:
            raise ValueError(
                f"a span needs start >= 0, count >= 1 and unit_bytes >= 1, got {self!r}"
            )

    @property
    def stop(self) -> int:
        return self.start + self.count


class Entry(msgspec.Struct, frozen=True):
    """One cache of one layer inside an object: `length` bytes per block.

    `span` None: the cache is not sharded (the same bytes on every rank holding the layer).
    """

    layer: str
    cache: str
    length: int
    span: Span | None = None

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"{self.layer}/{self.cache}: length must be positive")
        if self.span is not None and self.span.count * self.span.unit_bytes != self.length:
            raise ValueError(
                f"{self.layer}/{self.cache}: length {self.length} is not its span's "
                f"{self.span.count} units of {self.span.unit_bytes} bytes"
            )

    @property
    def name(self) -> tuple[str, str]:
        return (self.layer, self.cache)


class ObjectMap(msgspec.Struct, frozen=True):
    """One object per block of one group on one stage for one storing shard: its entries
    back to back in this order (offset = sum of the lengths before)."""

    stage: int
    group: int
    shard: int
    entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        names = [entry.name for entry in self.entries]
        if len(set(names)) != len(names):
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"object {self.ident}: entries repeated: {repeated}")

    @property
    def ident(self) -> _ObjectId:
        """(stage, group, shard): what names the object among one topology's objects."""
        return (self.stage, self.group, self.shard)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each entry's offset in the object."""
        offsets, end = [], 0
        for entry in self.entries:
            offsets.append(end)
            end += entry.length
        return tuple(offsets)

    @property
    def size(self) -> int:
        """Bytes per block of the whole object."""
        return sum(entry.length for entry in self.entries)


class Piece(msgspec.Struct, frozen=True):
    """`length` bytes at `src_offset` of a writer object, copied to `dst_offset` inside
    the block bytes of the reader object's entry number `dst_entry`."""

    src_offset: int
    length: int
    dst_entry: int
    dst_offset: int


class Source(msgspec.Struct, frozen=True):
    """One writer object a reader object needs, and the pieces of it that it needs."""

    stage: int
    group: int
    shard: int
    pieces: tuple[Piece, ...]


class GroupReads(msgspec.Struct, frozen=True):
    """Everything that fills one reader object (one group, one reader rank)."""

    group: int
    sources: tuple[Source, ...]


class TopologyMismatch(ValueError):  # noqa: N818 (the name the integration codes against)
    """A reader object the writer's objects cannot fill; the message names layer and cache."""


_Filled = tuple[_ObjectId, Piece]


class _Held(msgspec.Struct, frozen=True):
    """Where one writer object holds one (layer, cache)."""

    ident: _ObjectId
    offset: int
    entry: Entry


def plan_reads(reader: Sequence[ObjectMap], writer: Sequence[ObjectMap]) -> tuple[GroupReads, ...]:
    """For each reader object (what ONE reader rank fills for one group, its `shard`
    ignored), the writer objects and byte pieces that fill every byte of it exactly once.

    Alignment by (layer, cache) names, never indices; spans by unit overlap; where several
    writer objects hold the same units, the lowest (stage, group, shard) wins. Raises
    TopologyMismatch if a reader byte is uncovered, unit_bytes differ, unsharded lengths
    differ, or one side is sharded and the other is not.
    """
    held = _index(writer)
    return tuple(_group_reads(target, held) for target in reader)


def _index(writer: Sequence[ObjectMap]) -> dict[tuple[str, str], list[_Held]]:
    """Every writer placement of each (layer, cache), lowest object first."""
    idents = [obj.ident for obj in writer]
    if len(set(idents)) != len(idents):
        raise ValueError(f"writer objects repeat a (stage, group, shard): {sorted(idents)}")
    held: dict[tuple[str, str], list[_Held]] = {}
    for obj in sorted(writer, key=lambda obj: obj.ident):
        for offset, entry in zip(obj.offsets, obj.entries, strict=True):
            held.setdefault(entry.name, []).append(_Held(obj.ident, offset, entry))
    return held


def _group_reads(target: ObjectMap, held: dict[tuple[str, str], list[_Held]]) -> GroupReads:
    by_source: dict[_ObjectId, list[Piece]] = {}
    for index, entry in enumerate(target.entries):
        where = held.get(entry.name)
        if not where:
            raise TopologyMismatch(
                f"layer {entry.layer} cache {entry.cache}: no writer object holds it"
            )
        if entry.span is None:
            filled = _fill_unsharded(entry, index, where)
        else:
            filled = _fill_sharded(entry, entry.span, index, where)
        for ident, piece in filled:
            by_source.setdefault(ident, []).append(piece)
    sources = tuple(
        Source(*ident, pieces=_merged(pieces)) for ident, pieces in sorted(by_source.items())
    )
    return GroupReads(group=target.group, sources=sources)


def _fill_unsharded(entry: Entry, index: int, where: list[_Held]) -> list[_Filled]:
    for found in where:
        if found.entry.span is not None:
            raise TopologyMismatch(
                f"layer {entry.layer} cache {entry.cache}: unsharded here, sharded by units "
                f"in writer object {found.ident}"
            )
        if found.entry.length != entry.length:
            raise TopologyMismatch(
                f"layer {entry.layer} cache {entry.cache}: unsharded length "
                f"{entry.length} here, {found.entry.length} in writer object {found.ident}"
            )
    first = where[0]
    return [(first.ident, Piece(first.offset, entry.length, index, 0))]


def _fill_sharded(entry: Entry, span: Span, index: int, where: list[_Held]) -> list[_Filled]:
    missing = [(span.start, span.stop)]
    filled: list[_Filled] = []
    for found in where:
        theirs = found.entry.span
        if theirs is None:
            raise TopologyMismatch(
                f"layer {entry.layer} cache {entry.cache}: sharded by units here, "
                f"unsharded in writer object {found.ident}"
            )
        if theirs.unit_bytes != span.unit_bytes:
            raise TopologyMismatch(
                f"layer {entry.layer} cache {entry.cache}: {span.unit_bytes} bytes per unit "
                f"here, {theirs.unit_bytes} in writer object {found.ident}"
            )
        still_missing = []
        for start, stop in missing:
            low, high = max(start, theirs.start), min(stop, theirs.stop)
            if low >= high:
                still_missing.append((start, stop))
                continue
            filled.append(
                (
                    found.ident,
                    Piece(
                        src_offset=found.offset + (low - theirs.start) * span.unit_bytes,
                        length=(high - low) * span.unit_bytes,
                        dst_entry=index,
                        dst_offset=(low - span.start) * span.unit_bytes,
                    ),
                )
            )
            still_missing += [part for part in ((start, low), (high, stop)) if part[0] < part[1]]
        missing = still_missing
    if missing:
        raise TopologyMismatch(
            f"layer {entry.layer} cache {entry.cache}: no writer object holds units "
            + ", ".join(f"[{start}, {stop})" for start, stop in sorted(missing))
        )
    return filled


def _merged(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Ascending source offsets, a piece that continues the previous one on both sides
    joined to it (fewer, longer copies)."""
    merged: list[Piece] = []
    for piece in sorted(pieces, key=lambda piece: piece.src_offset):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.src_offset + last.length == piece.src_offset
            and last.dst_entry == piece.dst_entry
            and last.dst_offset + last.length == piece.dst_offset
        ):
            merged[-1] = Piece(
                last.src_offset, last.length + piece.length, last.dst_entry, last.dst_offset
            )
        else:
            merged.append(piece)
    return tuple(merged)
