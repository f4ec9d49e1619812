"""Loads of one batch of objects: which store calls get which bytes, before which layer.

Ranged get sessions pin the objects and read each layer's ranges when it is due (re-pinning
once when the master's lease ran out); whole reads get a group's objects in one
multi-buffer call before its first layer; staged reads fetch whole objects into host
staging slabs, wave by wave, and scatter them into the caches. A call that raises fails
every block of the batch: none is used whose bytes are unknown. Partial layouts (parts of
another topology's objects) are read as ranges or through staging, never whole in place.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np

from hybridkv.transport.batches import GroupBatch
from hybridkv.transport.device_events import Event
from hybridkv.transport.errors import StoreError
from hybridkv.transport.store_calls import (
    Call,
    PartCopy,
    StoreCall,
    Transfers,
    copy_part,
    log_failures,
    status_of,
)

log = logging.getLogger(__name__)


class Reads(Transfers, ABC):
    """A batch of loads, scheduled at `layers` (ascending).

    `ready` is the latest event after which the caches may be written (earlier compute on
    the device must not race the load's writes); every call that writes them waits for it.
    """

    ready: Event | None = None
    # Whether this kind reads layouts that do not cover their objects (partial layouts)
    # without writing outside their pieces.
    reads_partial: bool = True

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
        log_failures("get_session_start", statuses)
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
        log_failures("get_session_start (re-pin)", statuses)
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

    reads_partial = False  # a whole get writes the object's bytes into the pieces in order

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


class StagedReads(WholeReads):
    """Whole objects fetched at the start, wave by wave: a wave's objects come into staging
    slabs part by part (one piece per key), each part scattered into the caches while the
    next is fetched, and the slabs then serve the next wave. Objects that find no room at
    all are read straight into the caches, piece by piece, except those of partial
    layouts: they fail (vLLM recomputes them), since a whole read would write bytes the
    pieces do not want."""

    reads_partial = True

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
            self._fail_unstaged_partial(batches)
            rest = self.whole_call(batches)  # the unstaged tails the last try left
            self._read(rest, "batch_get_whole", self._get_whole(rest))
        finally:
            self.unstage()

    def read_layer(self, layer: int) -> None:
        return None  # every layer landed at the start

    def end(self) -> None:
        self.unstage()

    def _fail_unstaged_partial(self, batches: Sequence[GroupBatch]) -> None:
        """Fail the rows `whole_call` would read in place (those of the last try's
        unstaged segments, or every live row of a batch never staged) where that would
        write a partial layout's objects whole."""
        unstaged = []
        for batch in batches:
            if batch.layout.covers_object:
                continue
            if not batch.segments:
                unstaged += [(batch, int(row)) for row in batch.live()]
            for segment in batch.segments:
                if segment.slab is None:
                    rows = segment.start + np.flatnonzero(batch.alive[segment.start : segment.stop])
                    unstaged += [(batch, int(row)) for row in rows]
        if unstaged:
            log.warning(
                "%d partial objects found no staging room: their blocks fail (recomputed)",
                len(unstaged),
            )
            self.fail(unstaged, blamed=False)
