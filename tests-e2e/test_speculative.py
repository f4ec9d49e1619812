"""Speculative decoding with an EAGLE draft head: the drafter's KV travels with the target's.

vLLM puts the draft head's attention layer in the target's KV cache group, and saves it
with the target's (it defers `wait_for_save` until the drafter has run), so each object
holds both. With EAGLE, vLLM drops the last block of every prefix hit so that the draft
head recomputes it; the pool's hits drop it too. A writer and a layerwise reader, each a
tiny Llama with its EAGLE head, share prompts through the pool; the reader's output must
be identical to a cold run with the same drafter, and corrupting a prompt's objects must
change it. The draft head's KV is checked by its proposals (`draft_tap`): the reader's are
a cold run's, and noise in the draft layer's part of the objects alone changes them but
not the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tinymodels
from conftest import Pool
from draft_tap import DRAFTS_FILE, Proposal, proposals_after, read_proposals
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
    "draft_corrupted": tinymodels.prompt_ids(72, 417),  # the draft layer's bytes only
}
MAX_TOKENS = 4
DRAFT_TOKENS = 2
# A prompt's decode steps reach this far past its last token; the prompts' lengths are
# further apart, so `proposals_after` tells their proposals apart.
SPAN = MAX_TOKENS * (1 + DRAFT_TOKENS)
# Every full block before the prompt's last token, less the block EAGLE drops: 320, 256
# and 384, multiples of the 64-token prefill chunk, so the reader computes the rest of the
# prompt in the chunks a cold run computes it in.
EXPECTED_HITS = {name: ((len(p) - 1) // BLOCK - 1) * BLOCK for name, p in PROMPTS.items()}


@dataclass
class SpeculativeRun:
    keys: dict[str, list[str]]  # the writer's new pool keys, by prompt
    outputs: dict[str, dict[str, PromptResult]]  # by instance, then prompt
    object_bytes: int  # of one stored block
    proposals: dict[str, dict[str, list[Proposal]]]  # by instance, then prompt
    layer_block_bytes: int  # K and V of one layer for one block, in float32
    target_layers: int


@pytest.fixture(scope="module")
def eagle(vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path) -> SpeculativeRun:
    target = tinymodels.build("llama", models_dir, **MODELS["llama"])
    draft = tinymodels.build_eagle_draft(target)
    speculative = {"method": "eagle", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}

    def run(name: str, steps: list[Step], connector: dict[str, object] | None) -> list[Any]:
        drafts = runs_dir / f"eagle-{name}.drafts"
        drafts.unlink(missing_ok=True)
        env = {
            "MOONCAKE_CONFIG_PATH": str(pool.config_path),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # for the tap
            "PYTHONPATH": str(Path(__file__).parent),
            DRAFTS_FILE: str(drafts),
        }
        spec = InstanceSpec(
            model=str(target.path),
            block_size=BLOCK,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            connector=None if connector is None else {"namespace": "eagle", **connector},
            master_http=pool.http,
            steps=steps,
            speculative_config=speculative,
            prepare="draft_tap:record",
        )
        return run_instance(spec, runs_dir, f"eagle-{name}", env).steps

    before = set(list_pool_keys(pool.http))
    written = run(
        "writer",
        [Step(prompts=[p], snapshot_keys=True, max_tokens=MAX_TOKENS) for p in PROMPTS.values()],
        {},
    )
    keys = keys_added_by_step(PROMPTS, written, before)
    config = json.loads((target.path / "config.json").read_text())
    layer_block_bytes = 2 * config["num_key_value_heads"] * BLOCK * config["head_dim"] * 4
    pool.surgeon.corrupt(keys["corrupted"])
    # The draft head's layer is numbered after the target's, and last in each object.
    pool.surgeon.corrupt(keys["draft_corrupted"], last_bytes=layer_block_bytes)
    every_prompt = [Step(prompts=list(PROMPTS.values()), max_tokens=MAX_TOKENS)]
    results = {
        "writer": [step.prompts[0] for step in written],
        "reader": run("reader", every_prompt, {"use_layerwise": True})[0].prompts,
        "cold": run("cold", every_prompt, None)[0].prompts,
    }
    recorded = {name: read_proposals(runs_dir / f"eagle-{name}.drafts") for name in results}
    return SpeculativeRun(
        keys=keys,
        outputs={name: dict(zip(PROMPTS, got, strict=True)) for name, got in results.items()},
        object_bytes=object_size(pool.http, keys["clean"][0]),
        proposals={
            name: {
                prompt: proposals_after(recorded[name], len(ids), SPAN)
                for prompt, ids in PROMPTS.items()
            }
            for name in results
        },
        layer_block_bytes=layer_block_bytes,
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


def test_the_reader_s_draft_head_proposes_what_a_cold_run_s_does(eagle: SpeculativeRun) -> None:
    """Its KV of the hit came from the pool: had the draft layer not been loaded (or been
    loaded from another layer's bytes), its proposals would differ."""
    reader, cold = eagle.proposals["reader"]["clean"], eagle.proposals["cold"]["clean"]
    assert len(cold) == MAX_TOKENS  # the last prefill chunk's call and one per decode step
    assert reader == cold


def test_noise_in_the_draft_layer_s_bytes_changes_the_proposals_not_the_output(
    eagle: SpeculativeRun,
) -> None:
    """The negative control: the reader loads the draft layer from the objects' last
    layer of bytes (the target's layers are untouched: its output is a cold run's)."""
    reader = eagle.outputs["reader"]["draft_corrupted"]
    assert_hit_like_cold(
        reader, eagle.outputs["cold"]["draft_corrupted"], EXPECTED_HITS["draft_corrupted"]
    )
    proposed = eagle.proposals["reader"]["draft_corrupted"]
    assert len(proposed) == MAX_TOKENS
    assert proposed != eagle.proposals["cold"]["draft_corrupted"]
