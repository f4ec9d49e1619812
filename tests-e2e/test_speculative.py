"""Speculative decoding with an EAGLE draft head: the drafter's KV travels with the target's.

vLLM puts the draft head's attention layer in the target's KV cache group, and saves it
with the target's (it defers `wait_for_save` until the drafter has run), so each object
holds both. With EAGLE, vLLM drops the last block of every prefix hit so that the draft
head recomputes it; the pool's hits drop it too. A writer and a layerwise reader, each a
tiny Llama with its EAGLE head, share prompts through the pool; the reader's output must
be identical to a cold run with the same drafter, and corrupting a prompt's objects must
change it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tinymodels
from conftest import Pool
from scenario import (
    BLOCK,
    MAX_NUM_BATCHED_TOKENS,
    MODELS,
    assert_hit_but_changed,
    assert_hit_like_cold,
    keys_added_by_step,
    logprob_gap,
    object_size,
)
from vllm_instance import InstanceSpec, PromptResult, Step, list_pool_keys, run_instance

PROMPTS = {
    "clean": tinymodels.prompt_ids(70, 353),
    "corrupted": tinymodels.prompt_ids(71, 289),  # its objects overwritten with noise
}
# Every full block before the prompt's last token, less the block EAGLE drops: 320 and
# 256, multiples of the 64-token prefill chunk, so the reader computes the rest of the
# prompt in the chunks a cold run computes it in.
EXPECTED_HITS = {name: ((len(p) - 1) // BLOCK - 1) * BLOCK for name, p in PROMPTS.items()}


@dataclass
class SpeculativeRun:
    keys: dict[str, list[str]]  # the writer's new pool keys, by prompt
    outputs: dict[str, dict[str, PromptResult]]  # by instance, then prompt
    object_bytes: int  # of one stored block
    layer_block_bytes: int  # K and V of one layer for one block, in float32
    target_layers: int


@pytest.fixture(scope="module")
def eagle(vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path) -> SpeculativeRun:
    target = tinymodels.build("llama", models_dir, **MODELS["llama"])
    draft = tinymodels.build_eagle_draft(target)
    env = {"MOONCAKE_CONFIG_PATH": str(pool.config_path)}
    speculative = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}

    def run(name: str, steps: list[Step], connector: dict[str, object] | None) -> list[Any]:
        spec = InstanceSpec(
            model=str(target.path),
            block_size=BLOCK,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            connector=None if connector is None else {"namespace": "eagle", **connector},
            master_http=pool.http,
            steps=steps,
            speculative_config=speculative,
        )
        return run_instance(spec, runs_dir, f"eagle-{name}", env).steps

    before = set(list_pool_keys(pool.http))
    written = run("writer", [Step(prompts=[p], snapshot_keys=True) for p in PROMPTS.values()], {})
    keys = keys_added_by_step(PROMPTS, written, before)
    pool.surgeon.corrupt(keys["corrupted"])
    every_prompt = [Step(prompts=list(PROMPTS.values()))]
    results = {
        "writer": [step.prompts[0] for step in written],
        "reader": run("reader", every_prompt, {"use_layerwise": True})[0].prompts,
        "cold": run("cold", every_prompt, None)[0].prompts,
    }
    config = json.loads((target.path / "config.json").read_text())
    return SpeculativeRun(
        keys=keys,
        outputs={name: dict(zip(PROMPTS, got, strict=True)) for name, got in results.items()},
        object_bytes=object_size(pool.http, keys["clean"][0]),
        layer_block_bytes=2 * config["num_key_value_heads"] * BLOCK * config["head_dim"] * 4,
        target_layers=config["num_hidden_layers"],
    )


def test_each_object_holds_the_draft_heads_layer_beside_the_targets(
    eagle: SpeculativeRun,
) -> None:
    layers = eagle.target_layers + 1  # the EAGLE head's one decoder layer
    assert eagle.object_bytes == layers * eagle.layer_block_bytes
    assert len(eagle.keys["clean"]) == (len(PROMPTS["clean"]) - 1) // BLOCK  # all full blocks


def test_saving_does_not_change_the_writer_output(eagle: SpeculativeRun) -> None:
    for prompt in PROMPTS:
        assert logprob_gap(eagle.outputs["writer"][prompt], eagle.outputs["cold"][prompt]) == 0


def test_reader_hit_drops_eagles_block_and_matches_cold(eagle: SpeculativeRun) -> None:
    reader, cold = eagle.outputs["reader"]["clean"], eagle.outputs["cold"]["clean"]
    assert_hit_like_cold(reader, cold, EXPECTED_HITS["clean"])


def test_corrupted_objects_change_the_output(eagle: SpeculativeRun) -> None:
    reader, cold = eagle.outputs["reader"]["corrupted"], eagle.outputs["cold"]["corrupted"]
    assert_hit_but_changed(reader, cold, EXPECTED_HITS["corrupted"])
