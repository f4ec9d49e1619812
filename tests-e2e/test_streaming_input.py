"""A streaming-input session stores its KV turn by turn; another process reuses it.

vLLM keeps a streaming session's KV between turns, drops the token each turn sampled
last and appends the next chunk: the connector names the blocks of each chunk as it
would name those of one request sent whole with the session's context, so a plain
request of that context in another instance hits every block, and its output is exactly
the session's own next turn, for an attention model and for a hybrid one (LFM2: its
short-conv state is saved at block ends within each turn's chunk).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinymodels
from conftest import Pool
from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS, Reference, logprob_gap
from streaming_session import SessionResult, SessionSpec
from vllm_instance import InstanceSpec, PromptResult, Step, run_instance, run_script

NAMESPACE = "streaming-input"
TURN_TOKENS = 5
# How far the session's own turn may be from a cold run of its context: the session
# computed that context in other steps (turn by turn, the first turn's tokens one decode
# step each). Llama: rounding, a gap of 8.3e-6 measured. LFM2: 0.0092 measured, the same
# without any connector (vLLM's session computes the context otherwise: two of its six
# attention blocks hold other values than a plain request's); the reader reproduces the
# session exactly either way.
COLD_TOLERANCE = {"llama": 1e-4, "lfm2": 0.02}


@pytest.mark.parametrize(
    "model",
    ["lfm2", pytest.param("llama", marks=pytest.mark.extended)],  # CI: the hybrid one
)
def test_a_plain_request_reuses_every_block_a_streaming_session_stored(
    vllm_ready: None, pool: Pool, references: dict[str, Reference], runs_dir: Path, model: str
) -> None:
    reference = references[model]
    first, second = tinymodels.prompt_ids(40, 100), tinymodels.prompt_ids(41, 90)
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "MOONCAKE_CONFIG_PATH": str(pool.config_path),
        "PYTHONPATH": str(Path(__file__).parents[1] / "demo"),  # the session's vllm_instance
    }
    namespace = f"{NAMESPACE}-{model}"
    session = SessionSpec(
        model=str(reference.model_path),
        chunks=[first, second],
        max_tokens=TURN_TOKENS,
        block_size=BLOCK,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        connector={"namespace": namespace},
    )
    script = Path(__file__).with_name("streaming_session.py")
    result = run_script(
        script, session, SessionResult, runs_dir, f"session-{model}", env, timeout_s=300
    )
    assert [len(turn) for turn in result.turns] == [TURN_TOKENS, TURN_TOKENS]
    context = first + result.turns[0][:-1] + second  # 194 tokens: 6 full blocks
    own_turn = PromptResult(
        token_ids=result.turns[1], logprobs=result.logprobs[1], num_cached_tokens=0,
        external_hit_tokens=0, first_token_latency_s=0.0, wall_s=0.0,
    )  # fmt: skip

    def run(name: str, connector: dict[str, str] | None) -> PromptResult:
        spec = InstanceSpec(
            model=str(reference.model_path),
            block_size=BLOCK,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            connector=connector,
            steps=[Step(prompts=[context], max_tokens=TURN_TOKENS)],
        )
        return run_instance(spec, runs_dir, name, env, timeout_s=300).steps[0].prompts[0]

    warm = run(f"streaming-reader-{model}", {"namespace": namespace})
    cold = run(f"streaming-cold-{model}", None)
    # Every block below the last token, those of the second turn's chunk included.
    assert warm.external_hit_tokens == (len(context) - 1) // BLOCK * BLOCK == 192
    assert logprob_gap(warm, own_turn) == 0.0  # the session's KV and state, as it left them
    assert warm.token_ids == cold.token_ids
    assert logprob_gap(warm, cold) <= COLD_TOLERANCE[model]
