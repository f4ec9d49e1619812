"""Get-session pins of one client, counted across the steps that hold them.

Mooncake keeps one get session per (client, key): a second start on a pinned key answers
OK and renews it, and the first end releases it for everyone. Two overlapping steps that
load one key (two requests sharing a prefix, scheduled before either computed it) would
end each other's pin, and the other's next read would fail and pay a re-pin and a retry.
So each step holds its keys here, and a key's session ends when the last holder lets go.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class GetPins:
    """How many steps hold each pinned key; safe from any thread."""

    def __init__(self) -> None:
        self._holders: Counter[str] = Counter()
        self._lock = threading.Lock()

    def hold(self, keys: Iterable[str]) -> None:
        """One more holder for each of `keys` (distinct), pinned by its caller."""
        with self._lock:
            self._holders.update(keys)

    def release(self, keys: Iterable[str]) -> list[str]:
        """One holder fewer for each of `keys` (distinct, each held by the caller); those
        nobody holds any more, whose session the caller ends."""
        unheld = []
        with self._lock:
            for key in keys:
                self._holders[key] -= 1
                if self._holders[key] <= 0:
                    del self._holders[key]
                    unheld.append(key)
        return unheld

    def __len__(self) -> int:
        with self._lock:
            return len(self._holders)
