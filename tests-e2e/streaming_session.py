"""One streaming-input session on vLLM's AsyncLLM, in its own process, with the connector.

``python streaming_session.py SPEC RESULT``: SPEC (JSON) names the model, the chunks of
the session (token ids, each sent once the previous turn has answered) and the tokens
each turn generates; RESULT gets each turn's generated token ids and their top-5
logprobs (as `vllm_instance.PromptResult` holds them). vLLM keeps the
session's KV between turns and drops the token each turn sampled last, so the session's
context is every chunk with the turns' other tokens between them.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from vllm_instance import top_logprobs  # demo/, on the path its runner gives it


class SessionSpec(msgspec.Struct, kw_only=True):
    model: str
    chunks: list[list[int]]
    max_tokens: int
    block_size: int
    max_num_batched_tokens: int
    connector: dict[str, Any]


class SessionResult(msgspec.Struct, kw_only=True):
    turns: list[list[int]]  # the token ids each turn generated
    # per turn, per generated position: (token id, logprob) of the top 5 and the sampled
    logprobs: list[list[list[tuple[int, float]]]]


async def _session(spec: SessionSpec) -> SessionResult:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=spec.model,
        dtype="float32",
        enforce_eager=True,
        block_size=spec.block_size,
        max_model_len=4096,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        gpu_memory_utilization=0.2,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_connector_module_path="hybridkv.integration",
            kv_role="kv_both",
            kv_connector_extra_config=spec.connector,
        ),
    )
    engine = AsyncLLM.from_engine_args(args)
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.max_tokens, output_kind=RequestOutputKind.DELTA, logprobs=5
    )
    turns: list[list[int]] = []
    logprobs: list[list[list[tuple[int, float]]]] = []
    answered = asyncio.Event()

    async def chunks() -> AsyncIterator[StreamingInput]:
        for chunk in spec.chunks:
            answered.clear()
            yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=chunk))
            await answered.wait()

    try:
        turn: list[int] = []
        positions: list[list[tuple[int, float]]] = []
        async for output in engine.generate(chunks(), params, request_id="session"):
            completion = output.outputs[0]
            turn.extend(completion.token_ids)
            positions.extend(top_logprobs(completion.logprobs))
            if len(turn) >= spec.max_tokens:
                turns.append(turn[: spec.max_tokens])
                logprobs.append(positions[: spec.max_tokens])
                turn, positions = turn[spec.max_tokens :], positions[spec.max_tokens :]
                answered.set()
    finally:
        engine.shutdown()
    return SessionResult(turns=turns, logprobs=logprobs)


def main(spec_path: str, result_path: str) -> int:
    spec = msgspec.json.decode(Path(spec_path).read_bytes(), type=SessionSpec)
    result = asyncio.run(_session(spec))
    gc.collect()
    Path(result_path).write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
