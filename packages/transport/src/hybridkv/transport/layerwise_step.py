"""One forward step's layer-by-layer transfers, and the little of the engine it needs.

The engine claims the step's saves, builds its reads and writes, and hands it a `StepHost`
(its two worker threads, the save backlog, and the bookkeeping that ends a step's loads and
settles its saves) instead of itself: the step sees nothing else of the engine. The step
queues the reads a few layers ahead of the forward pass, hands each saved layer to the
send thread, and queues its end jobs once.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from hybridkv.transport.device_events import Event
from hybridkv.transport.outcome import TransferResult
from hybridkv.transport.ownership import BlockTransfer, Claim
from hybridkv.transport.pipeline import Backlog, Job
from hybridkv.transport.reads import Reads
from hybridkv.transport.writes import Writes


class StepHost(Protocol):
    """What a layerwise step needs of the engine that began it, and nothing more."""

    @property
    def backlog(self) -> Backlog:
        """The bound on layer saves in flight, shared by every step."""

    @property
    def prefetch_layers(self) -> int:
        """How many layers the reads run ahead of the one being waited for."""

    def send(self, work: Callable[[], None]) -> Job:
        """Queue `work` on the send thread."""

    def receive(self, work: Callable[[], None]) -> Job:
        """Queue `work` on the receive thread."""

    def prepare(self, writes: Writes) -> None:
        """Open `writes`, or fail them all at once while a full pool pauses saves."""

    def settle(self, claim: Claim, writes: Writes) -> None:
        """Release the counts of `claim`'s writes and of the saves riding on them."""

    def loads_ended(self, request_ids: Sequence[str]) -> None:
        """The loads of these requests completed (one id per block)."""

    def open_steps_before(self, step: LayerwiseStep) -> list[LayerwiseStep]:
        """The steps still open that began before `step`, in the order they began."""

    def forget(self, step: LayerwiseStep) -> None:
        """`step` has finished: `close()` need not finish it."""


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
        host: StepHost,
        loads: Sequence[BlockTransfer],
        reads: Reads,
        claim: Claim,
        writes: Writes,
        ready: Event | None = None,
    ) -> None:
        """`reads` of `loads` and `writes` of `claim`'s saves, both of this step's
        granularity; the engine began counting the loads and claimed the saves."""
        self._host = host
        self._load_outcome = reads.outcome
        self._reads = reads
        self._reads.ready = ready
        self._load_requests = [transfer.request_id for transfer in loads]
        self._claim, self._save_outcome = claim, writes.outcome
        self._writes = writes
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
        if self._reads.batches:
            self._jobs.append(host.receive(self._reads.begin))
            self._schedule_reads(host.prefetch_layers + 1)
        self._jobs.append(host.send(functools.partial(host.prepare, self._writes)))

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
            self._schedule_reads(needed + self._host.prefetch_layers)
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
        backlog = self._host.backlog
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
                self._jobs.append(self._host.send(work))
        except BaseException:
            backlog.release()
            raise

    def checkpoint(self) -> None:
        """At an attention boundary: at most `backlog` saves in flight; surface errors."""
        self._host.backlog.wait_at_most(self._host.backlog.bound)
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
        host = self._host
        jobs = self._end()
        errors = []
        for job in jobs:
            try:
                job.wait()
            except BaseException as exc:
                errors.append(exc)
        if self._save_outcome.riding:
            for earlier in host.open_steps_before(self):  # any write this rides on
                earlier._end()
        self._save_outcome.wait_riders()
        host.forget(self)
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
        host = self._host

        def end_reads() -> None:
            try:
                self._reads.end()
            finally:
                self._reads.unstage()
                host.loads_ended(self._load_requests)

        def end_writes() -> None:
            try:
                self._writes.abort()
            finally:
                self._writes.unstage()
                host.settle(self._claim, self._writes)

        with self._lock:
            if not self._ended:
                self._ended = True
                self._schedule_reads(len(self._reads.layers))
                self._jobs.append(host.receive(end_reads))
                self._jobs.append(host.send(end_writes))
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
            job = self._host.receive(functools.partial(self._reads.read, layer))
            self._read_jobs.append(job)
            self._jobs.append(job)
