"""The store operations hybridkv needs, independent of any one backend.

The shape follows Mooncake's batch range/session API because it is the richest backend;
an in-memory store and other pools (Memcache) implement the same protocol. Every batch call
returns one `Status` per key so that one bad key never hides the fate of the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from hybridkv.transport.errors import Status

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

    def batch_is_readable(self, keys: Sequence[str]) -> list[bool]:
        """True for keys committed and readable now; allocated-but-open objects are False."""

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

    def close(self) -> None:
        """Release the client; any later call raises `StoreClosed`, never crashes."""
