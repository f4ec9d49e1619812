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
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hybridkv.transport.device_events import Event
from hybridkv.transport.outcome import TransferResult
from hybridkv.transport.ownership import BlockTransfer, Claim
from hybridkv.transport.pipeline import Backlog, Job
from hybridkv.transport.reads import Reads
from hybridkv.transport.writes import Writes

log = logging.getLogger(__name__)


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


class WaitBudget:
    """How long a step may still wait, in all, for one kind of its transfers (None: no
    bound): the forward paces them, so only the waits count, not the step's age."""

    def __init__(self, seconds: float | None) -> None:
        self._left = seconds

    def spend(self, wait: Callable[[float | None], object]) -> object:
        """`wait(timeout)` with what is left as the timeout; what it took is spent."""
        left = self._left
        started = time.monotonic()
        try:
            return wait(left)
        finally:
            if left is not None:
                self._left = max(0.0, left - (time.monotonic() - started))


class LayerwiseStep:
    """One forward step's layer-by-layer transfers.

    Call `wait_layer_loaded(L)` before layer L reads its KV, `save_layer(L, event)` after
    layer L wrote it (event recorded on its stream), `checkpoint()` at attention
    boundaries, and `finish()` once the step is over.

    The step ends (its end jobs are queued) once: at its first `finish()`, or at the
    `finish()` of a later step still riding on an open step's writes; then `save_layer`
    raises.

    Once the step has waited `load_deadline_s` in all for its loads (the forward paces the
    reads, so the step's age would count slow compute too), the loads still running are
    given up: called off (no write into the caches once `wait_layer_loaded` returns), every
    load block fails and is blamed, and `finish()` no longer waits for them (their calls
    end in the background).

    Saves likewise: once the step has waited `save_deadline_s` in all for its saves (room
    in the backlog, a checkpoint, `finish()`), they are given up: called off (no layer is
    read from the caches once the wait returns: a put of what was copied into staging may
    still store it, whole), every save key fails, and `finish()` returns without waiting
    for their calls; `saves_running` tells when those calls have ended.
    """

    def __init__(
        self,
        host: StepHost,
        loads: Sequence[BlockTransfer],
        reads: Reads,
        claim: Claim,
        writes: Writes,
        ready: Event | None = None,
        load_deadline_s: float | None = None,
        save_deadline_s: float | None = None,
    ) -> None:
        """`reads` of `loads` and `writes` of `claim`'s saves, both of this step's
        granularity; the engine began counting the loads and claimed the saves."""
        self._host = host
        self._load_deadline_s = load_deadline_s
        self._load_wait = WaitBudget(load_deadline_s)
        self._loads_given_up: dict[int, set[int]] | None = None
        self._save_deadline_s = save_deadline_s
        self._save_wait = WaitBudget(save_deadline_s)
        self._saves_given_up = False
        self._receiving: set[int] = set()  # ids of the jobs on the receive thread
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
            self._jobs.append(self._receive(self._reads.begin))
            self._schedule_reads(host.prefetch_layers + 1)
        if self._writes.batches:  # else nothing to open: not queued behind others' puts
            self._jobs.append(host.send(functools.partial(host.prepare, self._writes)))

    def wait_layer_loaded(self, layer: int, ready: Event | None = None) -> dict[int, set[int]]:
        """Block until every load this layer needs is done; returns failed local blocks.

        The failed blocks (group -> local blocks, cumulative) hold no valid KV: the caller
        must not use them and reports them to vLLM for recomputation. `ready`, if given,
        is the caches' current ready point: loads that have not written yet wait for it.
        """
        if self._loads_given_up is not None:
            return {group: set(blocks) for group, blocks in self._loads_given_up.items()}
        if ready is not None:
            self._reads.ready = ready
        needed = bisect.bisect_right(self._reads.layers, layer)
        with self._lock:
            self._schedule_reads(needed + self._host.prefetch_layers)
        if needed:
            try:
                self._await_load(self._jobs[0])  # the session start
                for job in self._read_jobs[:needed]:  # a caller may skip layers: check each
                    self._await_load(job)  # raises the first error
            except TimeoutError:
                return self._give_up_loads()
        return self._load_outcome.failed_blocks()

    def _await_reads(self, jobs: Sequence[Job]) -> None:
        """Wait for the receive thread's jobs until the load deadline (then give the loads
        up); what they raised is raised by the caller's own wait."""
        for job in jobs:
            if id(job) in self._receiving:
                try:
                    self._await_load(job)
                except TimeoutError:
                    self._give_up_loads()
                    return
                except BaseException:
                    continue

    def _await_load(self, job: Job) -> None:
        """`job.wait()` within what is left of the step's wait for loads; TimeoutError once
        that is spent."""
        self._load_wait.spend(job.wait)

    def _give_up_loads(self) -> dict[int, set[int]]:
        """Call the loads off (an in-place call in progress ends first) and fail them all."""
        self._load_outcome.cache_access.call_off()
        failed: dict[int, set[int]] = {}
        for batch in self._reads.batches.values():
            failed.setdefault(batch.layout.block_group, set()).update(map(int, batch.blocks))
        self._loads_given_up = failed
        log.warning(
            "layerwise loads of %d blocks still running after the step waited "
            "load_deadline_s (%g s) for them: given up, every one fails",
            sum(len(blocks) for blocks in failed.values()),
            self._load_deadline_s,
        )
        return {group: set(blocks) for group, blocks in failed.items()}

    def _given_up_result(self) -> TransferResult:
        """Every load failed, and is to blame (see `blamed_loads`)."""
        assert self._loads_given_up is not None
        return TransferResult(
            failed_blocks={group: set(blocks) for group, blocks in self._loads_given_up.items()},
            failed_keys=self._load_keys(),
        )

    @property
    def saves_running(self) -> bool:
        """Whether saves given up still have calls running (a stalled holder's put): a
        later step's saves would only queue behind them."""
        return self._saves_given_up and not all(
            job.done for job in self._jobs if id(job) not in self._receiving
        )

    def _await_saves(self, jobs: Sequence[Job]) -> None:
        """Wait for the send thread's jobs until the save deadline (then give the saves
        up); what they raised is raised by the caller's own wait."""
        for job in jobs:
            if id(job) not in self._receiving and not self._await_save(job.wait):
                return

    def _await_save(self, wait: Callable[[float | None], object]) -> bool:
        """`wait(timeout)` within what is left of the step's wait for saves; false (the
        saves given up) once that is spent: a TimeoutError, or a wait that returned false."""
        try:
            done = self._save_wait.spend(wait) is not False
        except TimeoutError:
            done = False
        except BaseException:
            return True  # raised again where the job is waited for
        if not done:
            self._give_up_saves()
        return done

    def _give_up_saves(self) -> None:
        """Call the saves off (a copy or an in-place call in progress ends first)."""
        self._save_outcome.cache_access.call_off()
        self._saves_given_up = True
        log.warning(
            "layerwise saves of %d objects still running after the step waited "
            "save_deadline_s (%g s) for them: given up, none is announced",
            len(self._save_keys()),
            self._save_deadline_s,
        )

    def _save_keys(self) -> list[str]:
        return [transfer.key for transfer in (*self._claim.write, *self._claim.ride)]

    def blamed_loads(self) -> list[str]:
        """Keys whose reads the store failed so far (a status about them): the objects to
        distrust.

        Unlike `wait_layer_loaded`, safe once the step raised. Blocks a client error
        failed (every block its call or any later layer touched), or a call the master
        did not answer, are failed but not counted here: no object is at fault there.
        Loads given up at their deadline count whole: read again, they would wait on the
        same stalled holder.
        """
        if self._loads_given_up is not None:
            return self._load_keys()
        return self._load_outcome.result().blamed_keys

    def _load_keys(self) -> list[str]:
        return [key for batch in self._reads.batches.values() for key in batch.keys]

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
        if self._saves_given_up or not self._await_save(backlog.acquire):
            return

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
        backlog = self._host.backlog
        if not self._saves_given_up:
            self._await_save(lambda timeout: backlog.wait_at_most(backlog.bound, timeout))
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
        if self._loads_given_up is None:
            self._await_reads(jobs)
        if self._loads_given_up is not None:  # their calls end in the background
            jobs = [job for job in jobs if id(job) not in self._receiving]
        if not self._saves_given_up:
            self._await_saves(jobs)
        if self._saves_given_up:  # their calls end in the background
            jobs = [job for job in jobs if id(job) in self._receiving]
        errors = []
        for job in jobs:
            try:
                job.wait()
            except BaseException as exc:
                errors.append(exc)
        if self._save_outcome.riding and not self._saves_given_up:
            for earlier in host.open_steps_before(self):  # any write this rides on
                earlier._end()
            self._await_save(self._save_outcome.wait_riders)
        host.forget(self)
        with self._lock:
            if self._result is None:
                loads = (
                    self._load_outcome.result()
                    if self._loads_given_up is None
                    else self._given_up_result()
                )
                saves = (
                    TransferResult(failed_keys=self._save_keys())
                    if self._saves_given_up
                    else self._save_outcome.result()
                )
                self._result = loads.merged(saves)
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
                if self._reads.batches:  # else nothing to end: not queued behind others' gets
                    self._jobs.append(self._receive(end_reads))
                if self._writes.batches:
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
            job = self._receive(functools.partial(self._reads.read, layer))
            self._read_jobs.append(job)
            self._jobs.append(job)

    def _receive(self, work: Callable[[], None]) -> Job:
        job = self._host.receive(work)
        self._receiving.add(id(job))
        return job
