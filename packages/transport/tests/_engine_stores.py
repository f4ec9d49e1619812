"""Instrumented stores and events for engine tests (real MemoryStore underneath)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from hybridkv.transport.errors import Status
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.store import Offsets, Pointers, Sizes


class GateEvent:
    """A device event the test fires by hand: `synchronize` blocks until `fire()`."""

    def __init__(self) -> None:
        self._fired = threading.Event()
        self.waited = threading.Event()

    def record(self) -> None:
        return None

    def fire(self) -> None:
        self._fired.set()

    def synchronize(self) -> None:
        self.waited.set()
        if not self._fired.wait(timeout=30):
            raise TimeoutError("test event never fired")


class BrokenEvent:
    """An event whose wait fails, as a device error would."""

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        raise RuntimeError("device lost")


class RecordingStore(MemoryStore):
    """Logs each ranged/whole call (operation, key count) and can slow puts down."""

    def __init__(self, put_delay_s: float = 0.0) -> None:
        super().__init__()
        self.put_delay_s = put_delay_s
        self.calls: list[tuple[str, int]] = []
        self.read_offsets: list[list[int]] = []
        self._log = threading.Lock()

    def _record(self, operation: str, keys: Sequence[str]) -> None:
        with self._log:
            self.calls.append((operation, len(keys)))

    def put_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        self._record("put_ranges", keys)
        time.sleep(self.put_delay_s)
        return super().put_ranges(keys, ptrs, sizes, offsets)

    def get_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        self._record("get_ranges", keys)
        with self._log:
            self.read_offsets.append([row[0] for row in offsets])
        return super().get_ranges(keys, ptrs, sizes, offsets)

    def batch_put_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        self._record("batch_put_whole", keys)
        return super().batch_put_whole(keys, ptrs, sizes)

    def batch_get_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        self._record("batch_get_whole", keys)
        return super().batch_get_whole(keys, ptrs, sizes)

    def count(self, operation: str) -> int:
        with self._log:
            return sum(1 for name, _ in self.calls if name == operation)


class FailingOpenStore(MemoryStore):
    """Opens the sessions it is asked to, then raises: a crash in the middle of preparing."""

    def put_session_start(self, keys: Sequence[str], object_sizes: Sequence[int]) -> list[Status]:
        super().put_session_start(keys, object_sizes)
        raise RuntimeError("crashed after opening sessions")


class FailingCommitStore(MemoryStore):
    """Raises (an error of the client, not a status) in the first commit of put sessions."""

    crashed = False

    def put_session_end(self, keys: Sequence[str]) -> list[Status]:
        if not self.crashed:
            self.crashed = True
            raise RuntimeError("crashed while committing")
        return super().put_session_end(keys)


def fail_at_call(
    store: MemoryStore,
    operation: str,
    call: int,
    keys: Sequence[str],
    status: Status,
    times: int = 1,
) -> None:
    """Make the `call`-th call (1-based) of `operation` and the `times - 1` calls after it
    that touch `keys` fail them: a mid-way fault (times > 1: one that a retry meets too)."""
    original = getattr(store, operation)
    count = {"calls": 0}

    def wrapped(*args: object, **kwargs: object) -> object:
        count["calls"] += 1
        if count["calls"] == call:
            store.fail_next(operation, keys, status, calls=times)
        return original(*args, **kwargs)

    setattr(store, operation, wrapped)
