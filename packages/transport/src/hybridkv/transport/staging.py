"""Registered host staging memory: one contiguous buffer per object, for one-piece transfers.

Mooncake over TCP pays tens of microseconds per piece (buffer or range) of a call, and a
many-layer object scattered over one tensor per layer is that many pieces. Staging
assembles each object in one registered buffer (a memcpy per layer, which on a GPU host is
the device-to-host copy that overlaps compute), so the store moves it as ONE piece.

The pool is one buffer registered once with the store, `capacity` bytes; a slab is carved
from its largest free span, for as many of the requested objects as fit there. It never
grows and never waits for space (the holder of a slab may be a layerwise step that frees it
only after jobs queued behind the waiter, on the same FIFO thread): a batch larger than the
free room moves in waves, each wave's slabs reused by the next, and objects that find no
room at all move unstaged (piece by piece, straight from the caches).

The pool also owns the threads that make staged store calls, so the copy of one part of a
batch overlaps the store call of another (Mooncake releases the GIL while it moves bytes).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from hybridkv.transport.errors import StoreError
from hybridkv.transport.layout import BlockIds, CacheEntry
from hybridkv.transport.store import Store

log = logging.getLogger(__name__)

ALIGNMENT = 64
# How much lower than the caller the threads that make store calls run (see yield_cpu):
# as low as Linux goes. Interleaved A/B runs of the bench (12 rounds each, twice) put
# staged whole get at 0.65-0.67 of raw with 0, 0.68-0.70 with 10, 0.70-0.81 with 19.
STORE_CALL_NICENESS = 19
Bytes = npt.NDArray[np.uint8]


class Slab:
    """A contiguous piece of the pool: `rows` objects of `width` bytes, row after row."""

    __slots__ = ("address", "array", "rows", "size", "start")

    def __init__(self, pool_array: Bytes, start: int, rows: int, width: int, size: int) -> None:
        self.start = start
        self.rows = rows
        self.size = size
        self.array: Bytes = pool_array[start : start + rows * width].reshape(rows, width)
        self.address = int(self.array.ctypes.data)

    def row_addresses(self, rows: npt.NDArray[np.intp]) -> list[int]:
        addresses: list[int] = (self.address + rows * self.array.shape[1]).tolist()
        return addresses


class StagingPool:
    """A bounded, registered host buffer handed out as slabs (thread-safe)."""

    def __init__(self, store: Store, capacity: int) -> None:
        self.capacity = capacity
        self._store = store
        self._lock = threading.Lock()
        self._array: Bytes | None = None
        self._registered = False
        self._closed = False
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (start, size), by start
        self.in_use = 0
        self.peak = 0
        # One call in flight per direction: two concurrent calls of one batch only contend.
        self.puts = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hybridkv-staged-put", initializer=yield_cpu
        )
        self.gets = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hybridkv-staged-get", initializer=yield_cpu
        )
        # Scatters a layerwise load's layers from the last one down (at normal priority:
        # it copies, it does not wait on the store).
        self.scatters = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridkv-scatter")

    def allocate(self, rows: int, width: int) -> Slab | None:
        """A slab for up to `rows` objects of `width` bytes: as many as the largest free
        span holds, or None if it holds none."""
        if rows <= 0 or width <= 0:
            return None
        with self._lock:
            array = self._buffer()
            if array is None or not self._free:
                return None
            index = max(range(len(self._free)), key=lambda i: self._free[i][1])
            start, free = self._free[index]
            # A slab's size is aligned, so it may use only the span's aligned part.
            fits = min(rows, free // ALIGNMENT * ALIGNMENT // width)
            if fits <= 0:
                return None
            size = _aligned(fits * width)
            if free == size:
                del self._free[index]
            else:
                self._free[index] = (start + size, free - size)
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
            return Slab(array, start, fits, width, size)

    def free(self, slab: Slab) -> None:
        with self._lock:
            self.in_use -= slab.size
            spans = sorted([*self._free, (slab.start, slab.size)])
            merged: list[tuple[int, int]] = []
            for start, size in spans:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((start, size))
            self._free = merged

    def _buffer(self) -> Bytes | None:
        """The pool's memory, allocated and registered on first use (lock held)."""
        if self._array is None and self.capacity and not self._closed:
            array = np.empty(self.capacity, dtype=np.uint8)
            array.fill(0)  # map every page once now, not in the middle of each transfer
            try:
                self._store.register_buffer(int(array.ctypes.data), self.capacity)
                self._registered = True
            except StoreError as exc:
                log.warning("staging buffer of %d B not registered: %s", self.capacity, exc)
            self._array = array
        return self._array

    def close(self) -> None:
        """Unregister and free the buffer (no slab may be in use: the engine has drained)."""
        self.puts.shutdown(wait=True)
        self.gets.shutdown(wait=True)
        self.scatters.shutdown(wait=True)
        with self._lock:
            self._closed = True
            array, self._array = self._array, None
            if array is not None and self._registered:
                self._registered = False
                try:
                    self._store.unregister_buffer(int(array.ctypes.data))
                except StoreError as exc:
                    log.warning("staging buffer not unregistered: %s", exc)


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def yield_cpu() -> None:
    """Lower the calling thread's priority (Linux, where nice is per thread).

    Mooncake's wheels (0.3.13, built without event-driven completion) wait for a transfer
    by spinning on the calling thread. Store calls run on these pool threads so that, at a
    lower priority, the spin gives its core to the staging copy of the next part instead of
    competing with it; the transfer itself runs on Mooncake's own threads, untouched.
    """
    if sys.platform != "linux":
        return  # elsewhere setpriority would renice the whole process
    thread = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + STORE_CALL_NICENESS))
    except OSError as exc:
        log.debug("store call thread keeps its priority: %s", exc)


def host_view(entry: CacheEntry, blocks: BlockIds) -> Bytes:
    """The entry's blocks as a [block, block_bytes] array over its memory (no copy).

    Only valid for host memory: staging reads and writes caches with the CPU.
    """
    rows = entry.num_blocks if entry.num_blocks is not None else int(blocks.max()) + 1
    span = (rows - 1) * entry.block_stride + entry.block_bytes
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(entry.base_ptr))
    view: Bytes = np.lib.stride_tricks.as_strided(
        raw, shape=(rows, entry.block_bytes), strides=(entry.block_stride, 1), writeable=True
    )
    return view
