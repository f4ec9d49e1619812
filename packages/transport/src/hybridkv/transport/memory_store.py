"""A process-local store with Mooncake's semantics, for fast tests and fault injection.

It copies with `ctypes.memmove` from and to raw addresses exactly as the Mooncake client
does, so a wrong pointer or length shows up here too, and it answers every call with the
status Mooncake gives in the same situation (measured against mooncake 0.3.13; the contract
suite runs the same checks against both).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hybridkv.transport.errors import InvalidRequestError, Status, StoreClosed, error_for
from hybridkv.transport.memory_pool import (
    OPERATIONS,
    Fault,
    KeyMatch,
    MemoryPool,
    StoredObject,
    copy_in,
    copy_out,
    offsets_of,
)
from hybridkv.transport.store import (
    Offsets,
    Pointers,
    Sizes,
    check_prefix,
    check_ranges,
    check_whole,
)


class MemoryStore:
    """In-memory `Store`; `capacity` bytes (None: unbounded) bounds committed + open objects.

    `fail_next(...)` makes chosen keys of chosen operations report a chosen status, to
    test how callers handle a full pool, a dead segment or a lost master.
    `another_client()` joins the same pool as a second client, as another instance would.
    `put_discard_s` is the master's `put_start_discard_timeout_sec` (30 s): a put session
    open that long is discarded when another client starts a session on its key or puts
    it whole; its writer's ranges then land nowhere (OK) and its end and revoke fail.
    """

    def __init__(
        self, capacity: int | None = None, lease_ttl_s: float = 5.0, put_discard_s: float = 30.0
    ) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self._join(MemoryPool(capacity, lease_ttl_s, put_discard_s))

    def _join(self, pool: MemoryPool) -> None:
        self._pool = pool
        with pool.lock:
            pool.clients += 1
            self._id = pool.clients
        self._closed = False
        self._get_sessions: dict[str, StoredObject] = {}

    def another_client(self) -> MemoryStore:
        """A second client of this pool, lending it no memory (an instance beside a
        segment holder): it sees every committed object, but a put session belongs to
        the client that opened it (another's start reports EXISTS, its ranges, end and
        revoke INVALID), and closing it only revokes its own open sessions."""
        client = MemoryStore.__new__(MemoryStore)
        client._join(self._pool)
        return client

    # -- test hooks -------------------------------------------------------------------

    def fail_next(self, operation: str, keys: KeyMatch, status: Status, calls: int = 1) -> None:
        """Make the next `calls` calls of `operation` report `status` for matching keys.

        The matching keys are left untouched (as when Mooncake fails before moving bytes);
        other keys of the same call proceed normally.
        """
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; one of {sorted(OPERATIONS)}")
        if status.ok:
            raise ValueError("fail_next needs a failure status")
        if calls < 1:
            raise ValueError(f"calls must be at least 1, got {calls}")
        with self._pool.lock:
            self._pool.faults.append(Fault(operation, keys, status, calls))

    def clear_faults(self) -> None:
        """Drop every fault `fail_next` queued that has not fired yet."""
        with self._pool.lock:
            self._pool.faults.clear()

    @property
    def used_bytes(self) -> int:
        """Bytes held by committed and open objects."""
        with self._pool.lock:
            return self._pool.used

    def committed_objects(self) -> dict[str, int]:
        """Key -> size of every readable object (what a test may inspect or replace)."""
        with self._pool.lock:
            return {key: item.size for key, item in self._pool.committed.items()}

    def open_put_sessions(self) -> set[str]:
        """Keys allocated but neither committed nor revoked: a leak check for tests."""
        with self._pool.lock:
            return set(self._pool.open_puts)

    def open_get_sessions(self) -> set[str]:
        """Keys pinned by `get_session_start` and not yet released."""
        with self._pool.lock:
            return set(self._get_sessions)

    # -- Store protocol ---------------------------------------------------------------

    def register_buffer(self, ptr: int, size: int) -> None:
        if ptr <= 0 or size <= 0:
            raise InvalidRequestError(f"register_buffer needs a real region, got ({ptr}, {size})")
        self._check_open()

    def unregister_buffer(self, ptr: int) -> None:
        self._check_open()

    def batch_is_readable(self, keys: Sequence[str]) -> list[bool]:
        with self._pool.lock:
            self._check_open()
            faults = self._injected("batch_is_readable", keys)
            for key, status in faults.items():
                if status is Status.RPC_FAILED:  # no answer at all, as Mooncake's master down
                    raise error_for(status, key, "batch_is_readable")
            return [key not in faults and key in self._pool.committed for key in keys]

    def batch_put_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        check_whole("batch_put_whole", keys, ptrs, sizes)

        def put(index: int, key: str) -> Status:
            if key in self._pool.committed or self._held(key):
                return Status.OK  # Mooncake keeps the old bytes and says OK
            return self._put_whole(key, ptrs[index], sizes[index])

        return self._each_key("batch_put_whole", keys, put)

    def batch_get_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        check_whole("batch_get_whole", keys, ptrs, sizes)

        def get(index: int, key: str) -> Status:
            status = self._readable(key)
            if status.ok:
                obj = self._pool.committed[key]
                if sum(sizes[index]) != obj.size:
                    return Status.INVALID
                copy_out(obj, ptrs[index], sizes[index], offsets_of(sizes[index]))
                obj.lease_until = time.monotonic() + self._pool.lease_ttl_s
            return status

        return self._each_key("batch_get_whole", keys, get)

    def put_session_start(self, keys: Sequence[str], object_sizes: Sequence[int]) -> list[Status]:
        if len(object_sizes) != len(keys):
            raise InvalidRequestError(
                f"put_session_start: {len(keys)} keys but {len(object_sizes)} sizes"
            )
        started: set[str] = set()

        def start(index: int, key: str) -> Status:
            size = object_sizes[index]
            if key in self._pool.committed or key in started:
                return Status.EXISTS  # a repeat within one call, too
            if self._held(key):
                # Mooncake: another client's open session is an existing object; our own
                # is a session opened twice.
                return Status.INVALID if self._own_put(key) else Status.EXISTS
            if size <= 0:
                return Status.INVALID
            if not self._reserve(size):
                return Status.NO_SPACE
            self._pool.open_puts[key] = StoredObject(size, writer=self._id)
            self._pool.lost.get(key, set()).discard(self._id)
            started.add(key)
            return Status.OK

        return self._each_key("put_session_start", keys, start)

    def put_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        return self._ranges("put_ranges", self._put_target, copy_in, keys, ptrs, sizes, offsets)

    def put_session_end(self, keys: Sequence[str]) -> list[Status]:
        def commit(key: str) -> None:
            self._pool.committed[key] = self._pool.open_puts.pop(key)

        return self._each_open_put("put_session_end", keys, commit)

    def put_session_revoke(self, keys: Sequence[str]) -> list[Status]:
        def revoke(key: str) -> None:
            self._pool.used -= self._pool.open_puts.pop(key).size

        return self._each_open_put("put_session_revoke", keys, revoke)

    def get_session_start(self, keys: Sequence[str]) -> list[Status]:
        def pin(index: int, key: str) -> Status:
            status = self._readable(key)
            if status.ok:
                obj = self._pool.committed[key]
                obj.lease_until = time.monotonic() + self._pool.lease_ttl_s
                self._get_sessions[key] = obj
            return status

        return self._each_key("get_session_start", keys, pin)

    def get_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        return self._ranges("get_ranges", self._pinned, copy_out, keys, ptrs, sizes, offsets)

    def get_session_end(self, keys: Sequence[str]) -> None:
        with self._pool.lock:
            self._check_open()
            for key in keys:
                self._get_sessions.pop(key, None)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[Status]:
        def remove(index: int, key: str) -> Status:
            status = self._readable(key)
            leased = status.ok and self._pool.committed[key].leased()
            if leased and not force:
                return Status.LEASED
            if status.ok:
                self._pool.used -= self._pool.committed.pop(key).size
            return status

        return self._each_key("batch_remove", keys, remove)

    def remove_by_prefix(self, prefix: str, force: bool = False) -> int:
        check_prefix(prefix)
        with self._pool.lock:
            self._check_open()
            doomed = [
                key
                for key, item in self._pool.committed.items()
                if key.startswith(prefix) and (force or not item.leased())
            ]
            for key in doomed:
                self._pool.used -= self._pool.committed.pop(key).size
            return len(doomed)

    def close(self) -> None:
        """The first client lends the pool its memory: closing it empties the pool.
        Another client leaves with only its own open put sessions revoked."""
        with self._pool.lock:
            self._closed = True
            self._get_sessions.clear()
            pool = self._pool
            if self._id == 1:
                pool.committed.clear()
                pool.open_puts.clear()
                pool.lost.clear()
                pool.used = 0
                return
            for key in [key for key, obj in pool.open_puts.items() if obj.writer == self._id]:
                pool.used -= pool.open_puts.pop(key).size

    # -- the shared body of the batch calls --------------------------------------------

    def _each_key(
        self, operation: str, keys: Sequence[str], answer: Callable[[int, str], Status]
    ) -> list[Status]:
        """Under the lock: an injected fault for a key, else `answer(index, key)`."""
        with self._pool.lock:
            self._check_open()
            faults = self._injected(operation, keys)
            return [
                faults[key] if key in faults else answer(index, key)
                for index, key in enumerate(keys)
            ]

    def _ranges(
        self,
        operation: str,
        session: Callable[[str], StoredObject | Status | None],
        copy: Callable[[StoredObject, Pointers, Sizes, Offsets], None],
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        """Copy byte ranges of the objects this client has open (`session`: put or get)."""
        check_ranges(operation, keys, ptrs, sizes, offsets)

        def move(index: int, key: str) -> Status:
            obj = session(key)
            if isinstance(obj, Status):
                return obj
            if obj is None or not obj.ranges_fit(sizes[index], offsets[index]):
                return Status.INVALID
            copy(obj, ptrs[index], sizes[index], offsets[index])
            return Status.OK

        return self._each_key(operation, keys, move)

    def _each_open_put(
        self, operation: str, keys: Sequence[str], settle: Callable[[str], None]
    ) -> list[Status]:
        """End the open put session of each key with `settle` (commit or revoke)."""

        def end(index: int, key: str) -> Status:
            if self._own_put(key) is None:
                return self._lost_session(key) or Status.INVALID
            settle(key)
            return Status.OK

        return self._each_key(operation, keys, end)

    # -- internals (called with the lock held) ----------------------------------------

    def _pinned(self, key: str) -> StoredObject | Status | None:
        """The object a get session pinned, as Mooncake serves it: gone once removed, and
        unreadable once the lease the pin took has expired (until pinned again)."""
        obj = self._get_sessions.get(key)
        if obj is None:
            return None
        if self._pool.committed.get(key) is not obj:
            return Status.INVALID
        if not obj.leased():
            return Status.TRANSFER_FAILED
        return obj

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("MemoryStore is closed")

    def _injected(self, operation: str, keys: Sequence[str]) -> dict[str, Status]:
        """Statuses forced by `fail_next` for this call, consuming one call of each fault."""
        forced: dict[str, Status] = {}
        for fault in [fault for fault in self._pool.faults if fault.operation == operation]:
            hit = {key: fault.status for key in keys if key not in forced and fault.matches(key)}
            if hit:
                forced.update(hit)
                fault.calls_left -= 1
                if fault.calls_left == 0:
                    self._pool.faults.remove(fault)
        return forced

    def _own_put(self, key: str) -> StoredObject | None:
        """The object of this client's open put session for `key`, if it has one."""
        obj = self._pool.open_puts.get(key)
        return obj if obj is not None and obj.writer == self._id else None

    def _held(self, key: str) -> bool:
        """An open put session keeps `key` from this client: its own, or another client's
        younger than `put_discard_s` (an older one is discarded now, as the master does)."""
        obj = self._pool.open_puts.get(key)
        if obj is None:
            return False
        if obj.writer == self._id or time.monotonic() - obj.opened < self._pool.put_discard_s:
            return True
        self._pool.used -= self._pool.open_puts.pop(key).size
        self._pool.lost.setdefault(key, set()).add(obj.writer)
        return False

    def _put_target(self, key: str) -> StoredObject | Status | None:
        """Where this client's ranges of `key` go: its open session's object, or nowhere
        (OK, as Mooncake answers) if another client took the session over."""
        own = self._own_put(key)
        if own is None and self._lost(key):
            return Status.OK
        return own

    def _lost_session(self, key: str) -> Status | None:
        """What ending or revoking a session another client took over answers: OTHER while
        the key is stored or being written again, NOT_FOUND once that was revoked."""
        if not self._lost(key):
            return None
        taken = key in self._pool.committed or key in self._pool.open_puts
        return Status.OTHER if taken else Status.NOT_FOUND

    def _lost(self, key: str) -> bool:
        """Another client took over this client's put session of `key`."""
        return self._id in self._pool.lost.get(key, ())

    def _readable(self, key: str) -> Status:
        if key in self._pool.committed:
            return Status.OK
        return Status.NOT_READY if key in self._pool.open_puts else Status.NOT_FOUND

    def _reserve(self, size: int) -> bool:
        if self._pool.capacity is not None and self._pool.used + size > self._pool.capacity:
            return False
        self._pool.used += size
        return True

    def _put_whole(self, key: str, ptrs: Pointers, sizes: Sizes) -> Status:
        total = sum(sizes)
        if total <= 0 or any(size < 0 for size in sizes):
            return Status.INVALID
        if not self._reserve(total):
            return Status.NO_SPACE
        obj = StoredObject(total)
        copy_in(obj, ptrs, sizes, offsets_of(sizes))
        self._pool.committed[key] = obj
        return Status.OK
