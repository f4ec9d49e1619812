"""The rows of one group's transfers in one call, and their place in staging slabs.

A `GroupBatch` keeps which of its keys are still going (a failed key is dropped without
touching the others), which staging slab rows hold them, and copies them between the
caches and the slabs in runs, since one strided slice copy beats numpy's indexed gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from hybridkv.transport.layout import BlockIds, GroupLayout
from hybridkv.transport.ownership import BlockTransfer
from hybridkv.transport.staging import Bytes, Slab, StagingPool, host_view

Rows = np.ndarray  # indices into a GroupBatch
# Where staged rows sit: (slab, their slots, their cache blocks, runs of both or None).
Placement = tuple[Slab, Rows, BlockIds, "list[tuple[int, int, int]] | None"]
# Slice copies pay off over indexed copies for runs of at least this many rows.
MIN_RUN = 8


class GroupBatch:
    """The transfers of one group in one call, with which of them are still going."""

    def __init__(self, layout: GroupLayout, transfers: Sequence[BlockTransfer]) -> None:
        self.layout = layout
        self.keys = [transfer.key for transfer in transfers]
        self.blocks: BlockIds = np.array(
            [transfer.local_block for transfer in transfers], dtype=np.int64
        )
        self.alive = np.ones(len(transfers), dtype=bool)
        self.segments: list[Segment] = []  # staged runs of rows (empty: not staged)
        self._views: dict[int, Bytes] = {}
        self._placements: dict[bytes, list[Placement]] = {}  # of these segments

    def live(self) -> Rows:
        return np.flatnonzero(self.alive)

    def keys_of(self, rows: Iterable[int]) -> list[str]:
        return [self.keys[row] for row in rows]

    def stage(self, pool: StagingPool, first: int = 0) -> bool:
        """Give the live rows from `first` on slabs, run after run, as far as the pool has
        room; the rest (maybe nothing) is one unstaged segment at the end. Returns whether
        any row got a slab. Contiguous objects get none: they move in place."""
        if self.layout.contiguous:
            return False
        self._placements.clear()
        count, width = len(self.keys), self.layout.object_size
        live = self.live()
        live = live[live >= first]
        start = int(live[0]) if len(live) else count
        staged = False
        while start < count:
            slab = pool.allocate(count - start, width)
            if slab is None:
                break
            self.segments.append(Segment(start, start + slab.rows, slab))
            start += slab.rows
            staged = True
        self.segments.append(Segment(start, count, None))
        return staged

    @property
    def staged_to(self) -> int:
        """The row after the last one with a slab (0: none has one)."""
        return max((seg.stop for seg in self.segments if seg.slab is not None), default=0)

    def fully_staged(self) -> bool:
        """Every live row has a slab (or needs none: contiguous objects move in place)."""
        return all(
            segment.slab is not None or not self.alive[segment.start : segment.stop].any()
            for segment in self.segments
        )

    def unstage(self, pool: StagingPool) -> None:
        for segment in self.segments:
            if segment.slab is not None:
                pool.free(segment.slab)
        self.segments = []
        self._placements.clear()

    def copy_rows(
        self, rows: Rows, into_staging: bool, entries: Sequence[int] | None = None
    ) -> None:
        """Copy `entries` (default: all) of the staged `rows` (ascending) between the caches
        and the slabs.

        Rows whose slab slots and cache blocks both advance by one form a run, moved by one
        strided slice copy per entry (numpy's indexed gather is about 3x slower than that);
        a fragmented batch falls back to one indexed copy per entry.
        """
        indices = range(len(self.layout.entries)) if entries is None else entries
        for slab, slots, blocks, runs in self._placement(rows):
            for index in indices:
                start = self.layout.offset_of(index)
                stop = start + self.layout.entries[index].block_bytes
                staged = slab.array[:, start:stop]
                view = self._view(index)
                if runs is None:
                    if into_staging:
                        staged[slots] = view[blocks]
                    else:
                        view[blocks] = staged[slots]
                    continue
                for slot, block, count in runs:
                    if into_staging:
                        staged[slot : slot + count] = view[block : block + count]
                    else:
                        view[block : block + count] = staged[slot : slot + count]

    def _placement(self, rows: Rows) -> list[Placement]:
        """Per staged segment holding some of `rows`: its slab, their slots there, their
        cache blocks and the runs of both. Worked out once per staging and set of rows: a
        layerwise step copies the same rows once per layer."""
        key = rows.astype(np.int64, copy=False).tobytes()
        placement = self._placements.get(key)
        if placement is not None:
            return placement
        placement = []
        for segment in self.segments:
            if segment.slab is None:
                continue
            low, high = np.searchsorted(rows, [segment.start, segment.stop])
            if low == high:
                continue
            slots = rows[low:high] - segment.start
            blocks = self.blocks[rows[low:high]]
            placement.append((segment.slab, slots, blocks, _runs(slots, blocks)))
        self._placements[key] = placement
        return placement

    def _view(self, index: int) -> Bytes:
        view = self._views.get(index)
        if view is None:
            view = self._views[index] = host_view(self.layout.entries[index], self.blocks)
        return view


def _runs(slots: Rows, blocks: BlockIds) -> list[tuple[int, int, int]] | None:
    """(slot, block, length) of the runs where both advance by one; None if too many.

    "Too many" is more than one run per MIN_RUN rows: then each slice copy is short and
    one indexed copy per entry costs less than the Python loop over runs.
    """
    breaks = np.flatnonzero((np.diff(slots) != 1) | (np.diff(blocks) != 1)) + 1
    if len(breaks) + 1 > max(1, len(slots) // MIN_RUN):
        return None
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(slots)])))
    return list(zip(slots[starts].tolist(), blocks[starts].tolist(), lengths.tolist(), strict=True))


class Segment:
    """Rows [start, stop) of a group batch and the slab staging them (None: unstaged)."""

    __slots__ = ("slab", "start", "stop")

    def __init__(self, start: int, stop: int, slab: Slab | None) -> None:
        self.start, self.stop, self.slab = start, stop, slab


def group_batches(
    layouts: dict[int, GroupLayout], transfers: Sequence[BlockTransfer]
) -> dict[int, GroupBatch]:
    by_group: dict[int, list[BlockTransfer]] = {}
    for transfer in transfers:
        by_group.setdefault(transfer.group, []).append(transfer)
    return {
        group: GroupBatch(layouts[group], members) for group, members in sorted(by_group.items())
    }
