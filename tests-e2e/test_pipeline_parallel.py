"""Pipeline parallelism: two stages per instance, each storing and loading its own layers.

A writer and a reader, each vLLM with ``pipeline_parallel_size=2`` (the "mp" executor: one
worker process per stage), share prefixes through the pool, and the reader's output is
compared with a cold run of the same shape. Each stage writes objects of its own layers
under its own ``pp_rank`` in the key; the scheduler finds a block only when every stage
holds it. Three models, one layer of each group per stage: Llama (one full-attention
group), Gemma3 (sliding window and full attention) and LFM2 (short-conv state and full
attention: each stage loads its own recurrent states).

The negative control corrupts only the second stage's objects of one prompt: the reader's
output must change, so that stage does load its own objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import (
    BLOCK,
    MAX_NUM_BATCHED_TOKENS,
    assert_hit_but_changed,
    assert_hit_like_cold,
    keys_added_by_step,
    params,
    thread_binding,
)
from vllm_instance import InstanceSpec, PromptResult, Step, list_pool_keys, run_instance

from hybridkv.keys import parse_key

STAGES = 2
MODELS = ["llama", "gemma3", "lfm2"]
EXTENDED = {"llama", "gemma3"}  # CI runs the hybrid one: state + full attention, both stages
PROMPTS = {
    "clean": tinymodels.prompt_ids(60, 346),  # hit 320: ten blocks, five chunks
    "second_stage_corrupted": tinymodels.prompt_ids(61, 257),  # hit 256
}
EXPECTED_HITS = {"clean": 320, "second_stage_corrupted": 256}


@dataclass
class PipelineRun:
    keys: dict[str, list[str]]  # the writer's new pool keys, by prompt
    reader: dict[str, PromptResult]
    cold: dict[str, PromptResult]


def _run(pool: Pool, models: Path, runs: Path, model: str) -> PipelineRun:
    env = {
        "MOONCAKE_CONFIG_PATH": str(pool.config_path),
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(STAGES),
    }
    built = tinymodels.build(model, models)

    def spec(steps: list[Step], connector: dict[str, object] | None) -> InstanceSpec:
        return InstanceSpec(
            model=str(built.path),
            block_size=BLOCK,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            connector=None if connector is None else {"namespace": f"pp-{model}", **connector},
            master_http=pool.http,
            steps=steps,
            pipeline_parallel_size=STAGES,
        )

    before = set(list_pool_keys(pool.http))
    steps = [Step(prompts=[prompt], snapshot_keys=True) for prompt in PROMPTS.values()]
    written = run_instance(spec(steps, {}), runs, f"pp-{model}-writer", env)
    keys = keys_added_by_step(PROMPTS, written.steps, before)

    second = [k for k in keys["second_stage_corrupted"] if parse_key(k).pp_rank == STAGES - 1]
    assert second, f"the second stage stored nothing: {keys['second_stage_corrupted']}"
    pool.surgeon.corrupt(second)

    everything = [Step(prompts=list(PROMPTS.values()))]
    read = run_instance(spec(everything, {"use_layerwise": True}), runs, f"pp-{model}-reader", env)
    cold = run_instance(spec(everything, None), runs, f"pp-{model}-cold", env)
    return PipelineRun(
        keys=keys,
        reader=dict(zip(PROMPTS, read.steps[0].prompts, strict=True)),
        cold=dict(zip(PROMPTS, cold.steps[0].prompts, strict=True)),
    )


@pytest.fixture(
    scope="module",
    params=params(MODELS, lambda model: model in EXTENDED),
)
def run(
    request: pytest.FixtureRequest, vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path
) -> PipelineRun:
    return _run(pool, models_dir, runs_dir, request.param)


def test_both_stages_load_their_layers_with_identical_output(run: PipelineRun) -> None:
    assert_hit_like_cold(run.reader["clean"], run.cold["clean"], EXPECTED_HITS["clean"])


def test_each_stage_stores_every_block_of_its_groups(
    run: PipelineRun, request: pytest.FixtureRequest
) -> None:
    keys = [parse_key(key) for key in run.keys["clean"]]
    by_stage: dict[int | None, set[tuple[int, str]]] = {}
    for key in keys:
        by_stage.setdefault(key.pp_rank, set()).add((key.group, key.block_hash))
    assert set(by_stage) == {0, 1}
    assert by_stage[0] == by_stage[1]  # the same blocks of the same groups, one per stage
    groups = {0} if request.node.callspec.params["run"] == "llama" else {0, 1}
    assert {group for group, _ in by_stage[0]} == groups


def test_second_stage_objects_are_the_ones_it_loads(run: PipelineRun) -> None:
    name = "second_stage_corrupted"
    assert_hit_but_changed(run.reader[name], run.cold[name], EXPECTED_HITS[name])
