"""Moves KV blocks between local cache memory and the store, whole or layer by layer.

The engine owns two worker threads (send, receive), the ownership table of keys it writes,
and per-request completion counts. Every transfer's bookkeeping is released in `finally`
on the worker thread, so a failing store call never hangs `poll_finished`; an exception
that is not a store failure is re-raised to the caller that waits for the transfer.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
from collections.abc import Sequence

from hybridkv.transport.errors import StoreError
from hybridkv.transport.events import Event
from hybridkv.transport.layout import GroupLayout
from hybridkv.transport.ownership import (
    BlockTransfer,
    Claim,
    Direction,
    OwnedBlock,
    Ownership,
    RequestTracker,
)
from hybridkv.transport.pins import GetPins
from hybridkv.transport.pipeline import Backlog, Job, PipelineOptions, PoolPressure, Worker
from hybridkv.transport.sessions import (
    ClientSessions,
    LayerwiseStagedReads,
    Outcome,
    RangedReads,
    RangedWrites,
    Reads,
    StagedReads,
    StagedWrites,
    TransferResult,
    WholeReads,
    WholeWrites,
    Writes,
    group_batches,
)
from hybridkv.transport.staging import StagingPool
from hybridkv.transport.stale import StaleSessions
from hybridkv.transport.store import Store

log = logging.getLogger(__name__)

# Layerwise steps and whole-object save/load, per granularity.
_WRITES: dict[str, type[Writes]] = {
    "staged": StagedWrites, "layer": RangedWrites, "group": WholeWrites
}  # fmt: skip
_READS: dict[str, type[Reads]] = {
    "staged": LayerwiseStagedReads, "layer": RangedReads, "group": WholeReads
}  # fmt: skip
_WHOLE_WRITES: dict[str, type[WholeWrites]] = {
    "staged": StagedWrites, "layer": WholeWrites, "group": WholeWrites
}  # fmt: skip
_WHOLE_READS: dict[str, type[Reads]] = {
    "staged": StagedReads, "layer": WholeReads, "group": WholeReads
}  # fmt: skip


class Ticket:
    """A transfer running in the background; `wait()` returns its result or raises.

    Saves that ride on another transfer's write of the same key complete when that write
    settles, and carry its failure: one riding on an open layerwise step's write waits
    for that step's `finish()`, so the thread that finishes the step must not wait for
    the ticket first (the integration never mixes whole saves with open steps).
    """

    def __init__(self, jobs: Sequence[Job], outcomes: Sequence[Outcome]) -> None:
        self._jobs = list(jobs)
        self._outcomes = list(outcomes)

    @property
    def done(self) -> bool:
        """True once every job ran and every write this rides on settled."""
        jobs_done = all(job.done for job in self._jobs)
        return jobs_done and not any(outcome.riding for outcome in self._outcomes)

    def blamed_keys(self) -> list[str]:
        """Keys the store failed so far (see `TransferResult.blamed_keys`), also once
        `wait()` raised: what a load that raised still knows to distrust."""
        return [key for outcome in self._outcomes for key in outcome.result().blamed_keys]

    def wait(self, timeout: float | None = None) -> TransferResult:
        for job in self._jobs:
            job.wait(timeout)
        result = TransferResult()
        for outcome in self._outcomes:
            outcome.wait_riders(timeout)
            result = result.merged(outcome.result())
        return result


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

    # -- whole objects ----------------------------------------------------------------

    def save(self, transfers: Sequence[BlockTransfer], ready: Event | None = None) -> Ticket:
        """Write whole objects after `ready`; keys the pool already holds are skipped.

        Refused or queued under the engine lock: a `close()` in between would stop the send
        thread after the keys were claimed, and nothing would settle them.
        """
        with self._lock:
            self._check(transfers)
            claim, outcome = self._claim(transfers)
            writes = _WHOLE_WRITES[self.options.granularity](
                self.store,
                self.options,
                group_batches(self.layouts, claim.write),
                outcome,
                self.staging,
                client=self._client,
            )

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
            reads = _WHOLE_READS[self.options.granularity](
                self.store,
                self.options,
                group_batches(self.layouts, transfers),
                outcome,
                self.staging,
                client=self._client,
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
    ) -> LayerwiseStep:
        """Start one forward step's transfers: prefetch loads, open saves.

        Loads write the caches only after `ready` (earlier work on the compute stream, e.g.
        vLLM zeroing new blocks); `wait_layer_loaded(layer, ready)` moves that point on for
        the writes not made yet (a staged load writes every layer soon after its first
        layer is read, under the `ready` in force then).
        """
        with self._lock:  # a step is listed in the order of its claims (see `finish`)
            self._check(loads)
            self._check(saves)
            step = LayerwiseStep(self, loads, saves, ready)
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

    def _end_steps_before(self, step: LayerwiseStep) -> None:
        """End every step still open that began before `step`: any write it rides on."""
        with self._lock:
            steps = list(self._steps)
        for earlier in steps[: steps.index(step)] if step in steps else []:
            earlier._end()

    def _forget_step(self, step: LayerwiseStep) -> None:
        with self._lock:
            self._steps.pop(step, None)


class LayerwiseStep:
    """One forward step's layer-by-layer transfers.

    Call `wait_layer_loaded(L)` before layer L reads its KV, `save_layer(L, event)` after
    layer L wrote it (event recorded on its stream), `checkpoint()` at attention
    boundaries, and `finish()` once the step is over.

    The step ends (its end jobs are queued) once: at its first `finish()`, or at the
    `finish()` of a later step still riding on an open step's writes; then `save_layer`
    raises.
    """

    def __init__(
        self,
        engine: TransferEngine,
        loads: Sequence[BlockTransfer],
        saves: Sequence[BlockTransfer],
        ready: Event | None = None,
    ) -> None:
        self._engine = engine
        options = engine.options
        self._load_outcome = Outcome()
        self._reads = _READS[options.granularity](
            engine.store,
            options,
            group_batches(engine.layouts, loads),
            self._load_outcome,
            engine.staging,
            client=engine._client,
        )
        self._reads.ready = ready
        self._loads = list(loads)
        self._claim, self._save_outcome = engine._claim(saves)
        self._writes = _WRITES[options.granularity](
            engine.store,
            options,
            group_batches(engine.layouts, self._claim.write),
            self._save_outcome,
            engine.staging,
            client=engine._client,
        )
        self._save_layers = self._writes.layers
        self._group_layers = self._writes.group_layers()
        self._saved: set[int] = set()
        # Saved layers whose write is bookkeeping only, for the next hand-over to do.
        self._deferred: list[tuple[int, Event]] = []
        self._read_jobs: list[Job] = []
        self._jobs: list[Job] = []
        self._lock = threading.Lock()  # the end jobs are queued once, after every other job
        self._ended = False
        self._result: TransferResult | None = None
        engine._tracker.begin("load", _requests(loads))
        if self._reads.batches:
            self._jobs.append(engine._receiver.submit(self._reads.begin))
            self._schedule_reads(options.prefetch_layers + 1)
        self._jobs.append(engine._sender.submit(functools.partial(engine._prepare, self._writes)))

    def wait_layer_loaded(self, layer: int, ready: Event | None = None) -> dict[int, set[int]]:
        """Block until every load this layer needs is done; returns failed local blocks.

        The failed blocks (group -> local blocks, cumulative) hold no valid KV: the caller
        must not use them and reports them to vLLM for recomputation. `ready`, if given,
        is the caches' current ready point: loads that have not written yet wait for it.
        """
        if ready is not None:
            self._reads.ready = ready
        needed = bisect.bisect_right(self._reads.layers, layer)
        with self._lock:
            self._schedule_reads(needed + self._engine.options.prefetch_layers)
        if needed:
            self._jobs[0].wait()  # the session start
            for job in self._read_jobs[:needed]:  # a caller may skip layers: check each
                job.wait()  # raises the first error
        return self._load_outcome.failed_blocks()

    def blamed_loads(self) -> list[str]:
        """Keys whose reads the store failed so far (a status about them): the objects to
        distrust.

        Unlike `wait_layer_loaded`, safe once the step raised. Blocks a client error
        failed (every block its call or any later layer touched), or a call the master
        did not answer, are failed but not counted here: no object is at fault there.
        """
        return self._load_outcome.result().blamed_keys

    def save_layer(self, layer: int, event: Event) -> None:
        """Queue layer `layer`'s saves; they read its KV only after `event`.

        A layer that moves no bytes yet (its groups are put whole once complete, and it
        completes none) is not handed to the send thread: the next hand-over waits for its
        event and counts it written, so a step of one-piece objects wakes that thread once
        per group instead of once per layer.
        """
        self._check_open()
        if layer in self._saved:
            raise ValueError(f"layer {layer} was already saved in this step")
        self._saved.add(layer)
        if layer not in self._save_layers:
            return
        pending = [*self._deferred, (layer, event)]
        if not self._writes.moves_bytes_at(layer) and not any(
            layer in layers and layers <= self._saved for layers in self._group_layers
        ):
            self._deferred = pending
            return
        self._deferred = []
        backlog = self._engine.backlog
        backlog.acquire()

        def work() -> None:
            try:
                for saved, ready in pending:
                    ready.synchronize()
                    self._writes.write_layer(saved)
            finally:
                backlog.release()

        try:
            with self._lock:
                self._check_open()
                self._jobs.append(self._engine._sender.submit(work))
        except BaseException:
            backlog.release()
            raise

    def checkpoint(self) -> None:
        """At an attention boundary: at most `backlog` saves in flight; surface errors."""
        self._engine.backlog.wait_at_most(self._engine.backlog.bound)
        for job in self._jobs:
            if job.done and job.error is not None:
                raise job.error

    def finish(self) -> TransferResult:
        """Complete every load, commit or revoke every save, then report (or raise).

        Safe to call again or from another thread (`close()`): every call waits for the
        same end jobs and returns the same result or raises the same error. Saves still
        riding once this step's jobs ran ride on a write of a step begun earlier and still
        open, whose end jobs only its own `finish()` would queue: every step begun before
        this one is ended then (groups they have not saved yet are dropped). In order
        (vLLM's one step at a time) none is open and nothing changes.
        """
        engine = self._engine
        jobs = self._end()
        errors = []
        for job in jobs:
            try:
                job.wait()
            except BaseException as exc:
                errors.append(exc)
        if self._save_outcome.riding:
            engine._end_steps_before(self)
        self._save_outcome.wait_riders()
        engine._forget_step(self)
        with self._lock:
            if self._result is None:
                self._result = self._load_outcome.result().merged(self._save_outcome.result())
            result = self._result
        if errors:
            raise errors[0]
        return result

    def _end(self) -> list[Job]:
        """Queue the end jobs (finish every load, commit or revoke every save) once;
        returns every job of the step."""
        engine = self._engine

        def end_reads() -> None:
            try:
                self._reads.end()
            finally:
                self._reads.unstage()
                engine._tracker.end("load", _requests(self._loads))

        def end_writes() -> None:
            try:
                self._writes.abort()
            finally:
                self._writes.unstage()
                engine._settle(self._claim, self._writes)

        with self._lock:
            if not self._ended:
                self._ended = True
                self._schedule_reads(len(self._reads.layers))
                self._jobs.append(engine._receiver.submit(end_reads))
                self._jobs.append(engine._sender.submit(end_writes))
            return list(self._jobs)

    def _check_open(self) -> None:
        if self._ended:
            raise RuntimeError("the layerwise step has ended: finish() was called")

    def _schedule_reads(self, count: int) -> None:
        """Queue the read jobs of the first `count` layers; callers hold `self._lock` or
        run before the step is shared (its end schedules every layer)."""
        layers = self._reads.layers
        while len(self._read_jobs) < min(count, len(layers)):
            layer = layers[len(self._read_jobs)]
            job = self._engine._receiver.submit(functools.partial(self._reads.read, layer))
            self._read_jobs.append(job)
            self._jobs.append(job)


def _requests(transfers: Sequence[BlockTransfer]) -> list[str]:
    return [transfer.request_id for transfer in transfers]
