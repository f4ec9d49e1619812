"""Whether the master answers, as the last call found it, and the probe that finds it back.

Once a call gets no answer, callers are told at once that the master is down while one
background thread asks it until it answers: no caller waits out a timeout twice. The probe
is a real call, not a connect: a stalled master's kernel still accepts connections, and
each call there waits the whole RPC timeout (`store_timeout_s`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from hybridkv.transport.errors import StoreClosed

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5


class MasterHealth:
    """Down from `failed()` until the probe's `answers()` says otherwise.

    `reachable()`: a cheap check run first (is the port, or etcd, accepting connections);
    `answers()`: a real master call, true when it got an answer. Either raises
    `StoreClosed` to end the probe.
    """

    def __init__(
        self,
        reachable: Callable[[], bool],
        answers: Callable[[], bool],
        interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self._reachable, self._answers = reachable, answers
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._down = False
        self._stop = threading.Event()

    @property
    def down(self) -> bool:
        return self._down

    def failed(self) -> None:
        """A call got no answer: down, and a probe asks until the master answers again."""
        with self._lock:
            if self._down or self._stop.is_set():
                return
            self._down = True
        logger.warning("Mooncake master gave no answer: calls fail at once until it answers")
        threading.Thread(target=self._probe, name="hybridkv-master-probe", daemon=True).start()

    def close(self) -> None:
        """End the probe at its next check (a probe call in flight runs to its end)."""
        self._stop.set()

    def _probe(self) -> None:
        try:
            while not self._stop.wait(self._interval_s):
                if self._reachable() and self._answers():
                    with self._lock:
                        self._down = False
                    logger.warning("Mooncake master answers again: calls go through")
                    return
        except StoreClosed:  # nobody is left to tell
            pass
