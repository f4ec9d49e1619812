"""Which prefixes of vLLM's own prefix cache hold KV computed since the last cache reset.

vLLM resets the connector even when its own reset is refused (requests hold blocks), and
then keeps its older blocks: a local hit after the connector's reset may be KV from before
it, and every block a request computes over such a hit attends to that KV. Saved under
the new generation's keys, it would reach instances whose reset succeeded. The scheduler
remembers the prefixes that requests it saw since the reset computed or loaded over a
fresh hit; a request whose local hit is not among them saves nothing.

Bounded, least recently used first out: a forgotten prefix only costs saves, never
correctness.
"""

from __future__ import annotations

# About two million tokens of prefixes at vLLM's 16-token hash blocks, a few MiB.
MAX_FRESH_PREFIXES = 1 << 17


class FreshPrefixes:
    """Hashes naming prefixes whose KV was computed (or loaded) since the last reset."""

    __slots__ = ("_capacity", "_hashes")

    def __init__(self, capacity: int = MAX_FRESH_PREFIXES) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._hashes: dict[bytes, None] = {}  # insertion order: least recently used first

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, prefix_hash: bytes) -> None:
        self._hashes.pop(prefix_hash, None)
        self._hashes[prefix_hash] = None
        if len(self._hashes) > self._capacity:
            del self._hashes[next(iter(self._hashes))]

    def holds(self, prefix_hash: bytes) -> bool:
        """Whether the prefix is known fresh (and, if so, it is used again: kept longer)."""
        if prefix_hash not in self._hashes:
            return False
        self.add(prefix_hash)
        return True

    def clear(self) -> None:
        self._hashes.clear()
