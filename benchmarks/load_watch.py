"""How busy the machine was around a benchmark: ratios measured on a busy machine mislead."""

from __future__ import annotations

import os


class LoadWatch:
    """Reads the 1-minute load average when made; `report()` adds the one at the end."""

    def __init__(self) -> None:
        self.start = os.getloadavg()[0]

    def report(self) -> str:
        return (
            f"  1-minute load average {self.start:.1f} at the start, {os.getloadavg()[0]:.1f} "
            f"at the end on {os.cpu_count()} CPUs: above ~1 other work skews the ratios"
        )
