"""Waiting on work that may hang, for a while at most: the connector's shutdown waits so
for the worker's transfers (vLLM kills workers that take more than a few seconds to stop).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def finished_within(work: Callable[[], None], seconds: float, name: str) -> bool:
    """Run `work` on a daemon thread; whether it returned within `seconds` (what it
    raised is raised here). A daemon thread still running does not keep the process;
    where no thread can start (at interpreter exit), `work` runs here, unbounded."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:
        work()
        return True
    thread.join(seconds)
    if errors:
        raise errors[0]
    return not thread.is_alive()
