"""The reads of the local caches a save still makes, which its waiter may call off.

A save reads the blocks it stores until its last copy into staging or its last store call
straight from the caches. Once its waiter stops waiting (a deadline), the owner of the
caches may reuse those blocks: a read after that would store another block's bytes
under this key. `call_off()` waits for a read in progress (a copy, or one store call
reading in place), then refuses every later one; what a refused read was for fails.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CacheReads:
    """Whether a save may still read the caches, and who is reading them now."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._reading = 0
        self._off = False

    @contextmanager
    def reading(self) -> Iterator[bool]:
        """Inside: whether the read may go ahead (false once called off); `call_off`
        waits for the reads that were allowed to end."""
        with self._lock:
            allowed = not self._off
            self._reading += allowed
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    self._reading -= 1
                    self._lock.notify_all()

    def call_off(self) -> None:
        """No read of the caches from now on; returns once none is in progress."""
        with self._lock:
            self._off = True
            self._lock.wait_for(lambda: not self._reading)

    @property
    def called_off(self) -> bool:
        return self._off
