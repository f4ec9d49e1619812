"""What a transfer still does to the local caches, which its waiter may call off.

A save reads the blocks it stores until its last copy into staging or its last store call
straight from the caches; a load writes the blocks it fills until its last copy out of
staging or its last store call straight into them. Once the waiter stops waiting (a
deadline), the owner of the caches may reuse those blocks: a save reading after that would
store another block's bytes under its key, a load writing after that would overwrite KV
vLLM computed since. `call_off()` waits for an access in progress (a copy, or one store
call in place), then refuses every later one; what a refused access was for fails.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CacheAccess:
    """Whether a transfer may still touch the caches, and who is touching them now."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._active = 0
        self._off = False

    @contextmanager
    def touching(self) -> Iterator[bool]:
        """Inside: whether the access may go ahead (false once called off); `call_off`
        waits for the accesses that were allowed to end."""
        with self._lock:
            allowed = not self._off
            self._active += allowed
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    self._active -= 1
                    self._lock.notify_all()

    def call_off(self) -> None:
        """No access to the caches from now on; returns once none is in progress."""
        with self._lock:
            self._off = True
            self._lock.wait_for(lambda: not self._active)
