"""What Linux's /proc says about a process: its memory residency."""

from __future__ import annotations


def resident_bytes(pid: int | str = "self") -> int:
    """The process's resident set (VmRSS) in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")
