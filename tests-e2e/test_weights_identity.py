"""Other weights under one directory name never load each other's KV; copies do.

Two tiny Llama checkpoints with the same config and other weights, saved as `run1/hf` and
`run2/hf` (the key's model field is `hf` for both): a writer serves run1, a reader
serving run2 must find nothing and answer as its own cold run. A byte copy of run1 in
another directory shares every block, and an explicit `weights_version` keeps even the
same files apart (weights updated in memory).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import (
    BLOCK,
    CHANGED,
    LOGPROB_TOLERANCE,
    MAX_NUM_BATCHED_TOKENS,
    READER_PROMPTS,
    Reference,
    logprob_gap,
)
from vllm_instance import InstanceSpec, PromptResult, Step, run_instance

PROMPT = READER_PROMPTS["same_prompt"]
NAMESPACE = "weights-identity"
FULL_HIT = 384  # every whole block but the last token's


def _other_weights(source: Path, target: Path) -> Path:
    """`source`'s config and tokenizer with weights drawn from another seed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(source, target)
    torch.manual_seed(tinymodels.SEED + 100)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    model.to(torch.float32).save_pretrained(target, safe_serialization=True)
    return target


@pytest.fixture(scope="module")
def checkpoints(
    vllm_ready: None, references: dict[str, Reference], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """run1/hf: the reference Llama; mirror/hf: a byte copy of it; run2/hf: other weights."""
    root = tmp_path_factory.mktemp("checkpoints")
    source = references["llama"].model_path
    run1 = shutil.copytree(source, root / "run1" / "hf")
    mirror = shutil.copytree(source, root / "mirror" / "hf")
    return {"run1": run1, "mirror": mirror, "run2": _other_weights(source, root / "run2" / "hf")}


def _run(
    model: Path, pool: Pool | None, runs_dir: Path, name: str, **connector: object
) -> PromptResult:
    spec = InstanceSpec(
        model=str(model),
        block_size=BLOCK,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        connector=None if pool is None else {"namespace": NAMESPACE, **connector},
        steps=[Step(prompts=[PROMPT])],
    )
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if pool is not None:
        env["MOONCAKE_CONFIG_PATH"] = str(pool.config_path)
    (result,) = run_instance(spec, runs_dir, name, env).steps[0].prompts
    return result


@pytest.fixture(scope="module")
def readers(checkpoints: dict[str, Path], pool: Pool, runs_dir: Path) -> dict[str, PromptResult]:
    """A writer serves run1 and exits; then each reader starts, and run2's cold run."""
    _run(checkpoints["run1"], pool, runs_dir, "weights-writer")
    return {
        "run2": _run(checkpoints["run2"], pool, runs_dir, "weights-run2"),
        "run2_cold": _run(checkpoints["run2"], None, runs_dir, "weights-run2-cold"),
        "mirror": _run(checkpoints["mirror"], pool, runs_dir, "weights-mirror"),
        "versioned": _run(
            checkpoints["run1"], pool, runs_dir, "weights-versioned", weights_version="step-2"
        ),
    }


def test_other_weights_in_a_directory_of_the_same_name_load_nothing(
    readers: dict[str, PromptResult], references: dict[str, Reference]
) -> None:
    run2, cold = readers["run2"], readers["run2_cold"]
    assert run2.external_hit_tokens == 0
    assert logprob_gap(run2, cold) <= LOGPROB_TOLERANCE
    # The control: run2's weights do compute something else than run1's.
    assert logprob_gap(cold, references["llama"].outputs["same_prompt"]) > CHANGED


def test_a_copy_of_the_same_weights_elsewhere_reuses_every_block(
    readers: dict[str, PromptResult], references: dict[str, Reference]
) -> None:
    mirror = readers["mirror"]
    assert mirror.external_hit_tokens == FULL_HIT
    assert logprob_gap(mirror, references["llama"].outputs["same_prompt"]) <= LOGPROB_TOLERANCE


def test_another_weights_version_of_the_same_files_loads_nothing(
    readers: dict[str, PromptResult], references: dict[str, Reference]
) -> None:
    versioned = readers["versioned"]
    assert versioned.external_hit_tokens == 0
    assert logprob_gap(versioned, references["llama"].outputs["same_prompt"]) <= LOGPROB_TOLERANCE
