"""The README's recipe as users run it: vLLM's OpenAI API server and its completions API.

Everything else in this suite drives vLLM through `LLM`; here two API servers run one
after the other, each its own process tree (API server, engine core), with the connector
named only by `kv_connector` (the plugin entry point registers it) and the Mooncake
settings from `MOONCAKE_CONFIG_PATH`. The first server stores a prompt's KV and is shut
down; the second, started afterwards, must load it (vLLM's own external-hit counter on
`/metrics` says how much, and so do hybridkv's own counters there) and answer exactly as
the first did: same tokens, same top-5 logprobs. Stopping a server leaves no file of
ours in its temp directory. These two move whole blocks (`use_layerwise` off: the
configuration's default), so their load and save latency histograms fill; every metric
the Grafana dashboard in docs/ queries is on their `/metrics`.

A third server runs two data-parallel engines (`--data-parallel-size 2`; for a dense
model vLLM runs them as independent engines, each with its own scheduler, worker and
hybridkv lookup): a prompt sent to engine 0 (vLLM's `X-data-parallel-rank` header) is
stored, and engine 1, which never saw it, loads it from the pool and answers the same.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import tinymodels
from api_server import (
    COUNTERS,
    EXTERNAL_HITS,
    FAILED_LOADS,
    HIT_REQUESTS,
    HYBRIDKV_HITS,
    HYBRIDKV_LOADED,
    LOAD_SECONDS_TIMED,
    LOADS_TIMED,
    MODEL,
    QUERIED,
    SAVES_TIMED,
    served,
)
from conftest import Pool
from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS, MODELS, thread_binding

from hybridkv.transport.testing import free_ports

PROMPT = tinymodels.prompt_ids(90, 4 * MAX_NUM_BATCHED_TOKENS + 1)
EXPECTED_HIT = (len(PROMPT) - 1) // BLOCK * BLOCK  # a multiple of the prefill chunk too


Served = tuple[dict[str, Any], dict[str, float]]  # the answer, the counters it moved
WATCHED = (*COUNTERS, QUERIED, HIT_REQUESTS, LOADS_TIMED, LOAD_SECONDS_TIMED, SAVES_TIMED)
DASHBOARD = Path(__file__).parents[1] / "docs" / "grafana" / "hybridkv.json"
METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*")  # PromQL: only these have ":"


@pytest.fixture(scope="module")
def serve_temp(runs_dir: Path) -> Path:
    """The servers' TMPDIR."""
    temp = runs_dir / "serve-tmp"
    temp.mkdir()
    return temp


@pytest.fixture(scope="module")
def metrics_pages() -> dict[str, str]:
    """Each of `served_twice`'s servers' `/metrics` page, read once it counted its request."""
    return {}


@pytest.fixture(scope="module")
def served_twice(
    vllm_ready: None,
    pool: Pool,
    models_dir: Path,
    runs_dir: Path,
    serve_temp: Path,
    metrics_pages: dict[str, str],
) -> tuple[Served, Served]:
    """What the writing server, then the reading one, answered and counted."""
    model = tinymodels.build(MODEL, models_dir, **MODELS[MODEL]).path
    env = {"MOONCAKE_CONFIG_PATH": str(pool.config_path), "TMPDIR": str(serve_temp)}
    runs = []
    for name in ("writer", "reader"):
        log = runs_dir / f"serve-{name}.log"
        with served(model, env, log, extra={"use_layerwise": False}) as server:
            runs.append(server.complete_counted(PROMPT, WATCHED))
            metrics_pages[name] = server.get("/metrics")
    return runs[0], runs[1]


def test_second_server_loads_what_the_first_stored(served_twice: tuple[Served, Served]) -> None:
    (_, writer), (_, reader) = served_twice
    assert writer[EXTERNAL_HITS] == 0
    assert reader[EXTERNAL_HITS] == EXPECTED_HIT
    # the servers recompute a failed load (kv_load_failure_policy "recompute"): only this
    # tells that the answer below was computed on the pool's KV
    assert reader[FAILED_LOADS] == 0


