"""Start and stop a segment holder process (`python -m hybridkv.transport.holder`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hybridkv.transport.config import parse_size
from hybridkv.transport.master import LOOPBACK, ChildProcess, ServiceProcess

READY_LINE = "ready"  # what the holder prints once its segment is mounted


class SegmentHolder(ServiceProcess):
    """A running holder process; `.stop()` ends it (SIGTERM), `.kill()` crashes it (its
    objects become unreadable)."""

    def __init__(self, child: ChildProcess, master_address: str, size: int) -> None:
        super().__init__(child)
        self.master_address = master_address
        self.size = size

    @classmethod
    def start(
        cls,
        master_address: str,
        size: int | str,
        *,
        hostname: str = LOOPBACK,
        log_path: Path | None = None,
        timeout_s: float = 60.0,
        populate: bool = True,
    ) -> SegmentHolder:
        """Spawn a holder and return once its segment is mounted (and, with `populate`,
        every page of it mapped)."""
        size_bytes = parse_size(size, "size")
        argv = [
            sys.executable, "-m", "hybridkv.transport.holder", "--master", master_address,
            "--segment-size", str(size_bytes), "--hostname", hostname,
        ]  # fmt: skip
        if not populate:
            argv.append("--no-populate")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": hostname, "PYTHONUNBUFFERED": "1"}
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        child = ChildProcess("segment-holder", argv, env, log_path)
        child.wait_until(
            lambda: any(line.strip() == READY_LINE for line in child.log_text().splitlines()),
            "ready",
            timeout_s,
        )
        return cls(child, master_address, size_bytes)
