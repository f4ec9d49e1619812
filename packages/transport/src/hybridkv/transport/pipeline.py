"""Background send/receive threads, the save backlog bound, a full pool's pause of saves,
and batch splitting.

Every store call of the engine runs on one of two FIFO worker threads, so the model thread
never blocks on I/O except where it must (a layer it is about to use, a full backlog). A
job's exception is kept on its handle and re-raised to whoever waits for it; the thread
itself survives and keeps draining its queue, so one bad job never hangs the jobs behind it.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

log = logging.getLogger(__name__)

Granularity = Literal["staged", "layer", "group"]
GRANULARITIES = ("staged", "layer", "group")


_WHAT_ZERO_MEANS = {
    "backlog": "no save outstanding at a checkpoint",
    "prefetch_layers": "no layer fetched ahead",
    "max_transfer_blocks": "no limit",
    "max_transfer_bytes": "no limit",
    "max_transfer_pieces": "no limit",
    "staging_bytes": "no staging",
    "full_pool_pause_s": "never pause",
}


class PipelineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How transfers are scheduled; validated on construction.

    `granularity` (the same object layout in every mode, so each reads what another wrote):
    - "staged" (default; host memory): each object moves as ONE piece through a
      registered staging buffer once its group is complete (layerwise: each layer copied
      into staging when ready, off the model thread; whole saves: gathered part by part,
      each part put while the next is gathered); loads fetch whole objects at the step's
      start, then the layer reads scatter each layer when it is due while a second
      thread scatters from the last layer down (whole loads: each part scattered while
      the next is fetched). Best where a store
      call pays per piece (Mooncake over TCP: ~30-40 us per piece, 61 pieces for a 61-layer
      object). `staging_bytes` bounds the buffer
      (0 = no staging: every object moves piece by piece, as "group").
    - "layer": each layer's byte ranges move through put/get sessions as the layer becomes
      ready or needed: no copy, finest overlap; best where a piece costs little (RDMA) and
      for caches in device memory.
    - "group": each group's whole objects move in one multi-buffer call (a piece per
      layer) once all its layers are ready (saves) or before its first layer (loads).
    `backlog`: layer saves that may be outstanding at a checkpoint (0: none, i.e. every
    checkpoint waits for all saves queued so far).
    `full_pool_pause_s`: after the pool answered a save with "no space", saves starting
    within this many seconds fail at once, with no copy and no store call; the first save
    after it tries again (0: never pause).
    """

    backlog: int = 8
    prefetch_layers: int = 2
    max_transfer_blocks: int = 0
    max_transfer_bytes: int = 0
    # Mooncake 0.3.13 over TCP fails (-800) keys of one batch beyond about 2000 pieces
    # (buffers or ranges) in all: whole-object calls of many-layer groups are split here.
    max_transfer_pieces: int = 1024
    granularity: Granularity = "staged"
    staging_bytes: int = 256 << 20
    full_pool_pause_s: float = 1.0

    def __post_init__(self) -> None:
        for name, zero in _WHAT_ZERO_MEANS.items():
            if not getattr(self, name) >= 0:  # NaN included
                raise ValueError(f"{name} must be >= 0 (0: {zero}), got {getattr(self, name)}")
        if math.isinf(self.full_pool_pause_s):  # the first full pool would stop saves for good
            raise ValueError("full_pool_pause_s must be finite")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}"
            )

    def split(self, item_bytes: Sequence[int], item_pieces: Sequence[int]) -> list[slice]:
        """Consecutive slices of a batch within the limits (>= 1 item each)."""
        limits = (
            (self.max_transfer_blocks, [1] * len(item_bytes)),
            (self.max_transfer_bytes, item_bytes),
            (self.max_transfer_pieces, item_pieces),
        )
        active = [(limit, amounts) for limit, amounts in limits if limit]
        slices: list[slice] = []
        start = 0
        used = [0] * len(active)
        for index in range(len(item_bytes)):
            over = any(
                used[i] + amounts[index] > limit for i, (limit, amounts) in enumerate(active)
            )
            if index > start and over:
                slices.append(slice(start, index))
                start, used = index, [0] * len(active)
            for i, (_, amounts) in enumerate(active):
                used[i] += amounts[index]
        if start < len(item_bytes):
            slices.append(slice(start, len(item_bytes)))
        return slices


class Job:
    """A queued unit of work; `wait()` returns once it ran and re-raises its exception."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work = work
        self._done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # kept for the waiter; the worker thread must live on
            self.error = exc
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"transfer job still running after {timeout} s")
        if self.error is not None:
            raise self.error


class Worker:
    """One FIFO thread; `close()` runs everything already queued, then stops."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> Job:
        job = Job(work)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._thread.name} is closed")
            self._queue.put(job)
        return job

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            job.run()


class PoolPressure:
    """Whether saves pause because the pool is full.

    Mooncake answers a put it has no room for with NO_SPACE only after the caller paid for
    it (a staging copy, a master round trip, a warning); while its eviction catches up,
    every save would pay again. A save that met NO_SPACE pauses saves for `pause_s`; the
    first one after the pause tries the pool again.
    """

    def __init__(self, pause_s: float) -> None:
        self._pause_s = pause_s
        self._lock = threading.Lock()
        self._until: float | None = None

    def paused(self) -> bool:
        with self._lock:
            return self._until is not None and time.monotonic() < self._until

    def settled(self, no_space: bool, took: bool) -> None:
        """A save that ran (was not paused) settled; `no_space`: the pool refused some key;
        `took`: it moved bytes into the pool. Only that shows the pool has room again: a
        save that moved nothing (every key already stored, or failed otherwise), perhaps
        started before the refusal, leaves the pause as it is."""
        with self._lock:
            if no_space and self._pause_s > 0:
                if self._until is None:
                    log.warning("the pool is full: saves pause for %.1f s at a time", self._pause_s)
                self._until = time.monotonic() + self._pause_s
            elif not no_space and took and self._until is not None:
                self._until = None
                log.info("the pool took a save again: saves resume")


class Backlog:
    """Counts layer saves queued but not finished; blocks new ones beyond the bound.

    `peak` is the largest count ever seen: tests assert it never exceeds `bound`.
    """

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._cond = threading.Condition()
        self._outstanding = 0
        self.peak = 0

    @property
    def outstanding(self) -> int:
        with self._cond:
            return self._outstanding

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for room (at most `timeout`; false, and nothing taken, if none came); with
        bound 0 one save may run (checkpoints then wait for it)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._outstanding < max(self.bound, 1), timeout):
                return False
            self._outstanding += 1
            self.peak = max(self.peak, self._outstanding)
            return True

    def release(self) -> None:
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()

    def wait_at_most(self, count: int, timeout: float | None = None) -> bool:
        """Wait until `count` saves or fewer are queued; false if not within `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._outstanding <= count, timeout)
