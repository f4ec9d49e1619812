"""What one direction of a transfer achieved, built up on a worker thread.

`TransferResult` is the report callers get; `Outcome` collects it as store calls settle,
keeping apart the failed keys the store blamed on their objects from those no object is at
fault for (a client error, a call the master did not answer), and the saves that ride on
another transfer's write of the same key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import msgspec

from hybridkv.transport.cache_access import CacheAccess
from hybridkv.transport.errors import Status


class TransferResult(msgspec.Struct):
    """What a save or load achieved. Failed local blocks hold no valid KV."""

    failed_blocks: dict[int, set[int]] = msgspec.field(default_factory=dict)
    failed_keys: list[str] = msgspec.field(default_factory=list)
    skipped_keys: list[str] = msgspec.field(default_factory=list)
    # Keys another client was writing when this save ran, not readable when it settled:
    # neither stored by this save nor failed by it.
    contended_keys: list[str] = msgspec.field(default_factory=list)
    # Failed keys whose objects are not at fault: the master did not answer, or the
    # client raised. The others (`blamed_keys`) failed by the store's word on them.
    unblamed_keys: list[str] = msgspec.field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed_keys

    @property
    def blamed_keys(self) -> list[str]:
        """Failed keys whose objects the store failed (a status about them): to distrust."""
        unblamed = set(self.unblamed_keys)
        return [key for key in self.failed_keys if key not in unblamed]

    def merged(self, other: TransferResult) -> TransferResult:
        failed = {group: set(blocks) for group, blocks in self.failed_blocks.items()}
        for group, blocks in other.failed_blocks.items():
            failed.setdefault(group, set()).update(blocks)
        return TransferResult(
            failed_blocks=failed,
            failed_keys=self.failed_keys + other.failed_keys,
            skipped_keys=self.skipped_keys + other.skipped_keys,
            contended_keys=self.contended_keys + other.contended_keys,
            unblamed_keys=self.unblamed_keys + other.unblamed_keys,
            bytes=self.bytes + other.bytes,
            seconds=max(self.seconds, other.seconds),
        )


class Outcome:
    """The result of one direction of a transfer as it builds up on a worker thread."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._result = TransferResult()
        self._started = time.perf_counter()
        self._riding = 0  # saves riding on another transfer's write of the same key
        self.no_space = False  # the pool refused some key for want of room
        self._unblamed: set[str] = set()  # see TransferResult.unblamed_keys
        self._store_failed: set[str] = set()  # keys whose last status was a failure
        self.cache_access = CacheAccess()  # called off when its waiter gives up

    def ride(self, count: int) -> None:
        with self._lock:
            self._riding += count

    def rode(
        self, group: int, key: str, block: int, committed: bool, contended: bool = False
    ) -> None:
        """The write this outcome rode on settled: its failure (or contention) is this
        outcome's too."""
        with self._lock:
            if contended:
                self._result.contended_keys.append(key)
            elif not committed:
                self._result.failed_keys.append(key)
                self._result.failed_blocks.setdefault(group, set()).add(block)
            self._riding -= 1
            self._lock.notify_all()

    @property
    def riding(self) -> bool:
        with self._lock:
            return self._riding > 0

    def wait_riders(self, timeout: float | None = None) -> None:
        with self._lock:
            if not self._lock.wait_for(lambda: self._riding <= 0, timeout):
                raise TimeoutError(f"saves riding on other writes unsettled after {timeout} s")

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self._result.bytes += nbytes

    @property
    def moved_any(self) -> bool:
        with self._lock:
            return self._result.bytes > 0

    def skipped(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._result.skipped_keys.extend(keys)

    def contended(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._result.contended_keys.extend(keys)

    def contended_set(self) -> set[str]:
        with self._lock:
            return set(self._result.contended_keys)

    def failed(
        self, group: int, keys: Iterable[str], blocks: Iterable[int], blamed: bool = True
    ) -> None:
        """`blamed=False`: a client error failed these keys, which says nothing of their
        objects (nor does an unanswered call, see `judged`); a store status about a key
        (`judged`) still stands."""
        with self._lock:
            keys = list(keys)
            self._result.failed_keys.extend(keys)
            self._result.failed_blocks.setdefault(group, set()).update(blocks)
            if not blamed:
                self._unblamed.update(key for key in keys if key not in self._store_failed)

    def judged(self, keys: Sequence[str], statuses: Sequence[Status]) -> None:
        """A call's statuses: a key the master did not answer for (RPC_FAILED) is no
        object's fault; the latest word on a key (a retry's) stands."""
        with self._lock:
            for key, status in zip(keys, statuses, strict=True):
                if status is Status.RPC_FAILED:
                    self._unblamed.add(key)
                    self._store_failed.discard(key)
                elif not status.ok:
                    self._unblamed.discard(key)
                    self._store_failed.add(key)

    def recovered(self, keys: Iterable[str]) -> None:
        """A retry read these keys: what failed them before says nothing against their
        objects (a later client error fails them unblamed)."""
        with self._lock:
            self._store_failed.difference_update(keys)

    def failed_blocks(self) -> dict[int, set[int]]:
        with self._lock:
            return {group: set(blocks) for group, blocks in self._result.failed_blocks.items()}

    def result(self) -> TransferResult:
        """A snapshot: later failures do not change it."""
        with self._lock:
            now = self._result
            return TransferResult(
                failed_blocks={group: set(blocks) for group, blocks in now.failed_blocks.items()},
                failed_keys=list(now.failed_keys),
                skipped_keys=list(now.skipped_keys),
                contended_keys=list(now.contended_keys),
                unblamed_keys=[key for key in now.failed_keys if key in self._unblamed],
                bytes=now.bytes,
                seconds=time.perf_counter() - self._started,
            )
