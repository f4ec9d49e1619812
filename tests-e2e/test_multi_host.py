"""Every component on a host of its own: master, two segment holders, writer, reader.

Each host is a network namespace with its own address on a private bridge (`netns.py`):
no component reaches another through a shared loopback, so every address, port and
`local_hostname` must be right for the KV to flow. The writer stores and exits; the
reader, started afterwards on another host, loads what the writer left in both holders
and answers exactly as a cold run does, with the hits counted exactly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tinymodels
from api_server import (
    EXTERNAL_HITS,
    FAILED_LOADS,
    QUARANTINED,
    SAVED,
    Phase,
    served,
)
from netns import TestNetwork, missing_capability, wait_until
from scenario import BLOCK, LOGPROB_TOLERANCE, MAX_NUM_BATCHED_TOKENS, READER_PROMPTS, Reference
from vllm_instance import (
    InstanceSpec,
    PromptResult,
    Step,
    logprob_gap,
    run_instance,
    write_pool_config,
)

from hybridkv.transport.master import ChildProcess, find_master_binary
from hybridkv.transport.testing import require_mooncake, require_real

HOSTS = ("master", "holder1", "holder2", "writer", "reader")
HOLDERS = ("holder1", "holder2")
RPC_PORT = 50051  # each host has its own ports: the well-known ones are free there
HTTP_PORT = 9003
HOLDER_SIZE = 192 << 20
WRITTEN = ("same_prompt", "corrupted", "corrupted_other_group")
# What the reader runs, with the external hit each must get.
EXPECTED_HITS = {"same_prompt": 384, "shared_prefix": 256, "corrupted": 256}

# A prompt of 16 blocks, each stored in either holder: both hold some of it.
PARTITION_PROMPT = tinymodels.prompt_ids(96, 16 * BLOCK + 1)
PARTITION_HIT = 16 * BLOCK
QUARANTINE_S = 3.0
WATCHED = (EXTERNAL_HITS, FAILED_LOADS, QUARANTINED, SAVED)


# Run on a host: every key the master lists, and each key's replica descriptors.
_WHERE_KEYS_LIVE = """
import json, sys, urllib.parse, urllib.request
base = sys.argv[1]
keys = urllib.request.urlopen(base + "/get_all_keys", timeout=5).read().decode().split()
where = {}
for key in keys:
    url = base + "/query_key?key=" + urllib.parse.quote(key, safe="@:")
    where[key] = urllib.request.urlopen(url, timeout=5).read().decode()
