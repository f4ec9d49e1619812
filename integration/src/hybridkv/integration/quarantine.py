"""Keys whose load failed, kept out of lookups for a while.

A segment holder that dies takes its objects with it, but the master keeps listing them
until the holder's client TTL runs out (Mooncake's default: 10 s). Without a memory of the
failure every lookup in that time would find them, and every request whose prefix they
hold would load, fail and recompute in turn (the one that failed, asked again by vLLM, in
a loop). A quarantined key counts as absent, so a hit stops before the first block that
failed and the blocks before it are still reused.

Sans-I/O: the clock is passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence


class Quarantine:
    """Keys that count as absent until `seconds` after their (last) failure."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError(f"quarantine must last a positive time, got {seconds} s")
        self.seconds = seconds
        self._clock = clock
        # key -> release time; insertion order is release order (one constant duration).
        self._until: dict[str, float] = {}

    def add(self, keys: Iterable[str]) -> int:
        """Quarantine `keys` from now on; how many of them it did not hold already."""
        self._release()
        until = self._clock() + self.seconds
        fresh = 0
        for key in keys:
            fresh += self._until.pop(key, None) is None  # re-inserted last: released last
            self._until[key] = until
        return fresh

    def holding(self, keys: Sequence[str]) -> list[bool]:
        """Whether each of `keys` is quarantined (one look at the clock for all)."""
        self._release()
        if not self._until:
            return [False] * len(keys)
        return [key in self._until for key in keys]

    def __len__(self) -> int:
        self._release()
        return len(self._until)

    def _release(self) -> None:
        now = self._clock()
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[key]
