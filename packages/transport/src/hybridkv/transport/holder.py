"""A process that only lends memory to the Mooncake pool, so objects outlive their writer.

Objects live in the segment of the client that stored them; a writer that mounts no
segment (global_segment_size 0) stores into this holder's, and what it wrote stays readable
after it exits. Run `python -m hybridkv.transport.holder --config mooncake.json` (the file
every other component reads; flags override its fields) or with `--master HOST:PORT
--segment-size 1GB`; it maps every page of its segment (unless `--no-populate`), prints
"ready" once the segment is mounted and serves until SIGTERM or SIGINT. With `--http-port`
it answers `/health` and `/metrics` (see `holder_http`).
This module is the command line only, so that the package never imports it (running it
with -m would then warn); `segment_holder.SegmentHolder` starts it from Python.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

from hybridkv.transport.holder_http import HolderHttp, HolderState
from hybridkv.transport.master import LOOPBACK
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.segment_holder import READY_LINE, SegmentHolder, holder_config
from hybridkv.transport.segment_prefault import new_regions, populate, writable_anonymous_regions

__all__ = ["SegmentHolder", "main"]  # SegmentHolder stays importable from here too

# flag destination -> the Mooncake config field it overrides
FLAG_FIELDS = {
    "master": "master_server_address",
    "segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
    "hostname": "local_hostname",
    "protocol": "protocol",
    "device_name": "device_name",
    "metadata_server": "metadata_server",
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The arguments, and the Mooncake fields the flags given override."""
    parser = argparse.ArgumentParser(prog="python -m hybridkv.transport.holder")
    parser.add_argument(
        "--config",
        help="Mooncake JSON config (as MOONCAKE_CONFIG_PATH names for vLLM); the flags "
        "below override its fields",
    )
    parser.add_argument("--master", help="master address, host:port (master_server_address)")
    parser.add_argument(
        "--segment-size", "--size", help="memory lent to the pool, e.g. 1GB (global_segment_size)"
    )
    parser.add_argument("--local-buffer-size", help="client staging buffer (default 16MB)")
    parser.add_argument("--hostname", help=f"address peers reach this at (default {LOOPBACK})")
    parser.add_argument("--protocol", help="transfer protocol: tcp (default) or rdma")
    parser.add_argument("--device-name", help="RDMA device(s), e.g. mlx5_0")
    parser.add_argument(
        "--metadata-server", help="P2PHANDSHAKE (default) or the metadata server's URL"
    )
    parser.add_argument(
        "--http-host", default=LOOPBACK, help=f"address of /health and /metrics ({LOOPBACK})"
    )
    parser.add_argument(
        "--http-port", type=int, help="serve /health and /metrics on this port (default: off)"
    )
    parser.add_argument(
        "--no-populate",
        dest="populate",
        action="store_false",
        help="leave the segment's pages to be mapped on first use (default: map them all "
        "at start, so first puts are not slowed and a host that cannot back the segment "
        "fails now, not mid-run)",
    )
    args = parser.parse_args(argv)
    overrides = {
        field: getattr(args, flag)
        for flag, field in FLAG_FIELDS.items()
        if getattr(args, flag) is not None
    }
    if args.config is None and not {"master_server_address", "global_segment_size"} <= set(
        overrides
    ):
        parser.error("give --config, or --master and --segment-size")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        config = holder_config(args.config, overrides)
    except (OSError, ValueError) as exc:
        print(f"holder: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    state = HolderState(config.global_segment_size, config.master_server_address)
    server = None if args.http_port is None else HolderHttp(args.http_host, args.http_port, state)
    if server is not None:
        print(f"serving /health and /metrics at http://{server.address}", flush=True)
    before = writable_anonymous_regions()
    try:
        store = MooncakeStore.connect(config)
        try:
            if args.populate:
                segment = new_regions(before, at_least=config.global_segment_size)
                print(f"populated {populate(segment)} B", flush=True)
            state.mounted = True
            print(READY_LINE, flush=True)
            while not stop.wait(1.0):
                pass
        finally:
            state.mounted = False
            store.close()
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