print(json.dumps(where))
"""


class RemotePool:
    """The master and the holders, each on its host."""

    def __init__(self, network: TestNetwork, logs: Path) -> None:
        self.network = network
        master = network["master"]
        self.address = f"{master.address}:{RPC_PORT}"
        self.http = f"http://{master.address}:{HTTP_PORT}"
        self.children: list[ChildProcess] = []
        argv = [
            str(find_master_binary()),
            f"--rpc_address={master.address}",
            f"--rpc_port={RPC_PORT}",
            f"--metrics_host={master.address}",
            f"--metrics_port={HTTP_PORT}",
            "--default_kv_lease_ttl=5000",
            "--logtostderr=true",
        ]
        child = self._start("master", argv, master.address, logs)
        wait_until(lambda: master.listens(child.pid, RPC_PORT), "the master listening", 30)
        for name in HOLDERS:
            host = network[name]
            argv = [
                sys.executable, "-m", "hybridkv.transport.holder", "--master", self.address,
                "--segment-size", str(HOLDER_SIZE), "--hostname", host.address,
            ]  # fmt: skip
            holder = self._start(name, argv, host.address, logs)
            wait_until(lambda h=holder: "ready" in h.log_text().split(), f"{name} ready", 60)

    def _start(self, name: str, argv: list[str], address: str, logs: Path) -> ChildProcess:
        env = {"MC_TCP_BIND_ADDRESS": address, "PYTHONUNBUFFERED": "1"}
        child = ChildProcess(
            name, self.network[name].argv(argv), {**os.environ, **env}, logs / f"{name}.log"
        )
        self.children.append(child)
        return child

    def config_for(self, name: str, folder: Path) -> Path:
        """The MOONCAKE_CONFIG_PATH file of an instance on host `name`."""
        return write_pool_config(
            folder / f"mooncake-{name}.json",
            self.address,
            local_hostname=self.network[name].address,
        )

    def replicas(self, on: str) -> dict[str, str]:
        """Each key the master lists, with its replica descriptors (asked from host `on`)."""
        answer: dict[str, str] = json.loads(self.network[on].python(_WHERE_KEYS_LIVE, self.http))
        return answer

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()


@pytest.fixture(scope="module")
def network() -> Iterator[TestNetwork]:
    why = missing_capability()
    if why is not None:
        require_real(why)
    net = TestNetwork(HOSTS)
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def remote_pool(
    vllm_ready: None, network: TestNetwork, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemotePool]:
    require_mooncake()
    pool = RemotePool(network, tmp_path_factory.mktemp("hosts"))
    try:
        yield pool
    finally:
        pool.close()


def _run_on(
    host: str,
    pool: RemotePool,
    reference: Reference,
    prompts: list[str],
    runs_dir: Path,
) -> list[PromptResult]:
    spec = InstanceSpec(
        model=str(reference.model_path),
        block_size=BLOCK,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        connector={},
        steps=[Step(prompts=[READER_PROMPTS[name] for name in prompts])],
    )
    env = {
        "MOONCAKE_CONFIG_PATH": str(pool.config_for(host, runs_dir)),
        "MC_TCP_BIND_ADDRESS": pool.network[host].address,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    launcher = pool.network[host].argv([])
    result = run_instance(spec, runs_dir, f"multi-host-{host}", env, launcher=launcher)
    return result.steps[0].prompts


@pytest.fixture(scope="module")
def multi_host_run(
    remote_pool: RemotePool, references: dict[str, Reference], runs_dir: Path
) -> tuple[dict[str, str], dict[str, PromptResult]]:
    reference = references["llama"]
    _run_on("writer", remote_pool, reference, list(WRITTEN), runs_dir)
    stored = remote_pool.replicas(on="reader")
    prompts = list(EXPECTED_HITS)
    results = _run_on("reader", remote_pool, reference, prompts, runs_dir)
    return stored, dict(zip(prompts, results, strict=True))


def test_the_objects_the_writer_stored_live_in_both_holders(
    multi_host_run: tuple[dict[str, str], dict[str, PromptResult]], network: TestNetwork
) -> None:
    stored, _ = multi_host_run
    assert stored
    per_holder = {
        name: sum(network[name].address in replicas for replicas in stored.values())
        for name in HOLDERS
    }
    assert all(per_holder.values()), per_holder
    assert sum(per_holder.values()) == len(stored)  # each object in exactly one holder


def test_the_reader_on_another_host_answers_as_a_cold_run(
    multi_host_run: tuple[dict[str, str], dict[str, PromptResult]],
    references: dict[str, Reference],
) -> None:
    _, results = multi_host_run
    cold = references["llama"].outputs
    for name, hit in EXPECTED_HITS.items():
        assert results[name].external_hit_tokens == hit, name
        assert logprob_gap(results[name], cold[name]) <= LOGPROB_TOLERANCE, name


@dataclass
class Partitioned:
    stored: Phase  # computed cold and stored, every link up
    cut: Phase  # asked again with the reader's link to holder1 down
    mended: Phase  # asked again once the link is back


@pytest.fixture(scope="module")
def partitioned(
    remote_pool: RemotePool, references: dict[str, Reference], runs_dir: Path
) -> Partitioned:
    """An API server on the reader's host serves while its link to one holder fails."""
    network = remote_pool.network
    reader = network["reader"]
    env = {
        "MOONCAKE_CONFIG_PATH": str(remote_pool.config_for("reader", runs_dir)),
        "MC_TCP_BIND_ADDRESS": reader.address,
        "VLLM_SERVER_DEV_MODE": "1",  # reset_prefix_cache
    }
    extra = {"namespace": "partition", "failed_load_quarantine_s": QUARANTINE_S}
    log = runs_dir / "partition-reader.log"
    model = references["llama"].model_path
    with served(model, env, log, extra=extra, launcher=reader.argv([])) as server:
        stored = server.ask(PARTITION_PROMPT, WATCHED)
        server.reset_prefix_cache()
        network.cut("reader", "holder1")
        try:
            cut = server.ask(PARTITION_PROMPT, WATCHED)
        finally:
            network.mend("reader", "holder1")
        time.sleep(QUARANTINE_S + 0.5)  # the keys that failed are offered again
        server.reset_prefix_cache()
        mended = server.ask(PARTITION_PROMPT, WATCHED)
        server.get("/health")  # raises unless the server still says it is healthy
    return Partitioned(stored, cut, mended)


def test_what_lived_behind_a_cut_link_is_recomputed_exactly(partitioned: Partitioned) -> None:
    stored, cut = partitioned.stored, partitioned.cut
    assert stored.counters[EXTERNAL_HITS] == 0
    assert stored.counters[SAVED] > 0
    assert cut.counters[EXTERNAL_HITS] == PARTITION_HIT  # the master still listed it all
    assert cut.counters[FAILED_LOADS] > 0  # the blocks holder1 held
    assert cut.counters[QUARANTINED] > 0
    assert cut.answer["logprobs"] == stored.answer["logprobs"]


def test_hits_return_once_the_link_is_mended(partitioned: Partitioned) -> None:
    mended = partitioned.mended
    assert mended.counters[EXTERNAL_HITS] == PARTITION_HIT
    assert mended.counters[FAILED_LOADS] == 0
    assert mended.answer["logprobs"] == partitioned.stored.answer["logprobs"]
