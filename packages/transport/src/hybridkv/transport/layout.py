"""Where each byte of a group's per-block object comes from and goes to.

One object holds one block of one KV cache group for one storing head: the bytes of every
cache entry registered for the group, ordered by (physical layer, cache name), each at the
prefix sum of the entries before it. Sizes are each entry's real per-block byte length,
never layers x an average, so groups whose layers hold caches of different shapes (MLA
latent + indexer keys, window + state) stay byte-exact. Whole and ranged transfers use the
same offsets, so either mode reads what the other wrote.

A reader whose instance cuts the model differently from the writer's (another TP size or
other pipeline stages) fills a block from parts of several writer objects: one *partial*
layout per writer object, whose pieces (sub-ranges of local cache entries, each at its
offset in that object) need not cover the object. Partial layouts only read.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

BlockIds = npt.NDArray[np.int64]


class CacheEntry(msgspec.Struct, frozen=True):
    """One cache of one layer: local block `b` lives at `base_ptr + b * block_stride`.

    `num_blocks`, when known, bounds the local block ids (a wrong id would read or write
    another tensor's memory) and sizes the region registered with the store.
    """

    layer: int
    name: str
    base_ptr: int
    block_bytes: int
    block_stride: int
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.layer < 0:
            raise ValueError(f"cache {self.name!r}: layer must be >= 0, got {self.layer}")
        if self.base_ptr <= 0:
            raise ValueError(f"cache {self.name!r} of layer {self.layer}: base_ptr is null")
        if self.block_bytes <= 0:
            raise ValueError(
                f"cache {self.name!r} of layer {self.layer}: block_bytes must be > 0, "
                f"got {self.block_bytes}"
            )
        if self.block_stride < self.block_bytes:
            raise ValueError(
                f"cache {self.name!r} of layer {self.layer}: block_stride {self.block_stride}"
                f" < block_bytes {self.block_bytes} would overlap neighbouring blocks"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(
                f"cache {self.name!r} of layer {self.layer}: num_blocks must be > 0, "
                f"got {self.num_blocks}"
            )

    def piece(self, offset: int, length: int) -> CacheEntry:
        """Bytes [offset, offset + length) of each block of this cache, as an entry of its
        own (a partial layout's piece)."""
        if offset < 0 or length <= 0 or offset + length > self.block_bytes:
            raise ValueError(
                f"cache {self.name!r} of layer {self.layer}: piece [{offset}, "
                f"{offset + length}) is outside its {self.block_bytes} B blocks"
            )
        return msgspec.structs.replace(self, base_ptr=self.base_ptr + offset, block_bytes=length)

    @property
    def region(self) -> tuple[int, int] | None:
        """(address, length) of the memory all blocks span, if `num_blocks` is known."""
        if self.num_blocks is None:
            return None
        return self.base_ptr, (self.num_blocks - 1) * self.block_stride + self.block_bytes


class Ranges:
    """Per-block pieces of a run of entries; pointers are computed from local block ids.

    Entries that lie back to back in memory for every block (same stride, each starting
    where the one before ends, as in vLLM's block-outermost layouts) and in the object
    are one piece: a
    store call moves fewer, larger pieces, and an object whose entries all adjoin is
    moved in place as one piece.
    """

    __slots__ = ("_bases", "_strides", "nbytes", "offsets", "sizes")

    def __init__(self, entries: Sequence[CacheEntry], offsets: Sequence[int]) -> None:
        bases: list[int] = []
        strides: list[int] = []
        self.sizes: list[int] = []
        self.offsets: list[int] = []
        for entry, offset in zip(entries, offsets, strict=True):
            if (
                self.sizes
                and entry.block_stride == strides[-1]
                and entry.base_ptr == bases[-1] + self.sizes[-1]
                and offset == self.offsets[-1] + self.sizes[-1]
            ):
                self.sizes[-1] += entry.block_bytes
                continue
            bases.append(entry.base_ptr)
            strides.append(entry.block_stride)
            self.sizes.append(entry.block_bytes)
            self.offsets.append(offset)
        self._bases = np.array(bases, dtype=np.int64)
        self._strides = np.array(strides, dtype=np.int64)
        self.nbytes = sum(self.sizes)

    def pointers(self, blocks: BlockIds) -> list[list[int]]:
        """One list of local addresses per block, in piece order (vectorised)."""
        table = self._bases[None, :] + blocks[:, None] * self._strides[None, :]
        rows: list[list[int]] = table.tolist()
        return rows


class GroupLayout:
    """The object layout of one KV cache group; answers which bytes go where.

    `group_id` names the layout among an engine's layouts (what `BlockTransfer.group`
    says); `block_group` is the group whose local blocks it fills, under which failed
    blocks are reported: the same group, except for partial layouts.
    """

    def __init__(self, group_id: int, entries: Iterable[CacheEntry]) -> None:
        ordered = sorted(entries, key=lambda entry: (entry.layer, entry.name))
        if not ordered:
            raise ValueError(f"group {group_id} has no cache entries")
        seen: set[tuple[int, str]] = set()
        for entry in ordered:
            if (entry.layer, entry.name) in seen:
                raise ValueError(
                    f"group {group_id}: cache {entry.name!r} registered twice for layer "
                    f"{entry.layer}"
                )
            seen.add((entry.layer, entry.name))
        offsets = np.cumsum([0] + [entry.block_bytes for entry in ordered])
        self._place(group_id, ordered, [int(offset) for offset in offsets])
        self.block_group = group_id
        self.read_only = False

    @classmethod
    def partial(
        cls,
        layout_id: int,
        block_group: int,
        object_size: int,
        pieces: Iterable[tuple[CacheEntry, int]],
    ) -> GroupLayout:
        """A read-only layout of part of another topology's object of `object_size` bytes.

        Each piece is a local sub-entry (a cache entry's `base_ptr` moved to where the
        piece goes inside its block, `block_bytes` the piece's length, same stride) and
        the piece's offset in the object. Pieces need not cover the object: reads move
        only them. `layout_id` names the layout in the engine (one per writer object a
        block needs, distinct from every other layout's); failures are reported as blocks
        of `block_group`.
        """
        placed = sorted(pieces, key=lambda piece: (piece[0].layer, piece[1]))
        if not placed:
            raise ValueError(f"partial layout {layout_id} has no pieces")
        for entry, offset in placed:
            if offset < 0 or offset + entry.block_bytes > object_size:
                raise ValueError(
                    f"partial layout {layout_id}: piece of cache {entry.name!r} of layer "
                    f"{entry.layer} at offset {offset} ({entry.block_bytes} B) is outside "
                    f"the {object_size} B object"
                )
        _refuse_overlapping_destinations(layout_id, [entry for entry, _ in placed])
        layout = cls.__new__(cls)
        layout._place(
            layout_id, [entry for entry, _ in placed], [*(o for _, o in placed), object_size]
        )
        layout.block_group = block_group
        layout.read_only = True
        return layout

    def _place(self, group_id: int, ordered: list[CacheEntry], offsets: list[int]) -> None:
        """Entries (ordered by layer) at `offsets` in the object; the last offset is
        the object's size."""
        self.group_id = group_id
        self.entries: tuple[CacheEntry, ...] = tuple(ordered)
        self._offsets: tuple[int, ...] = tuple(offsets)
        self.layers: tuple[int, ...] = tuple(sorted({entry.layer for entry in ordered}))
        # Entries of one layer are adjacent (ordered by layer): [start, stop) per layer.
        layer_of = [entry.layer for entry in ordered]
        self._span = {
            layer: (bisect.bisect_left(layer_of, layer), bisect.bisect_right(layer_of, layer))
            for layer in self.layers
        }
        self.whole = self._ranges(0, len(ordered))
        # Whether the pieces are the whole object in order (always, unless partial): only
        # then may a whole read write a block's object into them as it comes.
        self.covers_object = (
            self.whole.offsets == list(itertools.accumulate(self.whole.sizes[:-1], initial=0))
            and self.whole.nbytes == offsets[-1]
        )
        self._layer_ranges = {layer: self._ranges(*span) for layer, span in self._span.items()}
        limits = [entry.num_blocks for entry in ordered if entry.num_blocks is not None]
        self.num_blocks: int | None = min(limits) if limits else None

    def __repr__(self) -> str:
        return (
            f"GroupLayout(group_id={self.group_id}, layers={list(self.layers)}, "
            f"entries={len(self.entries)}, object_size={self.object_size})"
        )

    @property
    def object_size(self) -> int:
        return self._offsets[-1]

    @property
    def contiguous(self) -> bool:
        """Each block's object is one run of local memory: it moves in place, never staged."""
        return len(self.whole.sizes) == 1 and self.covers_object

    @property
    def last_layer(self) -> int:
        """The layer after which this group's objects are complete and may commit."""
        return self.layers[-1]

    @property
    def first_layer(self) -> int:
        return self.layers[0]

    def offset_of(self, index: int) -> int:
        """Byte offset of entry `index` (in `entries` order) inside the object."""
        if not 0 <= index < len(self.entries):
            raise IndexError(f"group {self.group_id} has no entry {index}")
        return self._offsets[index]

    def entries_of_layer(self, layer: int) -> tuple[int, ...]:
        """Indices (into `entries`) of this layer's caches; empty if the group lacks it."""
        start, stop = self._span.get(layer, (0, 0))
        return tuple(range(start, stop))

    def local_layer_index(self, layer: int) -> int:
        """Position of a physical layer among this group's layers (what offsets follow)."""
        if layer not in self._span:
            raise KeyError(f"group {self.group_id} has no layer {layer}")
        return self.layers.index(layer)

    def layer_ranges(self, layer: int) -> Ranges | None:
        """The pieces one layer contributes to each object, or None if absent here."""
        return self._layer_ranges.get(layer)

    def check_blocks(self, blocks: Sequence[int]) -> None:
        """Refuse local block ids outside the registered tensors before any byte moves."""
        limit = self.num_blocks
        for block in blocks:
            if block < 0 or (limit is not None and block >= limit):
                bound = f"[0, {limit})" if limit is not None else ">= 0"
                raise ValueError(f"group {self.group_id}: local block {block} is outside {bound}")

    def _ranges(self, start: int, stop: int) -> Ranges:
        return Ranges(self.entries[start:stop], self._offsets[start:stop])


def _refuse_overlapping_destinations(layout_id: int, entries: Sequence[CacheEntry]) -> None:
    """Two pieces of one cache entry writing the same bytes of a block: a wrong map."""
    by_cache: dict[tuple[int, str], list[CacheEntry]] = {}
    for entry in entries:
        by_cache.setdefault((entry.layer, entry.name), []).append(entry)
    for (layer, name), pieces in by_cache.items():
        pieces.sort(key=lambda entry: entry.base_ptr)
        for before, after in itertools.pairwise(pieces):
            if before.base_ptr + before.block_bytes > after.base_ptr:
                raise ValueError(
                    f"partial layout {layout_id}: two pieces overlap in cache {name!r} "
                    f"of layer {layer}"
                )