def test_hybridkv_counters_are_on_the_servers_metrics(served_twice: tuple[Served, Served]) -> None:
    (_, writer), (_, reader) = served_twice
    assert writer[HYBRIDKV_HITS] == 0
    assert reader[HYBRIDKV_HITS] == EXPECTED_HIT
    # every full-attention block, and the conv state of the block ending at the hit only
    assert reader[HYBRIDKV_LOADED] == EXPECTED_HIT // BLOCK + 1


def test_hit_rate_and_latency_metrics_are_on_the_servers_metrics(
    served_twice: tuple[Served, Served],
) -> None:
    (_, writer), (_, reader) = served_twice
    # both asked the pool for the whole prompt (vLLM's own cache empty): one missed, one hit
    assert writer[QUERIED] == reader[QUERIED] == len(PROMPT)
    assert (writer[HIT_REQUESTS], reader[HIT_REQUESTS]) == (0, 1)
    assert 0.9 < reader[HYBRIDKV_HITS] / reader[QUERIED] < 1  # all but the last partial block
    # the reader timed its load(s), the writer its saves; each took some time, under a minute
    assert writer[LOADS_TIMED] == 0
    assert reader[LOADS_TIMED] >= 1
    assert 0 < reader[LOAD_SECONDS_TIMED] / reader[LOADS_TIMED] < 60
    assert writer[SAVES_TIMED] >= 1


def test_every_metric_the_dashboard_queries_is_on_the_servers_metrics(
    served_twice: tuple[Served, Served], metrics_pages: dict[str, str]
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for query in queries for name in METRIC_NAME.findall(query)}
    assert len(used) > 10
    for page in metrics_pages.values():
        exposed = {line.split("{")[0].split(" ")[0] for line in page.splitlines()}
        assert used <= exposed, used - exposed


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


# CI runs the default (sockets); the fixed port runs with `-m extended` (its channel is
# covered by the integration suite's lookup tests).
@pytest.fixture(scope="module", params=["socket", pytest.param("port", marks=pytest.mark.extended)])
def data_parallel(
    request: pytest.FixtureRequest, vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path
) -> tuple[Served, Served, list[str]]:
    """What engine 0, then engine 1, of one two-engine server answered and counted, and
    the files of ours its temp directory held once it stopped. Lookups over Unix sockets
    (the default), or over a fixed lookup_rpc_port: each engine takes the port plus its
    rank (vLLM resets data_parallel_rank to 0 in the engines of a dense model)."""
    lookup = request.param
    extra: dict[str, Any] = {"namespace": f"serve-dp-{lookup}"}  # each run stores anew
    if lookup == "port":
        extra["lookup_rpc_port"] = free_ports(2)
    model = tinymodels.build(MODEL, models_dir, **MODELS[MODEL]).path
    temp = runs_dir / f"serve-dp-{lookup}-tmp"
    temp.mkdir()
    env = {
        "MOONCAKE_CONFIG_PATH": str(pool.config_path),
        "TMPDIR": str(temp),
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(2),
    }
    runs = []
    log = runs_dir / f"serve-dp-{lookup}.log"
    with served(model, env, log, data_parallel=2, extra=extra) as server:
        for engine in (0, 1):
            runs.append(server.complete_counted(DP_PROMPT, engine=engine))
    return runs[0], runs[1], [path.name for path in temp.rglob("hybridkv*")]


def test_a_data_parallel_engine_loads_what_the_other_stored(
    data_parallel: tuple[Served, Served, list[str]],
) -> None:
    (first, stored), (second, loaded), left = data_parallel
    assert stored[EXTERNAL_HITS] == 0
    assert loaded[EXTERNAL_HITS] == loaded[HYBRIDKV_HITS] == DP_EXPECTED_HIT
    assert loaded[FAILED_LOADS] == 0  # not recomputed
    assert second["logprobs"] == first["logprobs"]
    assert left == []
