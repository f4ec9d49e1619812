"""Soak: an API server with hybridkv serves a steady stream while its pool fails in turns.

A Mooncake master and a segment holder on loopback, and vLLM's OpenAI API server (the
tiny LFM2 model: full attention and conv state, two KV cache groups) with the connector
as the README configures it. One client sends completions one after another (a new one
every `--interval` seconds at most), over a few prompts that share nothing; after each
round over them vLLM's own prefix cache is emptied, so the next round asks the pool. The
first round, with the pool empty, is the cold reference: every later answer (tokens and
top-5 logprobs) must equal its prompt's cold one exactly. One request at a time: LFM2's
conv state is computed differently when prompts share a batch, so concurrent requests
would differ from cold for reasons of vLLM's own.

Meanwhile a harness takes the pool down in turns, each outage `--outage` seconds with
`--steady` seconds of quiet between: the holder stalled (SIGSTOP, then SIGCONT), the
holder killed (a new one started at the end; its objects are lost), the master stalled,
the master killed (a new one started on the same port at the end, and a new holder, since
the old one's segment was mounted at the dead master: all objects are lost).

Reported: requests served, errors (HTTP errors and timeouts; target 0), answers that
differ from cold (target 0), TTFT (time to the first streamed token) p50/p99 while steady
and during each kind of outage (a request counts for the outage it overlapped, from its
start to its first token; steady if none), and the
resident memory and thread count of the server's processes after the cold round and at the
end. Everything started here is stopped by PID at the end, on error too.

Run: `python benchmarks/bench_soak.py [--seconds 600]` (`nox -s bench -- soak`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))  # shared harness
# The API server as the e2e tests start it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests-e2e"))

import tinymodels
from api_server import MODEL, Server, served
from scenario import MODELS
from vllm_instance import write_pool_config

from hybridkv.transport import MasterProcess, SegmentHolder
from hybridkv.transport.master import LOOPBACK

HOLDER_SIZE = 256 << 20
PROMPT_TOKENS = 321  # ten 32-token blocks and one token
PROMPT_SEEDS = (501, 502, 503, 504)
MAX_TOKENS = 4
REQUEST_TIMEOUT_S = 120.0
STEADY = "steady"


class Pool:
    """The master and the holder the server stores into; restarted as the faults ask."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.master = MasterProcess.start(log_path=directory / "master-0.log")
        self.port = self.master.rpc_port
        try:
            self.holder = self._new_holder()
        except BaseException:
            self.master.stop()
            raise
        self.config = write_pool_config(directory / "mooncake.json", self.master.address)
        self._generation = 0

    def _new_holder(self) -> SegmentHolder:
        return SegmentHolder.start(
            self.master.address, HOLDER_SIZE, log_path=self.directory / "holder.log"
        )

    def restart_holder(self) -> None:
        self.holder.kill()
        self.holder = self._new_holder()

    def restart_master(self) -> None:
        self._generation += 1
        log = self.directory / f"master-{self._generation}.log"
        self.master = MasterProcess.start(rpc_port=self.port, log_path=log)
        self.restart_holder()  # its segment was mounted at the dead master

    def stop(self) -> None:
        for service in (self.holder, self.master):
            with contextlib.suppress(ProcessLookupError):
                os.kill(service.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM
            service.stop()


class Fault(ABC):
    """One kind of outage: `begin` takes a part of the pool down, `end` brings it back."""

    name: str

    @abstractmethod
    def begin(self, pool: Pool) -> None: ...

    @abstractmethod
    def end(self, pool: Pool) -> None: ...


class StallHolder(Fault):
    name = "holder stalled"

    def begin(self, pool: Pool) -> None:
        os.kill(pool.holder.pid, signal.SIGSTOP)

    def end(self, pool: Pool) -> None:
        os.kill(pool.holder.pid, signal.SIGCONT)


class KillHolder(Fault):
    name = "holder killed"

    def begin(self, pool: Pool) -> None:
        pool.holder.kill()

    def end(self, pool: Pool) -> None:
        pool.restart_holder()


class StallMaster(Fault):
    name = "master stalled"

    def begin(self, pool: Pool) -> None:
        os.kill(pool.master.pid, signal.SIGSTOP)

    def end(self, pool: Pool) -> None:
        os.kill(pool.master.pid, signal.SIGCONT)


class KillMaster(Fault):
    name = "master killed"

    def begin(self, pool: Pool) -> None:
        pool.master.kill()

    def end(self, pool: Pool) -> None:
        pool.restart_master()


FAULTS: tuple[Fault, ...] = (StallHolder(), KillHolder(), StallMaster(), KillMaster())


class Harness(threading.Thread):
    """Steady, an outage, steady, the next outage... until `deadline`; `outages` records
    when each was. Any outage in progress at the deadline (or on `halt`) is ended."""

    def __init__(self, pool: Pool, steady_s: float, outage_s: float) -> None:
        super().__init__(name="soak-harness", daemon=True)
        self.pool, self.deadline = pool, 0.0  # set when the stream starts
        self.steady_s, self.outage_s = steady_s, outage_s
        self.outages: list[tuple[str, float, float]] = []  # (fault, began, ended)
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def halt(self) -> None:
        self._halt.set()

    def _quiet(self, seconds: float) -> bool:
        """Wait (never past the deadline); whether time is left and nobody halted."""
        self._halt.wait(max(0.0, min(seconds, self.deadline - time.monotonic())))
        return not self._halt.is_set() and time.monotonic() < self.deadline

    def _fits(self, seconds: float) -> bool:
        return self.deadline - time.monotonic() >= seconds

    def run(self) -> None:
        try:
            turn = 0
            while self._quiet(self.steady_s) and self._fits(self.outage_s):
                fault = FAULTS[turn % len(FAULTS)]
                turn += 1
                began = time.monotonic()
                fault.begin(self.pool)
                try:
                    self._quiet(self.outage_s)
                finally:
                    fault.end(self.pool)
                    self.outages.append((fault.name, began, time.monotonic()))
        except BaseException as exc:
            self.error = exc


@dataclass
class Answer:
    """One streamed completion: its tokens with their top logprobs, and its timing."""

    started: float
    ttft_s: float
    tokens: list[Any] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)


