"""Tensor parallelism: two worker processes per instance, each moving its own share.

A writer and a reader, each vLLM with ``tensor_parallel_size=2`` (the "mp" executor: one
worker process per rank besides the engine core), share prefixes through the pool, and
the reader's output is compared with a cold TP=2 run. The writer saves whole blocks, the
reader loads layer by layer. Two shapes:

- "split": four query and two KV heads, so each rank holds one KV head and stores objects
  of its own head only;
- "replicated": one KV head for two ranks (both hold a copy: only one stores it), plus
  conv state that vLLM shards over the ranks (each rank stores its own part).

The negative control corrupts only the objects of the second rank's head: the reader's
output must change, so that rank does load its own objects (had it loaded the first
rank's, or nothing, the clean prompt would not match either). A TP=1 instance must find
nothing a TP=2 instance wrote: the layout digest keeps them apart; asked the clean prompt
again, it finds what it stored itself (so its misses are not those of a connector that
never hits).

Without `MOONCAKE_CONFIG_PATH` rank 0 starts an embedded master and hands its address to
rank 1 over vLLM's tensor-parallel group: one such instance reloads its own prompt from it
on both ranks, and no file of ours is left in its temp directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import (
    BLOCK,
    LOGPROB_TOLERANCE,
    MAX_NUM_BATCHED_TOKENS,
    assert_hit_but_changed,
    assert_hit_like_cold,
    group_of,
    keys_added_by_step,
    logprob_gap,
    outcome,
    run_each,
    thread_binding,
)
from vllm_instance import InstanceSpec, PromptResult, Step, list_pool_keys, run_instance

from hybridkv.keys import parse_key

RANKS = 2
# shape -> (model, hidden size): head count is hidden // 64, KV heads half of that
SHAPES = {"split": ("llama", 256), "replicated": ("lfm2", 128)}
# Greedy hits are multiples of the 64-token prefill chunk, as in the main scenario.
PROMPTS = {
    "clean": tinymodels.prompt_ids(50, 346),  # hit 320: ten blocks, five chunks
    "second_rank_corrupted": tinymodels.prompt_ids(51, 257),  # hit 256
}
EXPECTED_HITS = {"clean": 320, "second_rank_corrupted": 256}
# The writer saves whole blocks after each step, the reader loads layer by layer.
WRITER: dict[str, object] = {"use_layerwise": False}
READER: dict[str, object] = {"use_layerwise": True}


@dataclass
class TensorParallelRun:
    keys: dict[str, list[str]]  # the writer's new pool keys, by prompt
    reader: dict[str, PromptResult]
    cold: dict[str, PromptResult]
    single_rank_hits: dict[str, int]  # a TP=1 reader of the same namespace
    single_rank_own_hit: int  # the same TP=1 instance, the clean prompt again


def _instance(
    models: Path,
    shape: str,
    steps: list[Step],
    connector: dict[str, object] | None,
    ranks: int = RANKS,
    master_http: str | None = None,
) -> InstanceSpec:
    """An instance of `shape`'s model (connector None: none at all)."""
    model, hidden = SHAPES[shape]
    built = tinymodels.build(model, models, layers=4, hidden=hidden)
    return InstanceSpec(
        model=str(built.path),
        block_size=BLOCK,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        connector=None if connector is None else {"namespace": f"tp-{shape}", **connector},
        master_http=master_http,
        steps=steps,
        tensor_parallel_size=ranks,
    )


def _run(pool: Pool, models: Path, runs: Path, shape: str) -> TensorParallelRun:
    env = {
        "MOONCAKE_CONFIG_PATH": str(pool.config_path),
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(RANKS),
    }

    def spec(
        steps: list[Step], connector: dict[str, object] | None, ranks: int = RANKS
    ) -> InstanceSpec:
        return _instance(models, shape, steps, connector, ranks, pool.http)

    before = set(list_pool_keys(pool.http))
    steps = [Step(prompts=[prompt], snapshot_keys=True) for prompt in PROMPTS.values()]
    written = run_instance(spec(steps, WRITER), runs, f"tp-{shape}-writer", env)
    keys = keys_added_by_step(PROMPTS, written.steps, before)

    last_head = [k for k in keys["second_rank_corrupted"] if parse_key(k).head == RANKS - 1]
    assert last_head, f"the second rank stored nothing: {keys['second_rank_corrupted']}"
    pool.surgeon.corrupt(last_head)

    everything = [Step(prompts=list(PROMPTS.values()))]
    read = run_instance(spec(everything, READER), runs, f"tp-{shape}-reader", env)
    cold = run_instance(spec(everything, None), runs, f"tp-{shape}-cold", env)
    again = Step(prompts=[PROMPTS["clean"]])
    single = run_instance(
        spec([*everything, again], READER, ranks=1),
        runs,
        f"tp-{shape}-single-rank",
        {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "auto"},
    )
    return TensorParallelRun(
        keys=keys,
        reader=dict(zip(PROMPTS, read.steps[0].prompts, strict=True)),
        cold=dict(zip(PROMPTS, cold.steps[0].prompts, strict=True)),
        single_rank_hits={
            name: result.external_hit_tokens
            for name, result in zip(PROMPTS, single.steps[0].prompts, strict=True)
        },
        single_rank_own_hit=single.steps[1].prompts[0].external_hit_tokens,
    )


