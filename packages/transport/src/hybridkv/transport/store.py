"""The store operations hybridkv needs, independent of any one backend.

The shape follows Mooncake's batch range/session API because it is the richest backend;
an in-memory store and other pools (Memcache) implement the same protocol. Every batch call
returns one `Status` per key so that one bad key never hides the fate of the others.
Stores are used from several threads at once (the engine's send and receive threads).

Semantics every backend keeps (the contract suite checks them on each):
- an object in an open put session is invisible (`batch_is_readable` False, reads
  NOT_READY) until `put_session_end`; `put_session_revoke` drops it for good;
- a whole put of a key that already exists reports OK and keeps the old bytes
  (keys are content-addressed); `put_session_start` on it reports EXISTS;
- a put session belongs to the client that opened it: another client's
  `put_session_start` reports EXISTS, its ranges, end and revoke INVALID, and its whole
  put reports OK and changes nothing;
- reads of absent keys report NOT_FOUND; ranges outside the object, whole reads into
  pieces smaller than the object, and ranged calls without a session report INVALID
  (a whole read into pieces larger than the object fails too: Mooncake says
  TRANSFER_FAILED);
- reads take a lease: `batch_remove` right after one reports LEASED unless forced.
Malformed calls (lists of different lengths) raise `InvalidRequestError` before any I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from hybridkv.transport.errors import InvalidRequestError, Status

# One key's local memory: parallel lists of addresses and lengths, plus (for ranged calls)
# the offset of each piece inside the remote object.
Pointers = Sequence[int]
Sizes = Sequence[int]
Offsets = Sequence[int]


@runtime_checkable
class Store(Protocol):
    """A pool of immutable byte objects addressed by string keys."""

    def register_buffer(self, ptr: int, size: int) -> None:
        """Make local memory eligible for zero-copy transfers (a no-op where not needed)."""

    def unregister_buffer(self, ptr: int) -> None:
        """Forget a region `register_buffer` made eligible, before its memory is freed."""

    def batch_is_readable(self, keys: Sequence[str]) -> list[bool]:
        """True for keys committed and readable now; allocated-but-open objects are False.

        Raises `StoreUnavailable` when the master gives no answer: not a miss.
        """

    def batch_put_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        """Write each object from its pieces, in order, and commit it in one call."""

    def batch_get_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        """Read each whole object into its pieces, in order."""

    def put_session_start(self, keys: Sequence[str], object_sizes: Sequence[int]) -> list[Status]:
        """Reserve objects that stay invisible until `put_session_end`."""

    def put_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        """Write byte ranges of objects in an open put session."""

    def put_session_end(self, keys: Sequence[str]) -> list[Status]:
        """Commit objects: from now on they are readable."""

    def put_session_revoke(self, keys: Sequence[str]) -> list[Status]:
        """Drop objects of an open put session; nothing of them is ever readable."""

    def get_session_start(self, keys: Sequence[str]) -> list[Status]:
        """Pin the replicas of committed objects for ranged reads."""

    def get_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Pointers],
        sizes: Sequence[Sizes],
        offsets: Sequence[Offsets],
    ) -> list[Status]:
        """Read byte ranges of objects in an open get session."""

    def get_session_end(self, keys: Sequence[str]) -> None:
        """Release what `get_session_start` pinned."""

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[Status]:
        """Delete committed objects (force: even while leased)."""

    def remove_by_prefix(self, prefix: str, force: bool = False) -> int:
        """Delete every committed object whose key starts with `prefix` (force: even while
        leased); the number deleted. Objects still being put are left alone."""

    def close(self) -> None:
        """Release the client; any later call raises `StoreClosed`, never crashes."""


def check_batch(
    operation: str, keys: Sequence[str], *columns: tuple[str, Sequence[Sequence[int]]]
) -> None:
    """Refuse a batch whose per-key lists disagree in length, before any byte moves."""
    for name, column in columns:
        if len(column) != len(keys):
            raise InvalidRequestError(f"{operation}: {len(keys)} keys but {len(column)} {name}")
    for index, key in enumerate(keys):
        lengths = {name: len(column[index]) for name, column in columns}
        if len(set(lengths.values())) > 1:
            raise InvalidRequestError(f"{operation}: pieces of {key!r} disagree: {lengths}")


def check_prefix(prefix: str) -> str:
    """Refuse the empty prefix: it would delete every object in the pool, anyone's."""
    if not prefix:
        raise InvalidRequestError("remove_by_prefix: an empty prefix would remove every object")
    return prefix


def check_whole(
    operation: str, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
) -> None:
    """`check_batch` for the whole-object calls: one pointer and size per piece."""
    check_batch(operation, keys, ("pointer lists", ptrs), ("size lists", sizes))


def check_ranges(
    operation: str,
    keys: Sequence[str],
    ptrs: Sequence[Pointers],
    sizes: Sequence[Sizes],
    offsets: Sequence[Offsets],
) -> None:
    """`check_batch` for the range calls: one pointer, size and offset per piece."""
    check_batch(
        operation, keys, ("pointer lists", ptrs), ("size lists", sizes), ("offset lists", offsets)
    )
