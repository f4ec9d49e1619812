"""A process that only lends memory to the Mooncake pool, so objects outlive their writer.

Objects live in the segment of the client that stored them; a writer that mounts no
segment (global_segment_size 0) stores into this holder's, and what it wrote stays readable
after it exits. Run `python -m hybridkv.transport.holder --master HOST:PORT --segment-size
1GB`; it prints "ready" once its segment is mounted and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType

from hybridkv.transport.config import MooncakeConfig, parse_size
from hybridkv.transport.master import LOOPBACK, ChildProcess
from hybridkv.transport.mooncake_store import MooncakeStore

READY_LINE = "ready"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.transport.holder")
    parser.add_argument("--master", required=True, help="master address, host:port")
    parser.add_argument(
        "--segment-size", "--size", required=True, help="memory lent to the pool, e.g. 1GB"
    )
    parser.add_argument("--local-buffer-size", default="16MB", help="client staging buffer")
    parser.add_argument("--hostname", default=LOOPBACK, help="address peers reach this at")
    args = parser.parse_args(argv)

    config = MooncakeConfig(
        master_server_address=args.master,
        global_segment_size=parse_size(args.segment_size, "--segment-size"),
        local_buffer_size=parse_size(args.local_buffer_size, "--local-buffer-size"),
        local_hostname=args.hostname,
    )
    if config.global_segment_size == 0:
        parser.error("--segment-size must be positive: lending memory is all a holder does")

    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    store = MooncakeStore.connect(config)
    try:
        print(READY_LINE, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        store.close()
    return 0


class SegmentHolder:
    """A running holder process; `.stop()` ends it (SIGTERM), `.kill()` crashes it."""

    def __init__(self, child: ChildProcess, master_address: str, size: int) -> None:
        self._child = child
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
    ) -> SegmentHolder:
        """Spawn a holder and return once its segment is mounted."""
        size_bytes = parse_size(size, "size")
        argv = [
            sys.executable, "-m", "hybridkv.transport.holder", "--master", master_address,
            "--segment-size", str(size_bytes), "--hostname", hostname,
        ]  # fmt: skip
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": hostname, "PYTHONUNBUFFERED": "1"}
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        child = ChildProcess("segment-holder", argv, env, log_path)
        child.wait_until(lambda: _printed_ready(child.log_path), "ready", timeout_s)
        return cls(child, master_address, size_bytes)

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def log_path(self) -> Path:
        return self._child.log_path

    def running(self) -> bool:
        return self._child.running()

    def kill(self) -> None:
        """Crash it (SIGKILL), for fault tests: its objects become unreadable."""
        self._child.kill()

    def stop(self) -> None:
        self._child.stop()

    def __enter__(self) -> SegmentHolder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _printed_ready(log_path: Path) -> bool:
    try:
        with open(log_path, errors="replace") as log:
            return any(line.strip() == READY_LINE for line in log)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
