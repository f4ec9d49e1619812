"""Fake of vllm_ascend/attention/mla_v1.py (MLA): `forward` asks the connector for the
layer's loads only when the batch holds a prefill (`_mla_preprocess`), then writes the
cache, runs the attention op and saves through the connector.
"""

from __future__ import annotations

from typing import Any

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    notify_kv_cache_written,
    wait_for_kv_layer_from_connector,
)

from fakes import ascend_runtime


class AscendMLAImpl:
    def forward(self, layer_name, hidden_states, kv_cache, attn_metadata, output=None) -> Any:
        if attn_metadata is None:
            return output
        if attn_metadata.num_prefills > 0:
            wait_for_kv_layer_from_connector(layer_name)
        ascend_runtime.write_blocks(layer_name, kv_cache, attn_metadata)
        notify_kv_cache_written(layer_name)
        ascend_runtime.attention(layer_name, kv_cache, attn_metadata)
        maybe_save_kv_layer_to_connector(layer_name, [kv_cache])
        return output
