"""Saves of one batch of objects: which store calls put which bytes, at which layer.

Three granularities answer the same questions (open, write a layer, commit, drop):
ranged put sessions (each layer's byte ranges on their own, a group commits once all of
its own layers were written), whole multi-buffer puts once a group is complete, and staged
puts of one piece per key from host staging slabs. Nothing is readable before its commit;
a failed key is dropped (its open session revoked) without touching other keys or groups.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from hybridkv.transport.batches import GroupBatch, Rows
from hybridkv.transport.errors import Status, StoreError
from hybridkv.transport.outcome import Outcome
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.staging import StagingPool
from hybridkv.transport.store import Store
from hybridkv.transport.store_calls import (
    Call,
    ClientSessions,
    StoreCall,
    Transfers,
    copy_part,
    log_failures,
    status_of,
)

log = logging.getLogger(__name__)


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
        """Write `layer`'s ranges, and commit the groups it completes. Once the saves were
        called off, nothing more is read from the caches: the groups not complete are
        dropped (those committed before stay)."""
        with self.outcome.cache_access.touching() as allowed:
            if allowed:
                self.write_ranges(layer)
        if not allowed:  # the caches' blocks may hold other KV by now
            self.abort()
            return
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
            log_failures("put_session_start", [s for s in statuses if s is not Status.EXISTS])
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
