"""A whole-object save or load running in the background, and how to wait for it.

Its result is complete only once its jobs ran and every write it rides on settled: saves
that ride on another transfer's write of the same key carry that write's failure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from hybridkv.transport.outcome import Outcome, TransferResult
from hybridkv.transport.pipeline import Job


class Ticket:
    """A transfer running in the background; `wait()` returns its result or raises.

    Saves that ride on another transfer's write of the same key complete when that write
    settles, and carry its failure: one riding on an open layerwise step's write waits
    for that step's `finish()`, so the thread that finishes the step must not wait for
    the ticket first (the integration never mixes whole saves with open steps).
    """

    def __init__(self, jobs: Sequence[Job], outcomes: Sequence[Outcome]) -> None:
        self._jobs = list(jobs)
        self._outcomes = list(outcomes)

    @property
    def done(self) -> bool:
        """True once every job ran and every write this rides on settled."""
        jobs_done = all(job.done for job in self._jobs)
        return jobs_done and not any(outcome.riding for outcome in self._outcomes)

    def blamed_keys(self) -> list[str]:
        """Keys the store failed so far (see `TransferResult.blamed_keys`), also once
        `wait()` raised: what a load that raised still knows to distrust."""
        return [key for outcome in self._outcomes for key in outcome.result().blamed_keys]

    def wait(self, timeout: float | None = None) -> TransferResult:
        """The result; raises TimeoutError if it is not complete within `timeout` in all."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for job in self._jobs:
            job.wait(left())
        result = TransferResult()
        for outcome in self._outcomes:
            outcome.wait_riders(left())
            result = result.merged(outcome.result())
        return result

    def call_off(self) -> None:
        """A transfer its waiter gives up on: once this returns it touches the caches no
        more (an access in progress ended: a copy, or one store call in place). A save
        fails what it has not read yet, never written (what it read may still be stored);
        a load fails every block it has not written yet, and its store calls may still
        run into staging, never into the caches."""
        for outcome in self._outcomes:
            outcome.cache_access.call_off()
