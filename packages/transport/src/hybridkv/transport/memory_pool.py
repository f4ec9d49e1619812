"""What every client of one in-memory pool shares: its objects, open put sessions,
injected faults and used room, and how bytes move in and out of an object.

Bytes move with `ctypes.memmove` from and to raw addresses, as the Mooncake client moves
them, so a wrong pointer or length shows up in tests against the memory store too.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from hybridkv.transport.errors import Status
from hybridkv.transport.store import Offsets, Pointers, Sizes

KeyMatch = Collection[str] | Callable[[str], bool]

OPERATIONS = frozenset(
    {
        "batch_is_readable",
        "batch_put_whole",
        "batch_get_whole",
        "put_session_start",
        "put_ranges",
        "put_session_end",
        "put_session_revoke",
        "get_session_start",
        "get_ranges",
        "batch_remove",
    }
)


@dataclass
class Fault:
    operation: str
    match: KeyMatch
    status: Status
    calls_left: int

    def matches(self, key: str) -> bool:
        return self.match(key) if callable(self.match) else key in self.match


class StoredObject:
    """Bytes of one object plus what Mooncake tracks about it."""

    def __init__(self, size: int, writer: int = 0) -> None:
        self.buffer = ctypes.create_string_buffer(size)
        self.size = size
        self.address = ctypes.addressof(self.buffer)
        self.lease_until = 0.0
        self.writer = writer  # the client whose put session it is in, until committed
        self.opened = time.monotonic()

    def leased(self) -> bool:
        """A read's lease holds it: only a forced removal takes it."""
        return self.lease_until > time.monotonic()

    def ranges_fit(self, sizes: Sizes, offsets: Offsets) -> bool:
        return len(sizes) > 0 and all(
            size >= 0 and offset >= 0 and offset + size <= self.size
            for size, offset in zip(sizes, offsets, strict=True)
        )


def offsets_of(sizes: Sizes) -> list[int]:
    """Offsets of pieces laid end to end, as a whole put or get places them."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


class MemoryPool:
    """What every client of one in-memory pool shares."""

    def __init__(self, capacity: int | None, lease_ttl_s: float, put_discard_s: float) -> None:
        self.capacity = capacity
        self.lease_ttl_s = lease_ttl_s
        self.put_discard_s = put_discard_s
        self.lock = threading.Lock()
        self.committed: dict[str, StoredObject] = {}
        self.open_puts: dict[str, StoredObject] = {}
        self.lost: dict[str, set[int]] = {}  # key -> clients whose session was taken over
        self.faults: list[Fault] = []
        self.used = 0
        self.clients = 0


def copy_in(obj: StoredObject, ptrs: Pointers, sizes: Sizes, offsets: Offsets) -> None:
    for ptr, size, offset in zip(ptrs, sizes, offsets, strict=True):
        ctypes.memmove(obj.address + offset, ptr, size)


def copy_out(obj: StoredObject, ptrs: Pointers, sizes: Sizes, offsets: Offsets) -> None:
    for ptr, size, offset in zip(ptrs, sizes, offsets, strict=True):
        ctypes.memmove(ptr, obj.address + offset, size)