@pytest.fixture(scope="module")
def runs(
    vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path
) -> dict[str, TensorParallelRun | Exception]:
    return run_each(SHAPES, lambda shape: _run(pool, models_dir, runs_dir, shape))


def _heads(keys: list[str]) -> dict[int, set[int]]:
    """Stored heads by KV cache group."""
    heads: dict[int, set[int]] = {}
    for key in keys:
        heads.setdefault(group_of(key), set()).add(parse_key(key).head)
    return heads


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_rank_loads_its_own_share_with_identical_output(
    runs: dict[str, TensorParallelRun | Exception], shape: str
) -> None:
    run = outcome(runs, shape)
    assert_hit_like_cold(run.reader["clean"], run.cold["clean"], EXPECTED_HITS["clean"])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_second_rank_objects_are_the_ones_it_loads(
    runs: dict[str, TensorParallelRun | Exception], shape: str
) -> None:
    run = outcome(runs, shape)
    name = "second_rank_corrupted"
    assert_hit_but_changed(run.reader[name], run.cold[name], EXPECTED_HITS[name])


def test_split_heads_are_stored_once_each(
    runs: dict[str, TensorParallelRun | Exception],
) -> None:
    run = outcome(runs, "split")
    assert _heads(run.keys["clean"]) == {0: {0, 1}}
    # ten blocks of 32 tokens (the last token is never stored) for each head
    assert len(run.keys["clean"]) == RANKS * ((len(PROMPTS["clean"]) - 1) // BLOCK)


def test_replicated_head_is_stored_once_and_sharded_state_by_each_rank(
    runs: dict[str, TensorParallelRun | Exception],
) -> None:
    heads = _heads(outcome(runs, "replicated").keys["clean"])
    assert sorted(heads.values(), key=len) == [{0}, {0, 1}], heads


@pytest.mark.parametrize("shape", list(SHAPES))
def test_single_rank_instance_finds_nothing_of_two_ranks(
    runs: dict[str, TensorParallelRun | Exception], shape: str
) -> None:
    run = outcome(runs, shape)
    assert run.single_rank_hits == dict.fromkeys(PROMPTS, 0)
    assert run.single_rank_own_hit == EXPECTED_HITS["clean"]


@dataclass
class EmbeddedRun:
    prompts: list[PromptResult]  # the clean prompt, then again from the embedded pool
    left_files: list[str]  # ours, in the instance's temp directory


@pytest.fixture(scope="module")
def embedded(vllm_ready: None, models_dir: Path, runs_dir: Path) -> EmbeddedRun:
    """A TP=2 reader-writer with no `MOONCAKE_CONFIG_PATH`, the clean prompt twice (vLLM's
    own cache dropped in between, so the second hit can only come from the pool)."""
    temp = runs_dir / "tp-embedded-tmp"
    temp.mkdir()
    env = {"VLLM_CPU_OMP_THREADS_BIND": thread_binding(RANKS), "TMPDIR": str(temp)}
    twice = [Step(prompts=[PROMPTS["clean"]] * 2)]
    spec = _instance(models_dir, "split", twice, {**READER, "namespace": "tp-embedded"})
    result = run_instance(spec, runs_dir, "tp-embedded", env)
    return EmbeddedRun(result.steps[0].prompts, sorted(p.name for p in temp.rglob("hybridkv*")))


def test_embedded_master_serves_both_ranks(embedded: EmbeddedRun) -> None:
    cold, warm = embedded.prompts
    assert cold.external_hit_tokens == 0
    assert warm.external_hit_tokens == EXPECTED_HITS["clean"]
    assert warm.token_ids == cold.token_ids
    assert logprob_gap(warm, cold) <= LOGPROB_TOLERANCE
    assert embedded.left_files == []
