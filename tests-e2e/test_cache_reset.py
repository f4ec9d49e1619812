"""A connector cache reset (as around a weight update) across processes, real Mooncake.

The instance runs its engine core in a process of its own, so the reset travels from the
scheduler there to worker rank 0 over the lookup channel, which removes the objects from
the real pool.
"""

from __future__ import annotations

from pathlib import Path

from conftest import Pool
from scenario import (
    BLOCK,
    LOGPROB_TOLERANCE,
    MAX_NUM_BATCHED_TOKENS,
    READER_PROMPTS,
    Reference,
    logprob_gap,
)
from vllm_instance import InstanceSpec, Step, list_pool_keys, run_instance

PROMPT = READER_PROMPTS["same_prompt"]
NAMESPACE = "cache-reset"


def _spec(reference: Reference, pool: Pool, steps: list[Step]) -> InstanceSpec:
    return InstanceSpec(
        model=str(reference.model_path),
        block_size=BLOCK,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        connector={"namespace": NAMESPACE},
        master_http=pool.http,
        steps=steps,
    )


def test_a_reset_removes_the_pool_objects_and_a_new_generation_starts(
    vllm_ready: None, pool: Pool, references: dict[str, Reference], runs_dir: Path
) -> None:
    reference = references["llama"]
    cold = reference.outputs["same_prompt"]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "MOONCAKE_CONFIG_PATH": str(pool.config_path)}
    # Nothing reads the objects before the reset: a read's lease would keep them (by
    # design: another instance may still be reading one), though never loaded again here.
    steps = [
        Step(prompts=[PROMPT], snapshot_keys=True),  # computed and stored
        Step(prompts=[PROMPT], snapshot_keys=True, reset_connector=True),  # recomputed
        Step(prompts=[PROMPT]),  # reused from the objects stored after the reset
        Step(prompts=[PROMPT], reset_connector=True),  # read just now: recomputed anyway
    ]
    existing = set(list_pool_keys(pool.http))
    run = run_instance(_spec(reference, pool, steps), runs_dir, "reset", env, timeout_s=300)
    first, after_reset = run.steps[:2]
    assert first.keys is not None
    assert after_reset.keys is not None
    mine = set(first.keys) - existing
    assert mine
    assert [step.reset_ok for step in run.steps] == [None, True, None, True]
    assert not mine & set(after_reset.keys)  # every object of the model left the pool
    assert len(set(after_reset.keys) - existing - mine) == len(mine)  # the prompt stored anew
    hits = [step.prompts[0].external_hit_tokens for step in run.steps]
    assert hits == [0, 0, 384, 0]
    for step in run.steps:
        assert logprob_gap(step.prompts[0], cold) <= LOGPROB_TOLERANCE

    fresh = run_instance(
        _spec(reference, pool, [Step(prompts=[PROMPT])]), runs_dir, "after-reset", env
    )
    (result,) = fresh.steps[0].prompts
    assert result.external_hit_tokens == 0  # a new instance: generation 0, all removed
    assert logprob_gap(result, cold) <= LOGPROB_TOLERANCE
