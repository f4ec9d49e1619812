"""One real vLLM engine per instance, in-process: B reuses what A stored, bit for bit.

A tiny random Llama built with transformers; the in-memory store is shared by the two
instances of this process (real cross-process Mooncake runs live in tests-e2e).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from conftest import _require

PROMPT = list(range(2, 2 + 200))


def _tiny_llama(path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _run(model: Path, extra: dict[str, Any]) -> tuple[list[int], list[float], int]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # four prefill chunks
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKVConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params)
    completion = out.outputs[0]
    assert completion.logprobs is not None
    logprobs = [
        step[token].logprob
        for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    result = (list(completion.token_ids), logprobs, out.num_cached_tokens or 0)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def test_second_instance_reuses_first_instances_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require("vllm")
    _require("transformers")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    _tiny_llama(tmp_path)
    cold = _run(tmp_path, {"store": "memory", "namespace": "smoke"})
    warm = _run(tmp_path, {"store": "memory", "namespace": "smoke"})
    other = _run(tmp_path, {"store": "memory", "namespace": "elsewhere"})
    assert cold[2] == 0
    assert warm[2] == 192  # every full block below the last token, from the pool
    assert warm[:2] == cold[:2]  # identical tokens and logprobs
    assert other[2] == 0  # a different namespace never reads these objects
