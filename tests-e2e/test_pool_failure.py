"""The pool fails under a running API server: vLLM keeps answering exactly, and says so.

Server A stores four prompts' KV in a pool of this module's own (a master and a segment
holder) and stops. Server B starts against the same pool (`store_timeout_s` 2); then
- B loads the fourth prompt (its first transfer from the holder), then the segment
  holder stalls (SIGSTOP) while B is asked the third prompt: the load fails
  after the store timeout, not Mooncake's 30 s, vLLM computes the request instead and B
  answers exactly as A did (the holder then runs again);
- the segment holder is killed outright, its objects with it (the master lists them
  until the holder's client TTL, here 120 s): B's lookup of the first prompt still finds
  it, its load fails, vLLM computes the request instead (`kv_load_failure_policy:
  recompute`; LFM2 is hybrid, so the load ran in the background and failed as a
  request), the pool is not asked for it again (once: vLLM's external hits count the
  prompt's blocks once), and B answers exactly as A did; `failed_load_blocks` counts the
  blocks on `/metrics`;
- B's own prefix cache is emptied and the first prompt asked again: the objects that
  failed are quarantined (`quarantined_keys` counts them), so the pool offers nothing and
  no load fails again;
- the master is killed too: B's lookup of the second prompt gets no answer, which counts
  as a miss (`failed_lookups`), its saves fail (`failed_save_blocks`), and B answers
  exactly as A did;
- a master and a holder start on the old master's port: B's client finds them again
  (its lookups are answered, its saves stored, a later ask hits), answering exactly.
B stays healthy throughout, and stops on SIGINT like any server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tinymodels
from api_server import (
    EXTERNAL_HITS,
    FAILED_LOADS,
    FAILED_LOOKUPS,
    FAILED_SAVES,
    MODEL,
    QUARANTINED,
    SAVED,
    Phase,
    Server,
    served,
)
from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS, MODELS
from vllm_instance import list_pool_keys, write_pool_config

from hybridkv.transport import MasterProcess, SegmentHolder
from hybridkv.transport.testing import stalled

PROMPTS = [tinymodels.prompt_ids(seed, 2 * MAX_NUM_BATCHED_TOKENS + 1) for seed in (92, 93, 94, 95)]
STORE_TIMEOUT_S = 2
MOONCAKE_TIMEOUT_S = 30  # Mooncake's own transfer timeout, what a stalled holder cost
RETRIES_AFTER_RESTART = 6
HIT = (len(PROMPTS[0]) - 1) // BLOCK * BLOCK
WATCHED = (EXTERNAL_HITS, FAILED_LOADS, FAILED_LOOKUPS, FAILED_SAVES, QUARANTINED, SAVED)


@dataclass
class PoolLost:
    stored: list[Phase]  # server A, the pool whole
    holder_stalled: Phase  # server B, the third prompt, its holder stopped
    stalled_s: float  # how long that took, the counters' settling included
    holder_lost: Phase  # server B, the first prompt, its holder killed
    asked_again: Phase  # server B, the first prompt again, after a local cache reset
    listed_when_asked_again: int  # keys the master listed then
    master_lost: Phase  # server B, the second prompt, its master killed too
    restarted: list[Phase]  # server B, the second prompt, a new master and holder


@pytest.fixture(scope="module")
def own_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MasterProcess, Path]]:
    """A master, killed by the test (stopped here whatever happened), and its config file
    (beside which the killed processes keep their logs)."""
    directory = tmp_path_factory.mktemp("lost-pool")
    # A long client TTL keeps a dead holder's objects listed for the whole test.
    with MasterProcess.start(log_path=directory / "master.log", client_ttl_s=120) as master:
        path = write_pool_config(directory / "mooncake.json", master.address)
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "store_timeout_s": STORE_TIMEOUT_S}))
        yield master, path


@pytest.fixture(scope="module")
def pool_lost(
    vllm_ready: None, own_pool: tuple[MasterProcess, Path], models_dir: Path, runs_dir: Path
) -> PoolLost:
    master, config_path = own_pool
    model = tinymodels.build(MODEL, models_dir, **MODELS[MODEL]).path
    env = {"MOONCAKE_CONFIG_PATH": str(config_path), "VLLM_SERVER_DEV_MODE": "1"}
    holder_log = config_path.parent / "holder.log"
    with SegmentHolder.start(master.address, 256 << 20, log_path=holder_log) as holder:
        with served(model, env, runs_dir / "lost-writer.log") as writer:
            stored = [writer.ask(prompt, WATCHED) for prompt in PROMPTS]
        # A quarantine far longer than the test: on a slow machine the default 30 s could
        # lapse before the prompt is asked again.
        quarantine = {"failed_load_quarantine_s": 600}
        with served(model, env, runs_dir / "lost-reader.log", extra=quarantine) as reader:
            # A first load from the holder: Mooncake's handshake with a holder already
            # stalled waits ~60 s, past store_timeout_s (see docs/reliability.md).
            reader.ask(PROMPTS[3], WATCHED)
            with stalled(holder.pid):
                started = time.monotonic()
                holder_stalled = reader.ask(PROMPTS[2], WATCHED)
                stalled_s = time.monotonic() - started
            holder.kill()
            holder_lost = reader.ask(PROMPTS[0], WATCHED)
            reader.reset_prefix_cache()
            listed = len(list_pool_keys(f"{master.host}:{master.metrics_port}"))
            asked_again = reader.ask(PROMPTS[0], WATCHED)
            master.kill()
            master_lost = reader.ask(PROMPTS[1], WATCHED)
            reader.get("/health")  # raises unless the server still says it is healthy
            restarted = _served_after_a_restart(reader, master, config_path.parent)
            return PoolLost(
                stored, holder_stalled, stalled_s, holder_lost, asked_again, listed,
                master_lost, restarted,
            )  # fmt: skip


def _served_after_a_restart(reader: Server, master: MasterProcess, logs: Path) -> list[Phase]:
    """Ask the second prompt (B's own prefix cache emptied each time) until one ask hits
    in the new pool, at most RETRIES_AFTER_RESTART times: the client reconnects within a
    few seconds."""
    new_master = MasterProcess.start(
        rpc_port=master.rpc_port, client_ttl_s=120, log_path=logs / "master-2.log"
    )
    with (
        new_master,
        SegmentHolder.start(new_master.address, 256 << 20, log_path=logs / "holder-2.log"),
    ):
        phases: list[Phase] = []
        while len(phases) < RETRIES_AFTER_RESTART:
            reader.reset_prefix_cache()
            phases.append(reader.ask(PROMPTS[1], WATCHED))
            if phases[-1].counters[EXTERNAL_HITS]:
                break
        reader.get("/health")
        return phases


def test_the_writer_stored_both_prompts(pool_lost: PoolLost) -> None:
    for phase in pool_lost.stored:
        assert phase.counters[EXTERNAL_HITS] == 0
        assert phase.counters[SAVED] > 0
        assert phase.counters[FAILED_SAVES] == 0


def test_a_load_from_a_stalled_holder_fails_within_the_store_timeout_and_is_recomputed_exactly(
    pool_lost: PoolLost,
) -> None:
    phase = pool_lost.holder_stalled
    print(f"asked with the holder stalled: {pool_lost.stalled_s:.1f} s, {phase.counters}")
    assert phase.counters[EXTERNAL_HITS] == HIT  # the master answered the lookup
    assert phase.counters[FAILED_LOADS] > 0
    assert phase.counters[QUARANTINED] > 0
    assert pool_lost.stalled_s < MOONCAKE_TIMEOUT_S  # the load alone took that before
    assert phase.answer["logprobs"] == pool_lost.stored[2].answer["logprobs"]


def test_loads_from_a_dead_holder_are_recomputed_exactly(pool_lost: PoolLost) -> None:
    phase = pool_lost.holder_lost
    assert phase.counters[EXTERNAL_HITS] == HIT  # the master still listed the objects
    assert phase.counters[FAILED_LOADS] > 0
    assert phase.counters[QUARANTINED] > 0
    assert phase.answer["logprobs"] == pool_lost.stored[0].answer["logprobs"]


def test_objects_that_failed_to_load_are_not_offered_again(pool_lost: PoolLost) -> None:
    phase = pool_lost.asked_again
    assert pool_lost.listed_when_asked_again > 0
    assert phase.counters[EXTERNAL_HITS] == 0  # listed by the master, but quarantined
    assert phase.counters[FAILED_LOOKUPS] == 0  # the lookup was answered
    assert phase.counters[FAILED_LOADS] == 0
    assert phase.answer["logprobs"] == pool_lost.stored[0].answer["logprobs"]


def test_without_a_master_lookups_miss_saves_fail_and_answers_stay_exact(
    pool_lost: PoolLost,
) -> None:
    phase = pool_lost.master_lost
    assert phase.counters[EXTERNAL_HITS] == 0
    assert phase.counters[FAILED_LOOKUPS] > 0
    assert phase.counters[FAILED_SAVES] > 0
    assert phase.answer["logprobs"] == pool_lost.stored[1].answer["logprobs"]


def test_after_a_master_restart_the_server_finds_the_pool_again_and_answers_exactly(
    pool_lost: PoolLost,
) -> None:
    phases = pool_lost.restarted
    print("after the restart:", [phase.counters for phase in phases])
    assert phases[-1].counters[EXTERNAL_HITS] > 0, "no hit in the restarted pool"
    assert sum(phase.counters[SAVED] for phase in phases) > 0
    for phase in phases:
        assert phase.answer["logprobs"] == pool_lost.stored[1].answer["logprobs"]
