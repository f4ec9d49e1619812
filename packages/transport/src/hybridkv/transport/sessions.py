"""Put and get sessions of one batch of objects: which store calls move which bytes.

Three granularities answer the same questions (open, move a layer, commit, drop):
- staged: each object moves as ONE piece per key through registered host staging memory:
  layer by layer, each layer is copied into staging once ready and a group's objects are
  put once its last layer is in; a whole save gathers part by part, each part put while the
  next is gathered; layerwise reads fetch whole objects at the start and scatter each layer
  into the caches when it is due, whole reads scatter each part while the next is fetched;
- ranged: put/get sessions; each layer's byte ranges move on their own, a group commits
  once all of its own layers were written; nothing is readable before the commit;
- whole: each group's objects move in one multi-buffer call (one piece per layer), written
  once all of the group's layers are ready and read before its first layer is needed.
All place every entry at the same offset, so each reads what the others wrote. A failed
key is dropped (its open session revoked) without touching other keys or groups.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import cached_property

import msgspec
import numpy as np

from hybridkv.transport.errors import Status, StoreClosed, StoreError, StoreUnavailable
from hybridkv.transport.events import Event
from hybridkv.transport.layout import BlockIds, GroupLayout, Ranges
from hybridkv.transport.ownership import BlockTransfer
from hybridkv.transport.pins import GetPins
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.staging import Bytes, Slab, StagingPool, host_view
from hybridkv.transport.stale import StaleSessions
from hybridkv.transport.store import Store

log = logging.getLogger(__name__)

Rows = np.ndarray  # indices into a GroupBatch
# Where staged rows sit: (slab, their slots, their cache blocks, runs of both or None).
Placement = tuple[Slab, Rows, BlockIds, "list[tuple[int, int, int]] | None"]
# A staged call is cut into about this many parts (none under MIN_PART_BYTES), so that the
# copy of one part overlaps the store call of another.
OVERLAP_PARTS = 8
MIN_PART_BYTES = 4 << 20
# Slice copies pay off over indexed copies for runs of at least this many rows.
MIN_RUN = 8


class TransferResult(msgspec.Struct):
    """What a save or load achieved. Failed local blocks hold no valid KV."""

    failed_blocks: dict[int, set[int]] = msgspec.field(default_factory=dict)
    failed_keys: list[str] = msgspec.field(default_factory=list)
    skipped_keys: list[str] = msgspec.field(default_factory=list)
    # Keys another client was writing when this save ran, not readable when it settled:
    # neither stored by this save nor failed by it.
    contended_keys: list[str] = msgspec.field(default_factory=list)
    # Failed keys whose objects are not at fault: the master did not answer, or the
    # client raised. The others (`blamed_keys`) failed by the store's word on them.
    unblamed_keys: list[str] = msgspec.field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed_keys

    @property
    def blamed_keys(self) -> list[str]:
        """Failed keys whose objects the store failed (a status about them): to distrust."""
        unblamed = set(self.unblamed_keys)
        return [key for key in self.failed_keys if key not in unblamed]

    def merged(self, other: TransferResult) -> TransferResult:
        failed = {group: set(blocks) for group, blocks in self.failed_blocks.items()}
        for group, blocks in other.failed_blocks.items():
            failed.setdefault(group, set()).update(blocks)
        return TransferResult(
            failed_blocks=failed,
            failed_keys=self.failed_keys + other.failed_keys,
            skipped_keys=self.skipped_keys + other.skipped_keys,
            contended_keys=self.contended_keys + other.contended_keys,
            unblamed_keys=self.unblamed_keys + other.unblamed_keys,
            bytes=self.bytes + other.bytes,
            seconds=max(self.seconds, other.seconds),
        )


class Outcome:
    """The result of one direction of a transfer as it builds up on a worker thread."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._result = TransferResult()
        self._started = time.perf_counter()
        self._riding = 0  # saves riding on another transfer's write of the same key
        self.no_space = False  # the pool refused some key for want of room
        self._unblamed: set[str] = set()  # see TransferResult.unblamed_keys
        self._store_failed: set[str] = set()  # keys whose last status was a failure

    def ride(self, count: int) -> None:
        with self._lock:
            self._riding += count

    def rode(
        self, group: int, key: str, block: int, committed: bool, contended: bool = False
    ) -> None:
        """The write this outcome rode on settled: its failure (or contention) is this
        outcome's too."""
        with self._lock:
            if contended:
                self._result.contended_keys.append(key)
            elif not committed:
                self._result.failed_keys.append(key)
                self._result.failed_blocks.setdefault(group, set()).add(block)
            self._riding -= 1
            self._lock.notify_all()

    @property
    def riding(self) -> bool:
        with self._lock:
            return self._riding > 0

    def wait_riders(self, timeout: float | None = None) -> None:
        with self._lock:
            if not self._lock.wait_for(lambda: self._riding <= 0, timeout):
                raise TimeoutError(f"saves riding on other writes unsettled after {timeout} s")

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self._result.bytes += nbytes

    @property
    def moved_any(self) -> bool:
        with self._lock:
            return self._result.bytes > 0

    def skipped(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._result.skipped_keys.extend(keys)

    def contended(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._result.contended_keys.extend(keys)

    def contended_set(self) -> set[str]:
        with self._lock:
            return set(self._result.contended_keys)

    def failed(
        self, group: int, keys: Iterable[str], blocks: Iterable[int], blamed: bool = True
    ) -> None:
        """`blamed=False`: a client error failed these keys, which says nothing of their
        objects (nor does an unanswered call, see `judged`); a store status about a key
        (`judged`) still stands."""
        with self._lock:
            keys = list(keys)
            self._result.failed_keys.extend(keys)
            self._result.failed_blocks.setdefault(group, set()).update(blocks)
            if not blamed:
                self._unblamed.update(key for key in keys if key not in self._store_failed)

    def judged(self, keys: Sequence[str], statuses: Sequence[Status]) -> None:
        """A call's statuses: a key the master did not answer for (RPC_FAILED) is no
        object's fault; the latest word on a key (a retry's) stands."""
        with self._lock:
            for key, status in zip(keys, statuses, strict=True):
                if status is Status.RPC_FAILED:
                    self._unblamed.add(key)
                    self._store_failed.discard(key)
                elif not status.ok:
                    self._unblamed.discard(key)
                    self._store_failed.add(key)

    def recovered(self, keys: Iterable[str]) -> None:
        """A retry read these keys: what failed them before says nothing against their
        objects (a later client error fails them unblamed)."""
        with self._lock:
            self._store_failed.difference_update(keys)

    def failed_blocks(self) -> dict[int, set[int]]:
        with self._lock:
            return {group: set(blocks) for group, blocks in self._result.failed_blocks.items()}

    def result(self) -> TransferResult:
        """A snapshot: later failures do not change it."""
        with self._lock:
            now = self._result
            return TransferResult(
                failed_blocks={group: set(blocks) for group, blocks in now.failed_blocks.items()},
                failed_keys=list(now.failed_keys),
                skipped_keys=list(now.skipped_keys),
                contended_keys=list(now.contended_keys),
                unblamed_keys=[key for key in now.failed_keys if key in self._unblamed],
                bytes=now.bytes,
                seconds=time.perf_counter() - self._started,
            )


def _log_failures(operation: str, statuses: Sequence[Status], level: int = logging.WARNING) -> None:
    counts = Counter(status.name for status in statuses if not status.ok)
    if counts:
        log.log(level, "%s: %d of %d keys failed: %s", operation, sum(counts.values()),
                len(statuses), dict(counts))  # fmt: skip


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


class Call:
    """Flat argument lists of one store call spanning several groups."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self.offsets: list[list[int]] = []
        self.nbytes: list[int] = []
        self.pieces: list[int] = []
        self.rows: list[tuple[GroupBatch, int]] = []

    def add(self, batch: GroupBatch, rows: Rows, ranges: Ranges) -> None:
        count = len(rows)
        self.keys.extend(batch.keys_of(rows))
        self.ptrs.extend(ranges.pointers(batch.blocks[rows]))
        self.sizes.extend([ranges.sizes] * count)
        self.offsets.extend([ranges.offsets] * count)
        self.nbytes.extend([ranges.nbytes] * count)
        self.pieces.extend([len(ranges.sizes)] * count)
        self.rows.extend((batch, int(row)) for row in rows)

    def add_staged(self, batch: GroupBatch, rows: Rows, segment: Segment, slab: Slab) -> None:
        """One piece per key: the object's row of the slab."""
        count, width = len(rows), batch.layout.object_size
        self.keys.extend(batch.keys_of(rows))
        self.ptrs.extend([address] for address in slab.row_addresses(rows - segment.start))
        self.sizes.extend([[width]] * count)
        self.offsets.extend([[0]] * count)
        self.nbytes.extend([width] * count)
        self.pieces.extend([1] * count)
        self.rows.extend((batch, int(row)) for row in rows)


StoreCall = Callable[[slice], list[Status]]
PartCopy = Callable[[slice], None]


def copy_part(call: Call, part: slice, into_staging: bool) -> None:
    """Copy the staged, still live rows of one slice of a call (unstaged ones are skipped)."""
    by_batch: dict[int, tuple[GroupBatch, list[int]]] = {}
    for batch, row in call.rows[part]:
        if batch.alive[row]:
            by_batch.setdefault(id(batch), (batch, []))[1].append(row)
    for batch, rows in by_batch.values():
        batch.copy_rows(np.array(rows, dtype=np.int64), into_staging)


def finer(parts: Sequence[slice], nbytes: Sequence[int]) -> list[slice]:
    """`parts` cut into about OVERLAP_PARTS slices of at least MIN_PART_BYTES."""
    target = max(MIN_PART_BYTES, sum(nbytes) // OVERLAP_PARTS)
    cut: list[slice] = []
    for part in parts:
        start, stop = part.start, part.stop
        used = 0
        for index in range(start, stop):
            used += nbytes[index]
            if used >= target and index + 1 < stop:
                cut.append(slice(start, index + 1))
                start, used = index + 1, 0
        cut.append(slice(start, stop))
    return cut


@dataclass(frozen=True)
class ClientSessions:
    """What the steps of one store client share: put sessions a revoke may have left open
    (revoked again before their keys are reused) and get-session pins (counted, since the
    pool keeps one per client and key)."""

    stale: StaleSessions
    pins: GetPins


class Transfers:
    """Shared plumbing of every session kind: issuing split calls and recording fates."""

    def __init__(
        self,
        store: Store,
        options: PipelineOptions,
        batches: dict[int, GroupBatch],
        outcome: Outcome,
        pool: StagingPool | None = None,
        *,
        client: ClientSessions,
    ) -> None:
        self.store = store
        self.options = options
        self.batches = batches
        self.outcome = outcome
        self.pool = pool
        self.client = client

    def stage(
        self, batches: Iterable[GroupBatch] | None = None, first: dict[int, int] | None = None
    ) -> bool:
        """Give the batches' live rows (from `first[group]` on) staging slabs where the pool
        has room (staged modes only); returns whether any row got one."""
        staged = False
        if self.pool is not None:
            for batch in self.batches.values() if batches is None else batches:
                start = 0 if first is None else first.get(batch.layout.group_id, 0)
                staged = batch.stage(self.pool, start) or staged
        return staged

    def unstage(self, batches: Iterable[GroupBatch] | None = None) -> None:
        """Hand slabs back to the pool; safe to call more than once."""
        if self.pool is not None:
            for batch in self.batches.values() if batches is None else batches:
                batch.unstage(self.pool)

    def issue(
        self,
        call: Call,
        operation: str,
        send: StoreCall,
        before: PartCopy | None = None,
        after: PartCopy | None = None,
        level: int = logging.WARNING,
    ) -> list[tuple[GroupBatch, int]]:
        """Run `send` over the limit-sized slices of `call`; returns the rows that failed
        (logged at `level`).

        `before` (copy a slice into staging before its call) or `after` (copy it out once
        its call is done; failed rows are dropped first) pipeline the slices on the staging
        pool's put or get thread: the copy of one slice runs while another's call moves bytes.
        """
        parts = self.options.split(call.nbytes, call.pieces)
        if self.pool is None:
            return self.issue_serially(call, parts, operation, send, level)
        if after is not None:
            return self._get_pipelined(
                call, finer(parts, call.nbytes), operation, send, after, level
            )
        if before is not None:
            parts = finer(parts, call.nbytes)
        return self._put_pipelined(call, parts, operation, send, before, level)

    def issue_serially(
        self,
        call: Call,
        parts: list[slice],
        operation: str,
        send: StoreCall,
        level: int = logging.WARNING,
    ) -> list[tuple[GroupBatch, int]]:
        """Run `send` over `parts` one after another here; returns the rows that failed."""
        failed: list[tuple[GroupBatch, int]] = []
        for part in parts:
            statuses = _guarded(send, part, operation)
            failed += self._settle(call, part, operation, statuses, level)
        return failed

    def _put_pipelined(
        self,
        call: Call,
        parts: list[slice],
        operation: str,
        send: StoreCall,
        before: PartCopy | None,
        level: int,
    ) -> list[tuple[GroupBatch, int]]:
        assert self.pool is not None
        calls: list[Future[list[Status]]] = []
        try:
            for part in parts:
                if before is not None:
                    before(part)
                calls.append(self.pool.puts.submit(_guarded, send, part, operation))
        finally:
            wait(calls)  # even if a copy failed: a call may still read the slabs
        failed: list[tuple[GroupBatch, int]] = []
        for part, done in zip(parts, calls, strict=True):
            failed += self._settle(call, part, operation, done.result(), level)
        return failed

    def _get_pipelined(
        self,
        call: Call,
        parts: list[slice],
        operation: str,
        send: StoreCall,
        after: PartCopy,
        level: int,
    ) -> list[tuple[GroupBatch, int]]:
        assert self.pool is not None
        calls: list[Future[list[Status]]] = []
        failed: list[tuple[GroupBatch, int]] = []
        try:
            for part in parts:  # in the try: a failed submit still waits for those before
                calls.append(self.pool.gets.submit(_guarded, send, part, operation))
            for part, done in zip(parts, calls, strict=True):
                failed_here = self._settle(call, part, operation, done.result(), level)
                self.fail(failed_here)  # before the copy: failed rows are never written
                failed += failed_here
                after(part)
        finally:
            wait(calls)  # even if a copy failed: a call may still write the slabs
        return failed

    def _settle(
        self, call: Call, part: slice, operation: str, statuses: list[Status], level: int
    ) -> list[tuple[GroupBatch, int]]:
        failed: list[tuple[GroupBatch, int]] = []
        for (batch, row), nbytes, status in zip(
            call.rows[part], call.nbytes[part], statuses, strict=True
        ):
            if status.ok:
                self.outcome.moved(nbytes)
            else:
                failed.append((batch, row))
        if failed:
            self.outcome.judged(call.keys[part], statuses)
        self.outcome.no_space |= Status.NO_SPACE in statuses
        _log_failures(operation, statuses, level)
        return failed

    def fail(self, rows: Iterable[tuple[GroupBatch, int]], blamed: bool = True) -> None:
        for batch, row in rows:
            if batch.alive[row]:
                batch.alive[row] = False
                group, block = batch.layout.group_id, int(batch.blocks[row])
                self.outcome.failed(group, [batch.keys[row]], [block], blamed)

    def fail_all(self, batches: Iterable[GroupBatch], blamed: bool = True) -> None:
        rows = ((batch, int(row)) for batch in batches for row in batch.live())
        self.fail(rows, blamed)

    def layer_call(self, layer: int) -> Call:
        call = Call()
        for batch in self.batches.values():
            ranges = batch.layout.layer_ranges(layer)
            if ranges is not None:
                call.add(batch, batch.live(), ranges)
        return call

    def whole_call(self, batches: Iterable[GroupBatch], staged_only: bool = False) -> Call:
        """Whole objects: one piece per staged key, one piece per run of adjoining entries
        otherwise (a contiguous object: one, in place); `staged_only`: the staged keys."""
        call = Call()
        for batch in batches:
            if not batch.segments and not staged_only:
                call.add(batch, batch.live(), batch.layout.whole)
            for segment in batch.segments:
                live = segment.start + np.flatnonzero(batch.alive[segment.start : segment.stop])
                if segment.slab is not None:
                    call.add_staged(batch, live, segment, segment.slab)
                elif not staged_only:
                    call.add(batch, live, batch.layout.whole)
        return call


def _guarded(send: StoreCall, part: slice, operation: str) -> list[Status]:
    """The statuses of one call; a store error fails every key of it."""
    try:
        return send(part)
    except StoreError as exc:
        log.warning("%s of %d keys failed: %s", operation, part.stop - part.start, exc)
        return [status_of(exc)] * (part.stop - part.start)


def status_of(error: StoreError) -> Status:
    """The status a call that raised `error` leaves each of its keys with: RPC_FAILED
    when nothing answered (no word on any object), else OTHER."""
    unanswered = isinstance(error, (StoreUnavailable, StoreClosed))
    return Status.RPC_FAILED if unanswered else Status.OTHER


class Writes(Transfers, ABC):
    """A batch of saves; a group completes once all of its own layers were written."""

    def __init__(
        self,
        store: Store,
        options: PipelineOptions,
        batches: dict[int, GroupBatch],
        outcome: Outcome,
        pool: StagingPool | None = None,
        *,
        client: ClientSessions,
    ) -> None:
        super().__init__(store, options, batches, outcome, pool, client=client)
        self._missing = {group: set(batch.layout.layers) for group, batch in batches.items()}
        self.committed: set[str] = set()
        # Ranged sessions, per group: rows whose session start said EXISTS (another client's
        # session or object), settled at the group's commit by whether the pool reads them.
        self._contested: dict[int, list[int]] = {}
        self.prepared = False  # ran (not failed at once while a full pool pauses saves)

    @property
    def layers(self) -> set[int]:
        return {layer for missing in self._missing.values() for layer in missing}

    def group_layers(self) -> list[frozenset[int]]:
        """Each group's layers: the group completes once all of them were written."""
        return [frozenset(batch.layout.layers) for batch in self.batches.values()]

    def moves_bytes_at(self, layer: int) -> bool:
        """Whether writing `layer` moves bytes before its group completes (else the layer
        is only bookkeeping, which can wait for the next hand-over to the send thread)."""
        return False

    def prepare(self) -> None:
        """Skip keys the pool already holds (one existence query), then open the rest
        (first revoking again sessions of theirs a revoke may have left open)."""
        self.prepared = True
        keys = [key for batch in self.batches.values() for key in batch.keys]
        try:
            readable = iter(self.store.batch_is_readable(keys) if keys else [])
        except StoreError as exc:
            log.warning("existence query of %d keys failed: %s", len(keys), exc)
            self.fail_all(self.batches.values())
            return
        for batch in self.batches.values():
            present = np.fromiter(readable, dtype=bool, count=len(batch.keys))
            self._skip(batch, np.flatnonzero(present))
        self.client.stale.revoke_again(
            key for batch in self.batches.values() for key in batch.keys_of(batch.live())
        )
        self.open()

    def write_layer(self, layer: int) -> None:
        self.write_ranges(layer)
        complete = []
        for group, missing in self._missing.items():
            if layer in missing:
                missing.discard(layer)
                if not missing:
                    complete.append(self.batches[group])
        if complete:
            self.commit(complete)

    def abort(self) -> None:
        """Drop every group that never got all of its layers: nothing half-written stays."""
        unfinished = [self.batches[group] for group, missing in self._missing.items() if missing]
        self._missing = {group: set() for group in self._missing}
        self.drop(unfinished)

    def _skip(self, batch: GroupBatch, rows: Rows) -> None:
        batch.alive[rows] = False
        keys = batch.keys_of(rows)
        self.committed.update(keys)
        self.outcome.skipped(keys)

    def _commit_rows(self, rows: Iterable[tuple[GroupBatch, int]]) -> None:
        self.committed.update(batch.keys[row] for batch, row in rows)

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def write_ranges(self, layer: int) -> None: ...

    @abstractmethod
    def commit(self, batches: Sequence[GroupBatch]) -> None: ...

    @abstractmethod
    def drop(self, batches: Sequence[GroupBatch]) -> None: ...


class RangedWrites(Writes):
    """Put sessions: allocate, write each layer's ranges, commit per group."""

    def open(self) -> None:
        call = self.whole_call(self.batches.values())
        try:
            self._open(call)
        except BaseException:
            # Whatever preparation opened must never linger or become readable; the keys
            # failed either way, so they fail before the revoke, which may raise too.
            self.fail(call.rows)
            self._revoke([key for key in call.keys if key not in self.committed])
            raise

    def _open(self, call: Call) -> None:
        sizes = [batch.layout.object_size for batch, _ in call.rows]
        exists: list[tuple[GroupBatch, int]] = []
        failed: list[tuple[GroupBatch, int]] = []
        for part in self.options.split(call.nbytes, call.pieces):
            try:
                statuses = self.store.put_session_start(call.keys[part], sizes[part])
                # No answer (e.g. past the RPC timeout): the master may have opened them.
                unknown = [
                    key
                    for key, status in zip(call.keys[part], statuses, strict=True)
                    if status is Status.RPC_FAILED
                ]
            except StoreError as exc:
                log.warning("put_session_start failed: %s", exc)
                statuses = [status_of(exc)] * len(call.keys[part])
                unknown = call.keys[part]
            if unknown:
                self._revoke(unknown)
            self.outcome.no_space |= Status.NO_SPACE in statuses
            _log_failures("put_session_start", [s for s in statuses if s is not Status.EXISTS])
            for placed, status in zip(call.rows[part], statuses, strict=True):
                if status is Status.EXISTS:
                    exists.append(placed)
                elif not status.ok:
                    failed.append(placed)
        for batch, row in exists:  # another writer's since the existence query: see at commit
            batch.alive[row] = False
            self._contested.setdefault(batch.layout.group_id, []).append(row)
        self.fail(failed)

    def write_ranges(self, layer: int) -> None:
        call = self.layer_call(layer)
        if not call.keys:
            return
        failed = self.issue(
            call,
            "put_ranges",
            lambda part: self.store.put_ranges(
                call.keys[part], call.ptrs[part], call.sizes[part], call.offsets[part]
            ),
        )
        self.fail(failed)  # before the revoke, which may raise: they failed either way
        self._revoke([batch.keys[row] for batch, row in failed])

    def moves_bytes_at(self, layer: int) -> bool:
        return True

    def commit(self, batches: Sequence[GroupBatch]) -> None:
        contested = self._take_contested(batches)
        try:
            self._end_sessions(batches)
        except BaseException:
            self.outcome.contended(batch.keys[row] for batch, row in contested)
            raise
        self._settle_contested(contested)

    def _end_sessions(self, batches: Sequence[GroupBatch]) -> None:
        rows = [(batch, int(row)) for batch in batches for row in batch.live()]
        keys = [batch.keys[row] for batch, row in rows]
        if not keys:
            return
        try:
            statuses = self.store.put_session_end(keys)
        except StoreError as exc:
            log.warning("put_session_end of %d keys failed: %s", len(keys), exc)
            statuses = [status_of(exc)] * len(keys)
        except BaseException:
            # An error of the client: not knowing which sessions ended, revoke them all (an
            # ended one is no open session: it stays) and fail every key (`abort` skips a
            # group that got all of its layers).
            self.fail(rows)
            self._revoke(keys)
            raise
        failed = [row for row, status in zip(rows, statuses, strict=True) if not status.ok]
        self._commit_rows(row for row, status in zip(rows, statuses, strict=True) if status.ok)
        self.fail(failed)  # before the revoke, which may raise: they failed either way
        for batch in batches:
            batch.alive[:] = False
        self._revoke([batch.keys[row] for batch, row in failed])

    def drop(self, batches: Sequence[GroupBatch]) -> None:
        opened = [key for batch in batches for key in batch.keys_of(batch.live())]
        self.fail_all(batches)  # before the revoke, which may raise: they failed either way
        contested = self._take_contested(batches)
        self.outcome.contended(batch.keys[row] for batch, row in contested)
        self._revoke(opened)

    def _settle_contested(self, rows: list[tuple[GroupBatch, int]]) -> None:
        """Rows whose session start said EXISTS: another client's session on the key (it
        may yet revoke) or object. Readable now, they count as skipped; else as contended,
        neither stored by us (not announced, not owned) nor failed.

        (Whole puts over another client's session are answered OK and count as stored:
        checking them too would lease every object just written, and a lease keeps it
        from a cache reset's removal and from eviction.)
        """
        if not rows:
            return
        keys = [batch.keys[row] for batch, row in rows]
        try:
            readable = self.store.batch_is_readable(keys)
        except StoreError as exc:
            log.warning("readability check of %d keys failed: %s", len(keys), exc)
            readable = [False] * len(keys)
        for (batch, row), ok in zip(rows, readable, strict=True):
            if ok:
                self._skip(batch, np.array([row]))
            else:
                self.outcome.contended([batch.keys[row]])

    def _take_contested(self, batches: Sequence[GroupBatch]) -> list[tuple[GroupBatch, int]]:
        """The batches' rows another client was writing at the session start."""
        return [
            (batch, row)
            for batch in batches
            for row in self._contested.pop(batch.layout.group_id, [])
        ]

    def _revoke(self, keys: list[str]) -> None:
        self.client.stale.revoke(keys)


class WholeWrites(Writes):
    """One multi-buffer put per group once all of its layers are ready; nothing to open."""

    def open(self) -> None:
        return None

    def write_ranges(self, layer: int) -> None:
        return None  # the bytes move at commit, after every layer's event was awaited

    def write_all(self) -> None:
        """Non-layerwise save: every group in one call."""
        self._missing = {group: set() for group in self._missing}
        self.commit(list(self.batches.values()))

    def commit(self, batches: Sequence[GroupBatch]) -> None:
        self._settle_puts(self.whole_call(batches), self._put)
        for batch in batches:
            batch.alive[:] = False

    def drop(self, batches: Sequence[GroupBatch]) -> None:
        self.fail_all(batches)

    def _settle_puts(self, call: Call, put: Callable[[Call], list[tuple[GroupBatch, int]]]) -> None:
        """Put the call's keys: the failed ones fail, the rest are committed; all settle."""
        if not call.keys:
            return
        self.fail(put(call))
        self._commit_rows((batch, row) for batch, row in call.rows if batch.alive[row])
        for batch, row in call.rows:
            batch.alive[row] = False

    def _put(self, call: Call) -> list[tuple[GroupBatch, int]]:
        return self.issue(call, "batch_put_whole", self._put_whole(call))

    def _put_whole(self, call: Call) -> StoreCall:
        return lambda part: self.store.batch_put_whole(
            call.keys[part], call.ptrs[part], call.sizes[part]
        )


class Reads(Transfers, ABC):
    """A batch of loads, scheduled at `layers` (ascending).

    `ready` is the latest event after which the caches may be written (earlier compute on
    the device must not race the load's writes); every call that writes them waits for it.
    """

    ready: Event | None = None

    @cached_property
    def layers(self) -> list[int]:
        return sorted(self.scheduled_layers())

    def read_all(self) -> None:
        """Non-layerwise load: every layer now."""
        try:
            self.begin()
            for layer in self.layers:
                self.read(layer)
        finally:
            self.end()

    def begin(self) -> None:
        """`start`, failing every block if it raises."""
        self._failing_all_on_error(self.start)

    def read(self, layer: int) -> None:
        """`read_layer`, failing every block if it raises."""
        self._failing_all_on_error(functools.partial(self.read_layer, layer))

    def _failing_all_on_error(self, work: Callable[[], None]) -> None:
        # An exception that is not a store status (a client error) leaves unknown which
        # blocks were written, and whoever waits on a later layer may never see it: every
        # block fails, so that none is used.
        try:
            work()
        except BaseException:
            self.fail_all(self.batches.values(), blamed=False)
            raise

    def caches_writable(self) -> None:
        ready = self.ready
        if ready is not None:
            ready.synchronize()

    @abstractmethod
    def scheduled_layers(self) -> set[int]:
        """The layers whose `read_layer` moves bytes."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def read_layer(self, layer: int) -> None: ...

    @abstractmethod
    def end(self) -> None: ...

    def _read(
        self, call: Call, operation: str, send: StoreCall, after: PartCopy | None = None
    ) -> None:
        """Read the call's keys (`after`: copy each part out of staging once it is in)."""
        if not call.keys:
            return
        if after is not None:
            self.fail(self.issue(call, operation, send, after=after))
            return
        parts = self.options.split(call.nbytes, call.pieces)
        if self.pool is None:
            self.fail(self.issue_serially(call, parts, operation, send))
        else:  # on the pool's get thread: its spin must not outrank Mooncake's own threads
            done = self.pool.gets.submit(self.issue_serially, call, parts, operation, send)
            self.fail(done.result())


class RangedReads(Reads):
    """Get sessions: pin the objects, read each layer's ranges, release after the last."""

    _pinned: Sequence[str] = ()

    def scheduled_layers(self) -> set[int]:
        return {layer for batch in self.batches.values() for layer in batch.layout.layers}

    def start(self) -> None:
        keys = list(dict.fromkeys(key for batch in self.batches.values() for key in batch.keys))
        if not keys:
            return
        try:
            statuses = self.store.get_session_start(keys)
        except StoreError as exc:  # raised before any key was pinned
            log.warning("get_session_start of %d keys failed: %s", len(keys), exc)
            statuses = [status_of(exc)] * len(keys)
        except BaseException:
            # Any other error may come after some keys were pinned: `end` releases them
            # all rather than leave them leased until the master's lease expires.
            self._pinned = keys
            self.client.pins.hold(keys)
            raise
        _log_failures("get_session_start", statuses)
        self.outcome.judged(keys, statuses)
        self._pinned = [key for key, status in zip(keys, statuses, strict=True) if status.ok]
        self.client.pins.hold(self._pinned)
        pinned = set(self._pinned)
        self.fail(
            (batch, int(row))
            for batch in self.batches.values()
            for row in batch.live()
            if batch.keys[row] not in pinned
        )

    def read_layer(self, layer: int) -> None:
        call = self.layer_call(layer)
        if not call.keys:
            return
        self.caches_writable()
        # A get session lives as long as the master's lease (default_kv_lease_ttl, 5 s by
        # default): reads after it expired fail with TRANSFER_FAILED. Pin the keys again
        # and retry once; what fails again (a dead segment) fails for good, and only that
        # is worth a warning (a ranged load longer than the lease meets this every time).
        failed = self.issue(call, "get_ranges", self._get_ranges(call), level=logging.INFO)
        if failed:
            repinned = self._repin(list(dict.fromkeys(batch.keys[row] for batch, row in failed)))
            retry, lost = Call(), []
            for batch, row in failed:
                ranges = batch.layout.layer_ranges(layer)
                if ranges is not None and batch.keys[row] in repinned:
                    retry.add(batch, np.array([row]), ranges)
                else:
                    lost.append((batch, row))
            self.fail(lost)  # judged by the re-pin's answer
            failed = self.issue(retry, "get_ranges (re-pinned)", self._get_ranges(retry))
            self.fail(failed)
            still = {batch.keys[row] for batch, row in failed}
            self.outcome.recovered(key for key in retry.keys if key not in still)

    def _get_ranges(self, call: Call) -> StoreCall:
        return lambda part: self.store.get_ranges(
            call.keys[part], call.ptrs[part], call.sizes[part], call.offsets[part]
        )

    def _repin(self, keys: list[str]) -> set[str]:
        """Pin `keys` again (a start renews a pin in place, to the object the key now
        names, without ending it under the other steps that hold it); those pinned (the
        answer about the others is judged)."""
        try:
            statuses = self.store.get_session_start(keys)
        except StoreError as exc:
            log.warning("re-pinning %d keys failed: %s", len(keys), exc)
            statuses = [status_of(exc)] * len(keys)
        _log_failures("get_session_start (re-pin)", statuses)
        self.outcome.judged(keys, statuses)
        return {key for key, status in zip(keys, statuses, strict=True) if status.ok}

    def end(self) -> None:
        pinned, self._pinned = self._pinned, ()
        unheld = self.client.pins.release(pinned)
        if not unheld:
            return
        try:
            self.store.get_session_end(unheld)
        except StoreError as exc:
            # Every read is in by now: the load stands, and the master drops the pins
            # when their lease lapses.
            log.warning(
                "get_session_end of %d keys failed (their pins lapse with the lease): %s",
                len(unheld), exc,
            )  # fmt: skip


class WholeReads(Reads):
    """One multi-buffer get per group, issued before the group's first layer is needed."""

    def scheduled_layers(self) -> set[int]:
        return {batch.layout.first_layer for batch in self.batches.values()}

    def start(self) -> None:
        return None

    def read_layer(self, layer: int) -> None:
        self.read_groups([b for b in self.batches.values() if b.layout.first_layer == layer])

    def read_groups(self, batches: Sequence[GroupBatch]) -> None:
        call = self.whole_call(batches)
        if call.keys:
            self.caches_writable()
        self._read(call, "batch_get_whole", self._get_whole(call))

    def end(self) -> None:
        return None

    def _get_whole(self, call: Call) -> StoreCall:
        return lambda part: self.store.batch_get_whole(
            call.keys[part], call.ptrs[part], call.sizes[part]
        )


class StagedWrites(WholeWrites):
    """Objects put one piece per key from staging slabs.

    Layer by layer, each layer is gathered into the slabs as soon as it is ready (off the
    model thread, while later layers compute), so a group's commit only moves bytes. A
    whole save gathers part by part, each part put while the next is gathered. Objects the
    pool had no room for at the start move in waves at the commit, through the slabs the
    previous wave freed (gathered then: the caches hold until the step settles); what still
    finds no room moves piece by piece.
    """

    _gathered = False  # write_ranges copied every layer into the slabs staged at open

    def open(self) -> None:
        self.stage()

    def moves_bytes_at(self, layer: int) -> bool:
        """Copies into staging, unless every group with this layer moves in place."""
        return any(
            not batch.layout.contiguous and batch.layout.entries_of_layer(layer)
            for batch in self.batches.values()
        )

    def write_ranges(self, layer: int) -> None:
        self._gathered = True
        for batch in self.batches.values():
            entries = batch.layout.entries_of_layer(layer)
            if entries:
                batch.copy_rows(batch.live(), into_staging=True, entries=entries)

    def commit(self, batches: Sequence[GroupBatch]) -> None:
        try:
            gathered = self._gathered  # the slabs staged at open hold every layer already
            while True:
                put = functools.partial(self._put_staged, gathered=gathered)
                self._settle_puts(self.whole_call(batches, staged_only=True), put)
                self.unstage(batches)  # free the slabs as soon as their objects are stored
                if not self.stage(batches):
                    break
                gathered = False  # a new wave: its slabs are gathered at the put
            super().commit(batches)  # no room at all: piece by piece
        finally:
            self.unstage(batches)

    def drop(self, batches: Sequence[GroupBatch]) -> None:
        super().drop(batches)
        self.unstage(batches)

    def _put_staged(self, call: Call, gathered: bool) -> list[tuple[GroupBatch, int]]:
        """Put staged rows, gathering them part by part first unless the slabs hold them."""
        return self.issue(
            call,
            "batch_put_whole",
            self._put_whole(call),
            before=None if gathered else lambda part: copy_part(call, part, into_staging=True),
        )


class StagedReads(WholeReads):
    """Whole objects fetched at the start, wave by wave: a wave's objects come into staging
    slabs part by part (one piece per key), each part scattered into the caches while the
    next is fetched, and the slabs then serve the next wave. Objects that find no room at
    all are read straight into the caches, piece by piece."""

    def start(self) -> None:
        batches = list(self.batches.values())
        if any(batch.live().size for batch in batches):
            self.caches_writable()
        first: dict[int, int] = {}
        try:
            while self.stage(batches, first):
                call = self.whole_call(batches, staged_only=True)
                self._read(
                    call,
                    "batch_get_whole",
                    self._get_whole(call),
                    after=functools.partial(copy_part, call, into_staging=False),
                )
                for batch in batches:
                    group = batch.layout.group_id
                    first[group] = max(first.get(group, 0), batch.staged_to)
                self.unstage()
            rest = self.whole_call(batches)  # the unstaged tails the last try left
            self._read(rest, "batch_get_whole", self._get_whole(rest))
        finally:
            self.unstage()

    def read_layer(self, layer: int) -> None:
        return None  # every layer landed at the start

    def end(self) -> None:
        self.unstage()


class LayerwiseStagedReads(StagedReads):
    """Whole objects fetched into staging slabs at the step's start, in the background;
    each layer is scattered into the caches when it is due (prefetched a few layers ahead).

    An object holds every layer, so the first layer waits for the whole fetch, but only
    for its own scatter. Once the fetch is in, a second thread scatters layers from the
    last one down while the layer reads go up from the first, so the copies take about
    half the time they would on one thread and still come in the order the forward pass
    needs them. A group's slabs are freed once all of its layers are scattered. A batch
    larger than the pool's free room is loaded whole at the start, in waves.
    """

    _fetch: Future[list[tuple[GroupBatch, int]]] | None = None
    _fetched = False
    _back: Future[None] | None = None  # the second thread's scatter
    _back_tried = False

    def scheduled_layers(self) -> set[int]:
        return {layer for batch in self.batches.values() for layer in batch.layout.layers}

    def start(self) -> None:
        """Fetch in the background (if this raises, every block fails: no fetch fills the
        slabs, and later layers must not scatter them into the caches)."""
        assert self.pool is not None
        self.stage()
        if not all(batch.fully_staged() for batch in self.batches.values()):
            self.unstage()  # more than the free room: every layer now, in waves
            super().start()
            return
        call = self.whole_call(self.batches.values())
        if not call.keys:
            return
        if any(batch.layout.contiguous and batch.alive.any() for batch in self.batches.values()):
            self.caches_writable()  # contiguous objects are fetched straight into the caches
        parts = self.options.split(call.nbytes, call.pieces)
        self._fetch = self.pool.gets.submit(
            self.issue_serially, call, parts, "batch_get_whole", self._get_whole(call)
        )

    def read_layer(self, layer: int) -> None:
        self._await_fetch()
        claims = self._claims
        if claims is None:
            return  # nothing staged: every object came straight into the caches
        mine = claims.claim_front(layer)
        if not self._back_tried and self._fetch is not None and self.pool is not None:
            # Started once the fetch is in (its failed rows failed, none copied) and the
            # first due layer is claimed here: the second thread never holds that one up.
            self._back_tried = True
            try:
                self._back = self.pool.scatters.submit(self._scatter_back, claims)
            except RuntimeError:  # shut down (interpreter exit): every layer is read here
                log.debug("no second thread to scatter layers: the reads scatter them all")
        if mine:
            self._scatter(claims, layer)
        else:
            claims.wait(layer)

    def end(self) -> None:
        try:
            self._await_fetch()
        finally:
            try:
                # Not started (queued behind another step's): it has claimed nothing, and
                # the reads scattered every layer. Started: no slab is freed under it.
                if self._back is not None and not self._back.cancel():
                    self._back.result()
            finally:
                self.unstage()

    @cached_property
    def _staged(self) -> list[GroupBatch]:
        """The batches fetched into slabs (fixed once the fetch started)."""
        return [batch for batch in self.batches.values() if batch.segments]

    @cached_property
    def _claims(self) -> LayerClaims | None:
        """Who scatters which layer (None: nothing staged, nothing to scatter)."""
        if not self._staged:
            return None
        groups = {batch.layout.group_id: batch.layout.layers for batch in self._staged}
        return LayerClaims(self.layers, groups)

    def _scatter(self, claims: LayerClaims, layer: int) -> None:
        """Copy one layer of every staged group into the caches; free the slabs of the
        groups whose last layer this was."""
        self.caches_writable()
        for batch in self._staged:
            entries = batch.layout.entries_of_layer(layer)
            if entries:
                batch.copy_rows(batch.live(), into_staging=False, entries=entries)
        completed = claims.scattered(layer)
        self.unstage([batch for batch in self._staged if batch.layout.group_id in completed])

    def _scatter_back(self, claims: LayerClaims) -> None:
        """The second thread: claim layers from the last one down until the reads meet it."""
        try:
            while (layer := claims.claim_back()) is not None:
                self._scatter(claims, layer)
        except BaseException as exc:
            claims.abandon(exc)
            raise

    def _await_fetch(self) -> None:
        """Wait for the fetch once; its failed keys are failed before any layer is copied."""
        if self._fetch is None or self._fetched:
            return
        self._fetched = True
        try:
            failed = self._fetch.result()
        except BaseException:  # the slabs' contents are unknown
            self.fail_all(self.batches.values(), blamed=False)
            raise
        self.fail(failed)


class LayerClaims:
    """Which of two threads scatters each layer of a staged load, each layer once: one
    claims layers from the first up (the order they are due), the other from the last
    down, until they meet. Also which groups have had all of their layers scattered."""

    def __init__(self, layers: Sequence[int], group_layers: Mapping[int, Iterable[int]]) -> None:
        self._layers = list(layers)
        self._index = {layer: index for index, layer in enumerate(self._layers)}
        self._front = 0  # the first thread claimed every index below this
        self._back = len(self._layers)  # the second thread claimed every index from here on
        self._left = {group: set(layers) for group, layers in group_layers.items()}
        self._scattered: set[int] = set()
        self._done = {layer: threading.Event() for layer in self._layers}
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def claim_front(self, layer: int) -> bool:
        """Whether the caller scatters `layer` (False: the second thread claimed it)."""
        index = self._index[layer]
        with self._lock:
            if index >= self._back:
                return False
            self._front = max(self._front, index + 1)
            return True

    def claim_back(self) -> int | None:
        """The second thread's next layer, from the last down; None once they met."""
        with self._lock:
            if self._back <= self._front:
                return None
            self._back -= 1
            return self._layers[self._back]

    def scattered(self, layer: int) -> set[int]:
        """Record `layer` as scattered; returns the groups whose last layer it was."""
        completed = set()
        with self._lock:
            self._scattered.add(layer)
            for group, left in self._left.items():
                if layer in left:
                    left.discard(layer)
                    if not left:
                        completed.add(group)
        self._done[layer].set()
        return completed

    def wait(self, layer: int) -> None:
        """Until the second thread scattered `layer`; raises if it stopped before."""
        self._done[layer].wait()
        with self._lock:
            if layer not in self._scattered:
                raise RuntimeError(f"layer {layer} was not scattered") from self._error

    def abandon(self, error: BaseException) -> None:
        """The second thread failed: wake whoever waits on a layer it claimed."""
        with self._lock:
            self._error = error
            claimed = self._layers[self._back :]
        for layer in claimed:
            self._done[layer].set()