def stream_completion(port: int, model: str, prompt: list[int]) -> Answer:
    """A greedy streamed completion; TTFT is the time to its first token's chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
        "stream": True,
    }
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=REQUEST_TIMEOUT_S)
    started = time.monotonic()
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300]!r}")
        answer: Answer | None = None
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            logprobs = choice.get("logprobs") or {}
            if not logprobs.get("tokens"):
                continue
            if answer is None:
                answer = Answer(started, time.monotonic() - started)
            answer.tokens += logprobs["tokens"]
            answer.top_logprobs += logprobs["top_logprobs"]
    finally:
        connection.close()
    if answer is None or len(answer.tokens) != MAX_TOKENS:
        raise RuntimeError(f"a stream of {0 if answer is None else len(answer.tokens)} tokens")
    return answer


@dataclass
class Tally:
    """What the stream saw."""

    answers: list[Answer] = field(default_factory=list)
    errors: list[tuple[float, float, str]] = field(default_factory=list)  # (from, to, what)
    mismatches: list[tuple[Answer, int]] = field(default_factory=list)  # (answer, prompt)
    loads: list[float] = field(default_factory=list)  # the host's 1-minute load, per request


def process_stats(leader: int) -> tuple[int, int, int]:
    """(processes, resident bytes, threads) of the process group `leader` leads."""
    count = rss = threads = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            if os.getpgid(int(entry)) != leader:
                continue
            fields = dict(
                line.split(":", 1)
                for line in Path(f"/proc/{entry}/status").read_text().splitlines()
            )
            count += 1
            rss += int(fields["VmRSS"].split()[0]) * 1024
            threads += int(fields["Threads"])
    return count, rss, threads


def soak(
    server: Server, port: int, harness: Harness, seconds: float, interval_s: float
) -> tuple[Tally, Any, Any]:
    """The request stream for `seconds` after the cold round, the harness beside it; the
    server's process stats after the cold round and at the end."""
    prompts = [tinymodels.prompt_ids(seed, PROMPT_TOKENS) for seed in PROMPT_SEEDS]
    tally = Tally()
    cold: list[Answer] = []
    for prompt in prompts:  # the pool is empty: cold, and stored
        cold.append(stream_completion(port, server.model, prompt))
    start_stats = process_stats(server.process.pid)
    loads = [os.getloadavg()[0]]
    harness.deadline = time.monotonic() + seconds
    harness.start()
    sent = 0
    while time.monotonic() < harness.deadline:
        index = sent % len(prompts)
        if index == 0:
            server.reset_prefix_cache()  # the next round asks the pool
        began = time.monotonic()
        try:
            answer = stream_completion(port, server.model, prompts[index])
        except Exception as exc:  # an error to count, not a reason to stop
            what = f"{type(exc).__name__}: {exc}"[:200]
            tally.errors.append((began, time.monotonic(), what))
        else:
            tally.answers.append(answer)
            if (answer.tokens, answer.top_logprobs) != (
                cold[index].tokens,
                cold[index].top_logprobs,
            ):
                tally.mismatches.append((answer, index))
        sent += 1
        loads.append(os.getloadavg()[0])
        time.sleep(max(0.0, began + interval_s - time.monotonic()))
    harness.halt()
    harness.join(timeout=120)
    tally.loads = loads
    return tally, start_stats, process_stats(server.process.pid)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def phase_of(began: float, ended: float, outages: list[tuple[str, float, float]]) -> str:
    """The outage [began, ended] overlapped (the first), or steady."""
    for name, down, up in outages:
        if began <= up and down <= ended:
            return name
    return STEADY


