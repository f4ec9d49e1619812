"""Store calls over group batches: cut to the store's limits, pipelined with staging copies.

`Transfers` is the plumbing every session kind shares (see `writes` and `reads`): it
issues one call's slices, serially or with the copy of one slice overlapping another's
store call, and records each key's fate in the `Outcome`. A store error fails every key of
its call; a call nothing answered (RPC_FAILED) blames no object.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

import numpy as np

from hybridkv.transport.batches import GroupBatch, Rows, Segment
from hybridkv.transport.errors import (
    CalledOff,
    Status,
    StoreClosed,
    StoreError,
    StoreUnavailable,
)
from hybridkv.transport.get_session_pins import GetPins
from hybridkv.transport.layout import Ranges
from hybridkv.transport.outcome import Outcome
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.staging import Slab, StagingPool
from hybridkv.transport.stale_put_sessions import StaleSessions
from hybridkv.transport.store import Store

log = logging.getLogger(__name__)

# A staged call is cut into about this many parts (none under MIN_PART_BYTES), so that the
# copy of one part overlaps the store call of another.
OVERLAP_PARTS = 8
MIN_PART_BYTES = 4 << 20


def log_failures(operation: str, statuses: Sequence[Status], level: int = logging.WARNING) -> None:
    counts = Counter(status.name for status in statuses if not status.ok)
    if counts:
        log.log(level, "%s: %d of %d keys failed: %s", operation, sum(counts.values()),
                len(statuses), dict(counts))  # fmt: skip


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
        self.in_place = False  # some key moves straight from (or into) the caches

    def add(self, batch: GroupBatch, rows: Rows, ranges: Ranges) -> None:
        count = len(rows)
        self.in_place = self.in_place or count > 0
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
        send = self.touching_caches(call, send)
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
        send = self.touching_caches(call, send)
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
                allowed = True
                if before is not None:
                    with self.outcome.cache_access.touching() as allowed:
                        if allowed:
                            before(part)
                call_made = send if allowed else _called_off
                calls.append(self.pool.puts.submit(_guarded, call_made, part, operation))
        finally:
            wait(calls)  # even if a copy failed: a call may still read the slabs
        failed: list[tuple[GroupBatch, int]] = []
        for part, done in zip(parts, calls, strict=True):
            failed += self._settle(call, part, operation, done.result(), level)
        return failed

    def touching_caches(self, call: Call, send: StoreCall) -> StoreCall:
        """`send` as made for `call`: one that moves bytes straight from or into the
        caches is made only while the transfer's cache access is not called off, and is
        waited for by `call_off` (see `CacheAccess`)."""
        if not call.in_place:
            return send

        def touching(part: slice) -> list[Status]:
            with self.outcome.cache_access.touching() as allowed:
                return send(part) if allowed else _called_off(part)

        return touching

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
                with self.outcome.cache_access.touching() as allowed:
                    if allowed:
                        after(part)
                    else:  # given up: the caches' blocks may hold other KV by now
                        self.fail(call.rows[part], blamed=False)
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
        log_failures(operation, statuses, level)
        return failed

    def fail(self, rows: Iterable[tuple[GroupBatch, int]], blamed: bool = True) -> None:
        for batch, row in rows:
            if batch.alive[row]:
                batch.alive[row] = False
                group, block = batch.layout.block_group, int(batch.blocks[row])
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


def _called_off(part: slice) -> list[Status]:
    raise CalledOff(
        f"not made: the transfer's waiter gave up on it, and its {part.stop - part.start} "
        "keys' blocks may hold other KV by now"
    )


def status_of(error: StoreError) -> Status:
    """The status a call that raised `error` leaves each of its keys with: RPC_FAILED
    when nothing answered or no call was made (no word on any object), else OTHER."""
    unanswered = isinstance(error, (StoreUnavailable, StoreClosed, CalledOff))
    return Status.RPC_FAILED if unanswered else Status.OTHER
