"""A process that only lends memory to the Mooncake pool, so objects outlive their writer.

Objects live in the segment of the client that stored them; a writer that mounts no
segment (global_segment_size 0) stores into this holder's, and what it wrote stays readable
after it exits. Run `python -m hybridkv.transport.holder --master HOST:PORT --segment-size
1GB`; it maps every page of its segment (unless `--no-populate`), prints "ready" once the
segment is mounted and serves until SIGTERM or SIGINT.
This module is the command line only, so that the package never imports it (running it
with -m would then warn); `segment_holder.SegmentHolder` starts it from Python.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from hybridkv.transport.config import MooncakeConfig, parse_size
from hybridkv.transport.master import LOOPBACK
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.segment_holder import READY_LINE, SegmentHolder
from hybridkv.transport.segment_prefault import new_regions, populate, writable_anonymous_regions

__all__ = ["SegmentHolder", "main"]  # SegmentHolder stays importable from here too


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.transport.holder")
    parser.add_argument("--master", required=True, help="master address, host:port")
    parser.add_argument(
        "--segment-size", "--size", required=True, help="memory lent to the pool, e.g. 1GB"
    )
    parser.add_argument("--local-buffer-size", default="16MB", help="client staging buffer")
    parser.add_argument("--hostname", default=LOOPBACK, help="address peers reach this at")
    parser.add_argument(
        "--no-populate",
        dest="populate",
        action="store_false",
        help="leave the segment's pages to be mapped on first use (default: map them all "
        "at start, so first puts are not slowed and a host that cannot back the segment "
        "fails now, not mid-run)",
    )
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
    before = writable_anonymous_regions()
    store = MooncakeStore.connect(config)
    try:
        if args.populate:
            segment = new_regions(before, at_least=config.global_segment_size)
            print(f"populated {populate(segment)} B", flush=True)
        print(READY_LINE, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
