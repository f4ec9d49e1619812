"""Moves KV blocks between local cache memory and the store, whole or layer by layer.

The engine owns two worker threads (send, receive), the ownership table of keys it writes,
and per-request completion counts. Every transfer's bookkeeping is released in `finally`
on the worker thread, so a failing store call never hangs `poll_finished`; an exception
that is not a store failure is re-raised to the caller that waits for the transfer.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from hybridkv.transport.batches import group_batches
from hybridkv.transport.device_events import Event
from hybridkv.transport.errors import StoreError
from hybridkv.transport.get_session_pins import GetPins
from hybridkv.transport.layerwise_staged_reads import LayerwiseStagedReads
from hybridkv.transport.layerwise_step import LayerwiseStep
from hybridkv.transport.layout import GroupLayout
from hybridkv.transport.outcome import Outcome
from hybridkv.transport.ownership import (
    BlockTransfer,
    Claim,
    Direction,
    OwnedBlock,
    Ownership,
    RequestTracker,
)
from hybridkv.transport.pipeline import (
    Backlog,
    Granularity,
    Job,
    PipelineOptions,
    PoolPressure,
    Worker,
)
from hybridkv.transport.reads import RangedReads, Reads, StagedReads, WholeReads
from hybridkv.transport.staging import ALIGNMENT, StagingPool
from hybridkv.transport.stale_put_sessions import StaleSessions
from hybridkv.transport.store import Store
from hybridkv.transport.store_calls import ClientSessions, Transfers
from hybridkv.transport.ticket import Ticket
from hybridkv.transport.writes import RangedWrites, StagedWrites, WholeWrites, Writes

log = logging.getLogger(__name__)

SessionT = TypeVar("SessionT", bound=Transfers)


class SessionKinds(NamedTuple):
    """The session classes of one granularity: for layerwise steps, and for whole-object
    saves and loads."""

    step_writes: type[Writes]
    step_reads: type[Reads]
    whole_writes: type[WholeWrites]
    whole_reads: type[Reads]


SESSION_KINDS: dict[Granularity, SessionKinds] = {
    "staged": SessionKinds(StagedWrites, LayerwiseStagedReads, StagedWrites, StagedReads),
    "layer": SessionKinds(RangedWrites, RangedReads, WholeWrites, WholeReads),
    "group": SessionKinds(WholeWrites, WholeReads, WholeWrites, WholeReads),
}


class TransferEngine:
    """Saves and loads the per-block objects of the given groups through `store`.

    `device` says where the caches live. Staged transfers copy them with the host CPU, so
    they need "cpu"; caches on a device use granularity "layer" or "group".
    """

    def __init__(
        self,
        store: Store,
        layouts: Sequence[GroupLayout],
        options: PipelineOptions | None = None,
        device: str = "cpu",
    ) -> None:
        self.store = store
        self.options = options if options is not None else PipelineOptions()
        self.device = device
        staged = self.options.granularity == "staged"
        if staged and device.split(":", 1)[0].lower() != "cpu":
            raise ValueError(
                f"granularity 'staged' copies KV with the host CPU, but the caches are on "
                f"{device!r}: use PipelineOptions(granularity='layer') (RDMA) or 'group'"
            )
        self.staging = StagingPool(store, self.options.staging_bytes) if staged else None
        self.layouts: dict[int, GroupLayout] = {}
        for layout in layouts:
            if layout.group_id in self.layouts:
                raise ValueError(f"group {layout.group_id} has two layouts")
            self.layouts[layout.group_id] = layout
        self._refuse_unstageable_partial()
        self._registered: list[int] = []
        self._register_buffers()
        self.backlog = Backlog(self.options.backlog)
        self._pressure = PoolPressure(self.options.full_pool_pause_s)
        self._ownership = Ownership()
        self._client = ClientSessions(StaleSessions(store), GetPins())
        self._tracker = RequestTracker()
        self._lock = threading.Lock()
        self._closed = False
        self._drained = threading.Event()  # set once `close()` has stopped everything
        self._steps: dict[LayerwiseStep, None] = {}  # open steps, in the order they began
        self._sender = Worker("hybridkv-send")
        self._receiver = Worker("hybridkv-receive")
        self._kinds = SESSION_KINDS[self.options.granularity]
        self._host = _StepHost(self)

    # -- whole objects ----------------------------------------------------------------

    def save(self, transfers: Sequence[BlockTransfer], ready: Event | None = None) -> Ticket:
        """Write whole objects after `ready`; keys the pool already holds are skipped.

        Refused or queued under the engine lock: a `close()` in between would stop the send
        thread after the keys were claimed, and nothing would settle them.
        """
        with self._lock:
            self._check(transfers)
            self._refuse_read_only(transfers)
            claim, outcome = self._claim(transfers)
            writes = self._session(self._kinds.whole_writes, claim.write, outcome)

            def work() -> None:
                try:
                    if ready is not None:
                        ready.synchronize()
                    self._prepare(writes)
                    if writes.prepared:
                        writes.write_all()
                finally:
                    writes.unstage()
                    self._settle(claim, writes)

            job = self._sender.submit(work)
        return Ticket([job], [outcome])

    def load(self, transfers: Sequence[BlockTransfer], ready: Event | None = None) -> Ticket:
        """Read whole objects into local blocks after `ready`; failures name the blocks.

        Refused or queued under the engine lock, as `save` is: a count begun for a load
        that `close()` then keeps off the receive thread would never end.
        """
        with self._lock:
            self._check(transfers)
            outcome = Outcome()
            reads = self._session(
                self._reads_kind(self._kinds.whole_reads, transfers), transfers, outcome
            )
            reads.ready = ready

            def work() -> None:
                try:
                    reads.read_all()
                finally:
                    self._tracker.end("load", _requests(transfers))

            self._tracker.begin("load", _requests(transfers))
            job = self._receiver.submit(work)
        return Ticket([job], [outcome])

    # -- layer by layer ---------------------------------------------------------------

    def begin_layerwise(
        self,
        loads: Sequence[BlockTransfer] = (),
        saves: Sequence[BlockTransfer] = (),
        ready: Event | None = None,
        load_deadline_s: float | None = None,
        save_deadline_s: float | None = None,
    ) -> LayerwiseStep:
        """Start one forward step's transfers: prefetch loads, open saves; loads (saves)
        still running once the step waited `load_deadline_s` (`save_deadline_s`) for them
        are given up (see `LayerwiseStep`).

        Loads write the caches only after `ready` (earlier work on the compute stream, e.g.
        vLLM zeroing new blocks); `wait_layer_loaded(layer, ready)` moves that point on for
        the writes not made yet (a staged load writes every layer soon after its first
        layer is read, under the `ready` in force then).
        """
        with self._lock:  # a step is listed in the order of its claims (see `finish`)
            self._check(loads)
            self._check(saves)
            self._refuse_read_only(saves)
            reads = self._session(self._reads_kind(self._kinds.step_reads, loads), loads, Outcome())
            claim, outcome = self._claim(saves)
            writes = self._session(self._kinds.step_writes, claim.write, outcome)
            self._tracker.begin("load", _requests(loads))
            step = LayerwiseStep(
                self._host, loads, reads, claim, writes, ready, load_deadline_s, save_deadline_s
            )
            self._steps[step] = None
        return step

    # -- queries and lifecycle --------------------------------------------------------

    def batch_is_readable(self, keys: Sequence[str]) -> list[bool]:
        return self.store.batch_is_readable(keys) if keys else []

    def poll_finished(self) -> tuple[set[str], set[str]]:
        """(saved, loaded) request ids whose transfers issued so far all completed."""
        return self._tracker.poll()

    def outstanding(self, direction: Direction) -> int:
        """Transfers (one per block) not yet completed: a leak check for tests."""
        return self._tracker.outstanding(direction)

    def owned_blocks(self, request_id: str) -> dict[tuple[int, int], OwnedBlock]:
        """(group, block index) -> key and current local block this request saved."""
        return self._ownership.owned(request_id)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget what finished requests own (call when vLLM frees them), and their
        completion if `poll_finished` has not reported it yet."""
        self._ownership.release(request_ids)
        self._tracker.forget(request_ids)

    def release_all(self) -> None:
        """Forget what every request owns: after a reset their blocks get new keys."""
        self._ownership.release_all()

    def close(self) -> None:
        """Finish open steps in the order they began, run every queued transfer, stop both
        threads.

        A concurrent `close()` returns only once the first one is done: its caller may
        free the caches or the store as soon as it returns.
        """
        with self._lock:
            closing = self._closed
            self._closed = True
            steps = list(self._steps)
        if closing:
            self._drained.wait()
            return
        try:
            for step in steps:
                try:
                    step.finish()
                except Exception:
                    log.exception("layerwise step failed while the engine closed")
            self._sender.close()
            self._receiver.close()
            self._client.stale.revoke_all()
        finally:
            try:  # whatever raised, once no thread of ours may touch it: the caller frees it
                if self._sender.alive or self._receiver.alive:
                    log.error("transfer threads still running at close: memory left registered")
                else:
                    if self.staging is not None:
                        self.staging.close()
                    self._unregister_buffers()
            finally:
                self._drained.set()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------

    def _register_buffers(self) -> None:
        """Register each distinct memory region once (overlapping regions merged).

        Registration only speeds transfers up (zero-copy); a region the store refuses is
        logged. `close` releases what was registered.
        """
        regions = sorted(
            region
            for layout in self.layouts.values()
            for entry in layout.entries
            if (region := entry.region) is not None
        )
        merged: list[list[int]] = []
        for start, size in regions:
            if merged and start <= merged[-1][0] + merged[-1][1]:
                last = merged[-1]
                last[1] = max(last[1], start + size - last[0])
            else:
                merged.append([start, size])
        for start, size in merged:
            try:
                self.store.register_buffer(start, size)
            except StoreError as exc:
                log.warning("KV cache region %#x+%d not registered: %s", start, size, exc)
            else:
                self._registered.append(start)

    def _unregister_buffers(self) -> None:
        for start in self._registered:
            try:
                self.store.unregister_buffer(start)
            except StoreError as exc:
                log.warning("KV cache region %#x not unregistered: %s", start, exc)
        self._registered = []

    def _check(self, transfers: Sequence[BlockTransfer]) -> None:
        if self._closed:
            raise RuntimeError("TransferEngine is closed")
        by_group: dict[int, list[int]] = {}
        for transfer in transfers:
            if transfer.group not in self.layouts:
                raise ValueError(
                    f"transfer of {transfer.key!r} names group {transfer.group}; "
                    f"known groups: {sorted(self.layouts)}"
                )
            by_group.setdefault(transfer.group, []).append(transfer.local_block)
        for group, blocks in by_group.items():
            self.layouts[group].check_blocks(blocks)

    def _refuse_read_only(self, saves: Sequence[BlockTransfer]) -> None:
        for transfer in saves:
            if self.layouts[transfer.group].read_only:
                raise ValueError(
                    f"save of {transfer.key!r} names layout {transfer.group}, a partial "
                    f"layout of another topology's objects: it only reads"
                )

    def _reads_kind(self, kind: type[Reads], loads: Sequence[BlockTransfer]) -> type[Reads]:
        """`kind`, or ranged reads where it would write a partial layout's objects whole
        into pieces that do not cover them."""
        if kind.reads_partial or all(self.layouts[t.group].covers_object for t in loads):
            return kind
        return RangedReads

    def _refuse_unstageable_partial(self) -> None:
        """A staged engine reads partial objects only through staging: each must fit."""
        if self.staging is None:
            return
        room = self.staging.capacity // ALIGNMENT * ALIGNMENT
        for layout in self.layouts.values():
            if not layout.covers_object and layout.object_size > room:
                raise ValueError(
                    f"partial layout {layout.group_id}: its {layout.object_size} B objects "
                    f"do not fit staging_bytes {self.staging.capacity}; staged reads of "
                    f"partial objects go through staging"
                )

    def _claim(self, transfers: Sequence[BlockTransfer]) -> tuple[Claim, Outcome]:
        """Claim saves, counted as the claim accepts them: the write a rider waits on may
        settle (and end the rider's count) as soon as the claim registered the rider."""
        outcome = Outcome()
        count = functools.partial(self._tracker.begin, "save", _requests(transfers))
        claim = self._ownership.claim(transfers, outcome, accepted=count)
        outcome.skipped(transfer.key for transfer in claim.done)
        self._tracker.end("save", _requests(claim.done))
        return claim, outcome

    def _prepare(self, writes: Writes) -> None:
        """Prepare `writes`, or fail them all at once while a full pool pauses saves."""
        if self._pressure.paused():
            writes.fail_all(writes.batches.values())
        else:
            writes.prepare()

    def _settle(self, claim: Claim, writes: Writes) -> None:
        """Release the writers' and riders' counts whatever happened to the writes; a save
        that ran tells the pool pressure whether the pool had room."""
        if writes.prepared:
            self._pressure.settled(writes.outcome.no_space, took=writes.outcome.moved_any)
        contended = writes.outcome.contended_set()
        for transfer in claim.write:
            committed = transfer.key in writes.committed
            riders = self._ownership.settle(transfer.key, committed)
            rider_requests = [rider.transfer.request_id for rider in riders]
            self._tracker.end("save", [transfer.request_id, *rider_requests])
            for rider in riders:
                rider.outcome.rode(
                    rider.transfer.group,
                    transfer.key,
                    rider.transfer.local_block,
                    committed,
                    contended=transfer.key in contended,
                )

    def _session(
        self, kind: type[SessionT], transfers: Sequence[BlockTransfer], outcome: Outcome
    ) -> SessionT:
        """A session of `kind` over `transfers`, grouped into batches."""
        batches = group_batches(self.layouts, transfers)
        return kind(self.store, self.options, batches, outcome, self.staging, client=self._client)

    def _open_steps_before(self, step: LayerwiseStep) -> list[LayerwiseStep]:
        with self._lock:
            steps = list(self._steps)
        return steps[: steps.index(step)] if step in steps else []

    def _forget_step(self, step: LayerwiseStep) -> None:
        with self._lock:
            self._steps.pop(step, None)


class _StepHost:
    """The engine as its layerwise steps see it (a `StepHost`): worker threads, the backlog,
    and the bookkeeping of a step's end, looked up on the engine at each call."""

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine

    @property
    def backlog(self) -> Backlog:
        return self._engine.backlog

    @property
    def prefetch_layers(self) -> int:
        return self._engine.options.prefetch_layers

    def send(self, work: Callable[[], None]) -> Job:
        return self._engine._sender.submit(work)

    def receive(self, work: Callable[[], None]) -> Job:
        return self._engine._receiver.submit(work)

    def prepare(self, writes: Writes) -> None:
        self._engine._prepare(writes)

    def settle(self, claim: Claim, writes: Writes) -> None:
        self._engine._settle(claim, writes)

    def loads_ended(self, request_ids: Sequence[str]) -> None:
        self._engine._tracker.end("load", request_ids)

    def open_steps_before(self, step: LayerwiseStep) -> list[LayerwiseStep]:
        return self._engine._open_steps_before(step)

    def forget(self, step: LayerwiseStep) -> None:
        self._engine._forget_step(step)


def _requests(transfers: Sequence[BlockTransfer]) -> list[str]:
    return [transfer.request_id for transfer in transfers]
