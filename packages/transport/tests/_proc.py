"""What Linux's /proc says about a process: its memory residency, whether it has stopped."""

from __future__ import annotations

import os
import time


def resident_bytes(pid: int | str = "self") -> int:
    """The process's resident set (VmRSS) in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of `pid` has stopped (after SIGSTOP, which a busy machine may
    take a moment to deliver to each: meanwhile the process still answers requests)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rpartition(")")[2].split()[0])
            except OSError:
                continue  # the thread exited
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} not stopped after {timeout_s} s")