def report(tally: Tally, harness: Harness, start: Any, end: Any, seconds: float) -> None:
    outages = harness.outages

    def phase(answer: Answer) -> str:
        return phase_of(answer.started, answer.started + answer.ttft_s, outages)

    print(f"\nbench_soak: {seconds:.0f} s, {len(harness.outages)} outages")
    for name, began, ended in harness.outages:
        print(f"  {name:<15} {ended - began:5.1f} s")
    print(
        f"requests: {len(tally.answers)} served, {len(tally.errors)} errors, "
        f"{len(tally.mismatches)} answers differing from cold"
    )
    for began, ended, what in tally.errors[:10]:
        print(f"  error during {phase_of(began, ended, outages)}: {what}")
    for answer, index in tally.mismatches[:10]:
        print(f"  prompt {index} differed from cold during {phase(answer)}")
    print("TTFT (streamed first token), by the outage a request overlapped until it:")
    for name in (STEADY, *(fault.name for fault in FAULTS)):
        ttfts = [answer.ttft_s for answer in tally.answers if phase(answer) == name]
        if ttfts:
            print(
                f"  {name:<15} n={len(ttfts):4d}  p50 {statistics.median(ttfts) * 1e3:7.0f} ms"
                f"  p99 {percentile(ttfts, 0.99) * 1e3:7.0f} ms  max {max(ttfts) * 1e3:7.0f} ms"
            )
    for label, (count, rss, threads) in (("after cold round", start), ("at end", end)):
        print(f"server ({count} processes) {label}: RSS {rss / 2**20:7.0f} MiB, {threads} threads")
    if tally.loads:  # the host is shared: how busy it was bears on every time above
        print(
            f"host load average (1 min, {os.cpu_count()} CPUs): start {tally.loads[0]:.1f}, "
            f"median {statistics.median(tally.loads):.1f}, max {max(tally.loads):.1f}, "
            f"end {tally.loads[-1]:.1f}"
        )
    if harness.error is not None:
        print(f"harness failed: {harness.error!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="soak length")
    parser.add_argument("--steady", type=float, default=20.0, help="quiet between outages")
    parser.add_argument("--outage", type=float, default=20.0, help="length of each outage")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between requests")
    args = parser.parse_args()
    for name, value in (("MC_TCP_BIND_ADDRESS", LOOPBACK), ("MC_STORE_CLIENT_SETUP_RETRIES", "1")):
        os.environ.setdefault(name, value)
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        directory = Path(tmp)
        model = tinymodels.build(MODEL, directory / "models", **MODELS[MODEL]).path
        pool = Pool(directory)
        try:
            env = {"MOONCAKE_CONFIG_PATH": str(pool.config), "VLLM_SERVER_DEV_MODE": "1"}
            with served(model, env, directory / "server.log") as server:
                port = server.port
                harness = Harness(pool, args.steady, args.outage)
                try:
                    tally, start, end = soak(server, port, harness, args.seconds, args.interval)
                finally:
                    harness.halt()
                    if harness.ident is not None:  # started: let it end the outage it is in
                        harness.join(timeout=120)
                report(tally, harness, start, end, args.seconds)
        finally:
            pool.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
