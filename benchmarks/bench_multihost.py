"""Time to first token across hosts with added round-trip time: whole-block vs layerwise loads.

Every component is a host of its own (network namespaces, `tests-e2e/netns.py`): master,
segment holder, writer, reader, and a delaying relay (`tests-e2e/delay_relay.py`). This
kernel has no netem, so the holder advertises the relay's address and the relay adds the
round trip (0, 1, 5 ms by default) to everything that reaches the holder. The 0 ms row goes
through the relay too: it is the baseline the others compare with (the relay, in Python,
costs time of its own). The writer stores a shared prefix whole-block, once; then, at each
round trip, a whole-block reader and a layerwise reader load it (llama: every layer loaded
before it is used). TTFT is vLLM's `first_token_latency`, medians of `--repeats` requests
after a warm-up request, each instance a process of its own; the exposed tail is the
forward time a layerwise load left blocked on transfers (the connector's counters).
Needs root. Run: `python benchmarks/bench_multihost.py` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests-e2e"))  # hosts, relay

import tinymodels
from figures import CHUNK, ms, transfer_median, ttft, ttft_spec
from netns import TestNetwork, missing_capability, wait_until
from vllm_instance import PromptResult, run_instance, write_pool_config

from hybridkv.transport.master import ChildProcess, find_master_binary

RPC_PORT = 50051
HOSTS = ("master", "holder", "relay", "writer", "reader")
RELAY = Path(__file__).resolve().parents[1] / "tests-e2e" / "delay_relay.py"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def _listening_ports(pid: int) -> list[int]:
    """TCP ports listening in the network namespace of process `pid`."""
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


class Hosts:
    """Master and holder on hosts of their own, the holder reached through the relay."""

    def __init__(self, network: TestNetwork, logs: Path) -> None:
        self.network = network
        self.logs = logs
        self.children: list[ChildProcess] = []
        self.relay: ChildProcess | None = None
        master = network["master"]
        self.address = f"{master.address}:{RPC_PORT}"
        argv = [
            str(find_master_binary()), f"--rpc_address={master.address}",
            f"--rpc_port={RPC_PORT}", f"--metrics_host={master.address}",
            "--default_kv_lease_ttl=5000", "--logtostderr=true",
        ]  # fmt: skip
        child = self._start("master", argv, {"MC_TCP_BIND_ADDRESS": master.address})
        wait_until(lambda: master.listens(child.pid, RPC_PORT), "the master listening", 30)
        # The holder listens on every address of its host and advertises the relay's.
        argv = [
            sys.executable, "-m", "hybridkv.transport.holder", "--master", self.address,
            "--segment-size", "1GB", "--hostname", network["relay"].address,
        ]  # fmt: skip
        self.holder = self._start("holder", argv, {})
        wait_until(lambda: "ready" in self.holder.log_text().split(), "the holder ready", 120)
        self.holder_ports = _listening_ports(self.holder.pid)

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> ChildProcess:
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        if "MC_TCP_BIND_ADDRESS" not in env:
            environment.pop("MC_TCP_BIND_ADDRESS", None)
        child = ChildProcess(
            name, self.network[name].argv(argv), environment, self.logs / f"{name}.log"
        )
        self.children.append(child)
        return child

    def add_round_trip(self, rtt_ms: float) -> None:
        """Restart the relay with `rtt_ms` added to every round trip to the holder."""
        if self.relay is not None:
            self.relay.stop()
        relay, holder = self.network["relay"].address, self.network["holder"].address
        argv = [sys.executable, str(RELAY), relay, holder, str(rtt_ms / 2000)]
        relay_child = self._start("relay", [*argv, *map(str, self.holder_ports)], {})
        wait_until(lambda: "relaying" in relay_child.log_text(), "the relay listening", 30)
        self.relay = relay_child

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, hosts: Hosts) -> None:
        self.args = args
        self.root = root
        self.hosts = hosts
        self.model = tinymodels.build("llama", root / "models", args.layers, args.hidden)
        prefix = tinymodels.prompt_ids(1, args.prefix_tokens)
        self.warm = [prefix + tinymodels.prompt_ids(100 + i, 16) for i in range(args.repeats)]
        self.fresh = [
            tinymodels.prompt_ids(200 + i, len(self.warm[0])) for i in range(args.repeats)
        ]

    def run(
        self, name: str, host: str, connector: dict[str, object] | None, prompts: list[list[int]]
    ) -> list[PromptResult]:
        spec = ttft_spec(str(self.model.path), self.args.prefix_tokens, connector, [prompts])
        address = self.hosts.network[host].address
        config = write_pool_config(
            self.root / f"mooncake-{host}.json", self.hosts.address, local_hostname=address
        )
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "MOONCAKE_CONFIG_PATH": str(config),
            "MC_TCP_BIND_ADDRESS": address,
        }
        launcher = self.hosts.network[host].argv([])
        result = run_instance(spec, self.root / "runs", name, env, launcher=launcher)
        return result.steps[1].prompts


def main() -> int:
    args = _parse_args()
    # A stop (SIGTERM) must still remove the hosts and stop their processes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    why = missing_capability()
    if why is not None:
        print(f"bench_multihost: {why}", file=sys.stderr)
        return 1
    network = TestNetwork(HOSTS)
    try:
        with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as scratch:
            root = Path(scratch)
            hosts = Hosts(network, root)
            try:
                return _measure(Bench(args, root, hosts), args)
            finally:
                hosts.close()
    finally:
        network.close()


def _measure(bench: Bench, args: argparse.Namespace) -> int:
    shared: dict[str, object] = {"namespace": "bench"}
    print(
        f"bench_multihost: llama, {args.layers} layers, hidden {args.hidden}, float32; prompt "
        f"{len(bench.warm[0])} tokens ({args.prefix_tokens} shared), {CHUNK}-token chunks; "
        f"TTFT medians of {args.repeats} requests; master, holder, relay, writer, reader "
        "each on a host of its own",
        flush=True,
    )
    cold = ttft(bench.run("cold", "reader", None, bench.fresh))
    print(f"  cold, no connector: TTFT {ms(cold)} ms", flush=True)
    bench.hosts.add_round_trip(0.0)
    bench.run("writer", "writer", shared, bench.warm[:1])
    print(
        "\n  added RTT | whole-block: TTFT  cold/warm | layerwise: TTFT  cold/warm  "
        "layerwise/whole  load_wait  exposed tail   (ms)",
        flush=True,
    )
    for rtt in args.rtt_ms:
        bench.hosts.add_round_trip(rtt)
        whole = bench.run(f"whole-{rtt}", "reader", shared, bench.warm)
        layered = bench.run(
            f"layerwise-{rtt}", "reader", {**shared, "use_layerwise": True}, bench.warm
        )
        hits = {p.external_hit_tokens for p in whole + layered}
        w, lw = ttft(whole), ttft(layered)
        print(
            f"  {rtt:6.1f} ms | {ms(w)}  {cold / w:8.2f}x | {ms(lw)}  {cold / lw:8.2f}x  "
            f"{lw / w:14.2f}x  {ms(transfer_median(layered, 'load_wait_s'))}  "
            f"{ms(transfer_median(layered, 'exposed_tail_s'))}   hits {sorted(hits)}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
