"""The pool fails under a running API server: vLLM keeps answering exactly, and says so.

Server A stores two prompts' KV in a pool of this module's own (a master and a segment
holder) and stops. Server B starts against the same pool; then
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
  exactly as A did.
B stays healthy throughout, and stops on SIGINT like any server.
"""

from __future__ import annotations

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
    served,
)
from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS, MODELS
from vllm_instance import list_pool_keys, write_pool_config

from hybridkv.transport import MasterProcess, SegmentHolder

PROMPTS = [tinymodels.prompt_ids(seed, 2 * MAX_NUM_BATCHED_TOKENS + 1) for seed in (92, 93)]
HIT = (len(PROMPTS[0]) - 1) // BLOCK * BLOCK
WATCHED = (EXTERNAL_HITS, FAILED_LOADS, FAILED_LOOKUPS, FAILED_SAVES, QUARANTINED, SAVED)


@dataclass
class PoolLost:
    stored: list[Phase]  # server A, the pool whole
    holder_lost: Phase  # server B, the first prompt, its holder killed
    asked_again: Phase  # server B, the first prompt again, after a local cache reset
    listed_when_asked_again: int  # keys the master listed then
    master_lost: Phase  # server B, the second prompt, its master killed too


@pytest.fixture(scope="module")
def own_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MasterProcess, Path]]:
    """A master, killed by the test (stopped here whatever happened), and its config file
    (beside which the killed processes keep their logs)."""
    directory = tmp_path_factory.mktemp("lost-pool")
    # A long client TTL keeps a dead holder's objects listed for the whole test.
    with MasterProcess.start(log_path=directory / "master.log", client_ttl_s=120) as master:
        yield master, write_pool_config(directory / "mooncake.json", master.address)


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
            holder.kill()
            holder_lost = reader.ask(PROMPTS[0], WATCHED)
            reader.reset_prefix_cache()
            listed = len(list_pool_keys(f"{master.host}:{master.metrics_port}"))
            asked_again = reader.ask(PROMPTS[0], WATCHED)
            master.kill()
            master_lost = reader.ask(PROMPTS[1], WATCHED)
            reader.get("/health")  # raises unless the server still says it is healthy
            return PoolLost(stored, holder_lost, asked_again, listed, master_lost)


def test_the_writer_stored_both_prompts(pool_lost: PoolLost) -> None:
    for phase in pool_lost.stored:
        assert phase.counters[EXTERNAL_HITS] == 0
        assert phase.counters[SAVED] > 0
        assert phase.counters[FAILED_SAVES] == 0


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
