"""A streaming-input session stores its KV turn by turn; another process reuses it.

vLLM keeps a streaming session's KV between turns, drops the token each turn sampled
last and appends the next chunk: the connector names the blocks of each chunk as it
would name those of one request sent whole with the session's context, so a plain
request of that context in another instance hits every block, with the output of a cold
run.
"""

from __future__ import annotations

from pathlib import Path

import tinymodels
from conftest import Pool
from scenario import BLOCK, MAX_NUM_BATCHED_TOKENS, Reference, logprob_gap
from streaming_session import SessionResult, SessionSpec
from vllm_instance import InstanceSpec, PromptResult, Step, run_instance, run_script

NAMESPACE = "streaming-input"
TURN_TOKENS = 5
# The session computed its context in other steps than a cold run does (turn by turn,
# the first turn's tokens one decode step each), so its KV differs in rounding: a gap of
# 7.6e-6 measured. Wrong KV moves logprobs by more than CHANGED (1e-3, see scenario.py).
SESSION_TOLERANCE = 1e-4


def test_a_plain_request_reuses_every_block_a_streaming_session_stored(
    vllm_ready: None, pool: Pool, references: dict[str, Reference], runs_dir: Path
) -> None:
    reference = references["llama"]
    first, second = tinymodels.prompt_ids(40, 100), tinymodels.prompt_ids(41, 90)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "MOONCAKE_CONFIG_PATH": str(pool.config_path)}
    session = SessionSpec(
        model=str(reference.model_path),
        chunks=[first, second],
        max_tokens=TURN_TOKENS,
        block_size=BLOCK,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        connector={"namespace": NAMESPACE},
    )
    script = Path(__file__).with_name("streaming_session.py")
    result = run_script(script, session, SessionResult, runs_dir, "session", env, timeout_s=300)
    assert [len(turn) for turn in result.turns] == [TURN_TOKENS, TURN_TOKENS]
    context = first + result.turns[0][:-1] + second  # 194 tokens: 6 full blocks

    def run(name: str, connector: dict[str, str] | None) -> PromptResult:
        spec = InstanceSpec(
            model=str(reference.model_path),
            block_size=BLOCK,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            connector=connector,
            steps=[Step(prompts=[context])],
        )
        return run_instance(spec, runs_dir, name, env, timeout_s=300).steps[0].prompts[0]

    warm = run("streaming-reader", {"namespace": NAMESPACE})
    cold = run("streaming-cold", None)
    # Every block below the last token, those of the second turn's chunk included.
    assert warm.external_hit_tokens == (len(context) - 1) // BLOCK * BLOCK == 192
    assert logprob_gap(warm, cold) <= SESSION_TOLERANCE
    assert warm.token_ids == cold.token_ids
