"""What makes one prefix's KV differ between instances of one model name and cache layout."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def weights_identity(vllm_config: VllmConfig) -> str:
    """What makes one prefix's KV differ between instances of one model name and cache
    layout: the checkpoint revision, quantization, compute and cache dtypes, config
    overrides (e.g. RoPE scaling). Folded into every block hash."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    overrides = model.hf_overrides
    identity = {
        "revision": model.revision,
        "code_revision": model.code_revision,
        "quantization": model.quantization,
        "quantization_config": model.quantization_config,
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "hf_overrides": (
            f"{overrides.__module__}.{overrides.__qualname__}" if callable(overrides) else overrides
        ),
    }
    return json.dumps(identity, sort_keys=True, default=repr)
