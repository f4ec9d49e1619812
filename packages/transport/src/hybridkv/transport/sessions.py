"""Put and get sessions of one batch of objects: which store calls move which bytes.

Three granularities answer the same questions (open, move a layer, commit, drop):
- staged: each object is assembled in registered host staging memory (a memcpy per layer
  as the layer becomes ready) and moves as ONE piece per key, put once all of the group's
  layers are staged; reads fetch whole objects into staging at once and copy each layer
  out when it is needed;
- ranged: put/get sessions; each layer's byte ranges move on their own, a group commits
  once all of its own layers were written; nothing is readable before the commit;
- whole: each group's objects move in one multi-buffer call (one piece per layer), written
  once all of the group's layers are ready and read before its first layer is needed.
All place every entry at the same offset, so each reads what the others wrote. A failed
key is dropped (its open session revoked) without touching other keys or groups.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np

from hybridkv.transport.errors import Status, StoreError
from hybridkv.transport.events import Event
from hybridkv.transport.layout import BlockIds, GroupLayout, Ranges
from hybridkv.transport.ownership import BlockTransfer
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.staging import Bytes, Slab, StagingPool, host_view
from hybridkv.transport.store import Store

log = logging.getLogger(__name__)

Rows = np.ndarray  # indices into a GroupBatch


class TransferResult(msgspec.Struct):
    """What a save or load achieved. Failed local blocks hold no valid KV."""

    failed_blocks: dict[int, set[int]] = msgspec.field(default_factory=dict)
    failed_keys: list[str] = msgspec.field(default_factory=list)
    skipped_keys: list[str] = msgspec.field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed_keys

    def merged(self, other: TransferResult) -> TransferResult:
        failed = {group: set(blocks) for group, blocks in self.failed_blocks.items()}
        for group, blocks in other.failed_blocks.items():
            failed.setdefault(group, set()).update(blocks)
        return TransferResult(
            failed_blocks=failed,
            failed_keys=self.failed_keys + other.failed_keys,
            skipped_keys=self.skipped_keys + other.skipped_keys,
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

    def ride(self, count: int) -> None:
        with self._lock:
            self._riding += count

    def rode(self, group: int, key: str, block: int, committed: bool) -> None:
        """The write this outcome rode on settled: its failure is this outcome's too."""
        with self._lock:
            if not committed:
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

    def skipped(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._result.skipped_keys.extend(keys)

    def failed(self, group: int, keys: Iterable[str], blocks: Iterable[int]) -> None:
        with self._lock:
            self._result.failed_keys.extend(keys)
            self._result.failed_blocks.setdefault(group, set()).update(blocks)

    def failed_blocks(self) -> dict[int, set[int]]:
        with self._lock:
            return {group: set(blocks) for group, blocks in self._result.failed_blocks.items()}

    def result(self) -> TransferResult:
        with self._lock:
            done = msgspec.structs.replace(self._result)
            done.seconds = time.perf_counter() - self._started
            return done


def _log_failures(operation: str, statuses: Sequence[Status]) -> None:
    counts = Counter(status.name for status in statuses if not status.ok)
    if counts:
        log.warning("%s: %d of %d keys failed: %s", operation, sum(counts.values()),
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

    def live(self) -> Rows:
        return np.flatnonzero(self.alive)

    def keys_of(self, rows: Iterable[int]) -> list[str]:
        return [self.keys[row] for row in rows]

    def stage(self, pool: StagingPool) -> None:
        """Give runs of rows a slab each (at most the pool's size); no room: unstaged."""
        count, width = len(self.keys), self.layout.object_size
        per_slab = max(1, pool.capacity // width)
        for start in range(0, count, per_slab):
            stop = min(count, start + per_slab)
            self.segments.append(Segment(start, stop, pool.allocate(stop - start, width)))

    def unstage(self, pool: StagingPool) -> None:
        for segment in self.segments:
            if segment.slab is not None:
                pool.free(segment.slab)
        self.segments = []

    def copy_layer(self, layer: int, into_staging: bool) -> None:
        """Copy one layer of the live staged rows between the caches and their slabs."""
        for index in self.layout.entries_of_layer(layer):
            entry = self.layout.entries[index]
            view = self._views.get(index)
            if view is None:
                view = self._views[index] = host_view(entry, self.blocks)
            start = self.layout.offset_of(index)
            stop = start + entry.block_bytes
            for segment in self.segments:
                if segment.slab is None:
                    continue
                rows = np.flatnonzero(self.alive[segment.start : segment.stop])
                staged = segment.slab.array[:, start:stop]
                blocks = self.blocks[segment.start + rows]
                if into_staging:
                    staged[rows] = view[blocks]
                else:
                    view[blocks] = staged[rows]


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


class Transfers:
    """Shared plumbing of every session kind: issuing split calls and recording fates."""

    def __init__(
        self,
        store: Store,
        options: PipelineOptions,
        batches: dict[int, GroupBatch],
        outcome: Outcome,
        pool: StagingPool | None = None,
    ) -> None:
        self.store = store
        self.options = options
        self.batches = batches
        self.outcome = outcome
        self.pool = pool

    def stage(self) -> None:
        """Give every batch staging slabs where the pool has room (staged modes only)."""
        if self.pool is not None:
            for batch in self.batches.values():
                batch.stage(self.pool)

    def unstage(self, batches: Iterable[GroupBatch] | None = None) -> None:
        """Hand slabs back to the pool; safe to call more than once."""
        if self.pool is not None:
            for batch in self.batches.values() if batches is None else batches:
                batch.unstage(self.pool)

    def issue(self, call: Call, operation: str, send: StoreCall) -> list[tuple[GroupBatch, int]]:
        """Run `send` over the limit-sized slices of `call`; returns the rows that failed."""
        failed: list[tuple[GroupBatch, int]] = []
        for part in self.options.split(call.nbytes, call.pieces):
            try:
                statuses = send(part)
            except StoreError as exc:
                log.warning("%s of %d keys failed: %s", operation, len(call.keys[part]), exc)
                statuses = [Status.OTHER] * len(call.keys[part])
            for (batch, row), nbytes, status in zip(
                call.rows[part], call.nbytes[part], statuses, strict=True
            ):
                if status.ok:
                    self.outcome.moved(nbytes)
                else:
                    failed.append((batch, row))
            _log_failures(operation, statuses)
        return failed

    def fail(self, rows: Iterable[tuple[GroupBatch, int]]) -> None:
        for batch, row in rows:
            if batch.alive[row]:
                batch.alive[row] = False
                group, block = batch.layout.group_id, int(batch.blocks[row])
                self.outcome.failed(group, [batch.keys[row]], [block])

    def fail_all(self, batches: Iterable[GroupBatch]) -> None:
        self.fail((batch, int(row)) for batch in batches for row in batch.live())

    def layer_call(self, layer: int) -> Call:
        call = Call()
        for batch in self.batches.values():
            ranges = batch.layout.layer_ranges(layer)
            if ranges is not None:
                call.add(batch, batch.live(), ranges)
        return call

    def whole_call(self, batches: Iterable[GroupBatch]) -> Call:
        """Whole objects: one piece per staged key, one piece per entry otherwise."""
        call = Call()
        for batch in batches:
            if not batch.segments:
                call.add(batch, batch.live(), batch.layout.whole)
            for segment in batch.segments:
                live = segment.start + np.flatnonzero(batch.alive[segment.start : segment.stop])
                if segment.slab is None:
                    call.add(batch, live, batch.layout.whole)
                else:
                    call.add_staged(batch, live, segment, segment.slab)
        return call


class Writes(Transfers, ABC):
    """A batch of saves; a group completes once all of its own layers were written."""

    def __init__(
        self,
        store: Store,
        options: PipelineOptions,
        batches: dict[int, GroupBatch],
        outcome: Outcome,
        pool: StagingPool | None = None,
    ) -> None:
        super().__init__(store, options, batches, outcome, pool)
        self._missing = {group: set(batch.layout.layers) for group, batch in batches.items()}
        self.committed: set[str] = set()

    @property
    def layers(self) -> set[int]:
        return {layer for missing in self._missing.values() for layer in missing}

    def prepare(self) -> None:
        """Skip keys the pool already holds (one existence query), then open the rest."""
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
            # Whatever preparation opened must never linger or become readable.
            self._revoke([key for key in call.keys if key not in self.committed])
            self.fail(call.rows)
            raise

    def _open(self, call: Call) -> None:
        sizes = [batch.layout.object_size for batch, _ in call.rows]
        exists: list[tuple[GroupBatch, int]] = []
        failed: list[tuple[GroupBatch, int]] = []
        for part in self.options.split(call.nbytes, call.pieces):
            try:
                statuses = self.store.put_session_start(call.keys[part], sizes[part])
            except StoreError as exc:
                log.warning("put_session_start failed: %s", exc)
                self._revoke(call.keys[part])
                statuses = [Status.OTHER] * len(call.keys[part])
            for placed, status in zip(call.rows[part], statuses, strict=True):
                if status is Status.EXISTS:
                    exists.append(placed)
                elif not status.ok:
                    failed.append(placed)
        for batch, row in exists:  # committed by another writer since the existence query
            self._skip(batch, np.array([row]))
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
        self._revoke([batch.keys[row] for batch, row in failed])
        self.fail(failed)

    def commit(self, batches: Sequence[GroupBatch]) -> None:
        rows = [(batch, int(row)) for batch in batches for row in batch.live()]
        keys = [batch.keys[row] for batch, row in rows]
        if not keys:
            return
        try:
            statuses = self.store.put_session_end(keys)
        except StoreError as exc:
            log.warning("put_session_end of %d keys failed: %s", len(keys), exc)
            statuses = [Status.OTHER] * len(keys)
        failed = [row for row, status in zip(rows, statuses, strict=True) if not status.ok]
        self._commit_rows(row for row, status in zip(rows, statuses, strict=True) if status.ok)
        self._revoke([batch.keys[row] for batch, row in failed])
        self.fail(failed)
        for batch in batches:
            batch.alive[:] = False

    def drop(self, batches: Sequence[GroupBatch]) -> None:
        self._revoke([key for batch in batches for key in batch.keys_of(batch.live())])
        self.fail_all(batches)

    def _revoke(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            self.store.put_session_revoke(keys)
        except StoreError as exc:
            log.warning("put_session_revoke of %d keys failed: %s", len(keys), exc)


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
        call = self.whole_call(batches)
        if not call.keys:
            return
        failed = self.issue(
            call,
            "batch_put_whole",
            lambda part: self.store.batch_put_whole(
                call.keys[part], call.ptrs[part], call.sizes[part]
            ),
        )
        self.fail(failed)
        self._commit_rows((batch, int(row)) for batch in batches for row in batch.live())
        for batch in batches:
            batch.alive[:] = False

    def drop(self, batches: Sequence[GroupBatch]) -> None:
        self.fail_all(batches)


class Reads(Transfers, ABC):
    """A batch of loads, scheduled at `layers` (ascending).

    `ready` is the latest event after which the caches may be written (earlier compute on
    the device must not race the load's writes); every call that writes them waits for it.
    """

    layers: list[int]
    ready: Event | None = None

    def read_all(self) -> None:
        """Non-layerwise load: every layer now."""
        try:
            self.start()
            for layer in self.layers:
                self.read_layer(layer)
        finally:
            self.end()

    def caches_writable(self) -> None:
        ready = self.ready
        if ready is not None:
            ready.synchronize()

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def read_layer(self, layer: int) -> None: ...

    @abstractmethod
    def end(self) -> None: ...

    def _read(self, call: Call, operation: str, send: StoreCall) -> None:
        if call.keys:
            self.fail(self.issue(call, operation, send))


class RangedReads(Reads):
    """Get sessions: pin the objects, read each layer's ranges, release after the last."""

    def __init__(
        self,
        store: Store,
        options: PipelineOptions,
        batches: dict[int, GroupBatch],
        outcome: Outcome,
        pool: StagingPool | None = None,
    ) -> None:
        super().__init__(store, options, batches, outcome, pool)
        self.layers = sorted({layer for b in batches.values() for layer in b.layout.layers})
        self._pinned: list[str] = []

    def start(self) -> None:
        keys = list(dict.fromkeys(key for batch in self.batches.values() for key in batch.keys))
        if not keys:
            return
        try:
            statuses = self.store.get_session_start(keys)
        except StoreError as exc:
            log.warning("get_session_start of %d keys failed: %s", len(keys), exc)
            statuses = [Status.OTHER] * len(keys)
        _log_failures("get_session_start", statuses)
        self._pinned = [key for key, status in zip(keys, statuses, strict=True) if status.ok]
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
        failed = self.issue(call, "get_ranges", self._get_ranges(call))
        if failed:
            # A get session lives as long as the master's lease (default_kv_lease_ttl, 5 s
            # by default): reads after it expired fail with TRANSFER_FAILED. Pin the keys
            # again and retry once; what fails again (a dead segment) fails for good.
            retry = Call()
            for batch, row in failed:
                ranges = batch.layout.layer_ranges(layer)
                if ranges is not None:
                    retry.add(batch, np.array([row]), ranges)
            self._repin(retry.keys)
            self.fail(self.issue(retry, "get_ranges (re-pinned)", self._get_ranges(retry)))

    def _get_ranges(self, call: Call) -> StoreCall:
        return lambda part: self.store.get_ranges(
            call.keys[part], call.ptrs[part], call.sizes[part], call.offsets[part]
        )

    def _repin(self, keys: list[str]) -> None:
        try:
            self.store.get_session_end(keys)
            self.store.get_session_start(keys)
        except StoreError as exc:
            log.warning("re-pinning %d keys failed: %s", len(keys), exc)

    def end(self) -> None:
        pinned, self._pinned = self._pinned, []
        if pinned:
            self.store.get_session_end(pinned)


class WholeReads(Reads):
    """One multi-buffer get per group, issued before the group's first layer is needed."""

    def __init__(
        self,
        store: Store,
        options: PipelineOptions,
        batches: dict[int, GroupBatch],
        outcome: Outcome,
        pool: StagingPool | None = None,
    ) -> None:
        super().__init__(store, options, batches, outcome, pool)
        self.layers = sorted({batch.layout.first_layer for batch in batches.values()})

    def start(self) -> None:
        return None

    def read_layer(self, layer: int) -> None:
        self.read_groups([b for b in self.batches.values() if b.layout.first_layer == layer])

    def read_groups(self, batches: Sequence[GroupBatch]) -> None:
        call = self.whole_call(batches)
        if call.keys:
            self.caches_writable()
        self._read(
            call,
            "batch_get_whole",
            lambda part: self.store.batch_get_whole(
                call.keys[part], call.ptrs[part], call.sizes[part]
            ),
        )

    def end(self) -> None:
        return None


class StagedWrites(WholeWrites):
    """Objects assembled in staging slabs layer by layer, put one piece per key per group."""

    def open(self) -> None:
        self.stage()

    def write_ranges(self, layer: int) -> None:
        for group, missing in self._missing.items():
            if layer in missing:
                self.batches[group].copy_layer(layer, into_staging=True)

    def write_all(self) -> None:
        for batch in self.batches.values():
            for layer in batch.layout.layers:
                batch.copy_layer(layer, into_staging=True)
        super().write_all()

    def commit(self, batches: Sequence[GroupBatch]) -> None:
        try:
            super().commit(batches)
        finally:
            self.unstage(batches)  # free the slabs as soon as their group is stored

    def drop(self, batches: Sequence[GroupBatch]) -> None:
        super().drop(batches)
        self.unstage(batches)


class StagedReads(Reads):
    """Whole objects fetched into staging slabs at once (one piece per key); each layer
    is copied into the caches when it is read. Objects without a slab are read straight
    into the caches, piece by piece, at the start."""

    def __init__(
        self,
        store: Store,
        options: PipelineOptions,
        batches: dict[int, GroupBatch],
        outcome: Outcome,
        pool: StagingPool | None = None,
    ) -> None:
        super().__init__(store, options, batches, outcome, pool)
        self.layers = sorted({layer for b in batches.values() for layer in b.layout.layers})

    def start(self) -> None:
        self.stage()
        call = self.whole_call(self.batches.values())
        if any(segment.slab is None for b in self.batches.values() for segment in b.segments):
            self.caches_writable()
        self._read(
            call,
            "batch_get_whole",
            lambda part: self.store.batch_get_whole(
                call.keys[part], call.ptrs[part], call.sizes[part]
            ),
        )

    def read_layer(self, layer: int) -> None:
        self.caches_writable()
        for batch in self.batches.values():
            batch.copy_layer(layer, into_staging=False)

    def end(self) -> None:
        self.unstage()
