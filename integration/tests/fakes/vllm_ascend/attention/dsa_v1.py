"""Fake of vllm_ascend/attention/dsa_v1.py (DSA, DeepSeek-V4): connector wait, then
`_forward_attention` (prolog cache write, compressor, fence, sparse op from
`DeviceOperator.get_dsa_sparse_attn_op()`), rotary, output projection, connector save.
"""

from __future__ import annotations

from typing import Any

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    notify_kv_cache_written,
    wait_for_kv_layer_from_connector,
)
from vllm_ascend.device.device_op import DeviceOperator
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.attention_fence import (
    record_attention_compute_start,
)

from fakes import ascend_runtime


class AscendDSAImpl:
    def __init__(self, compress_ratio: int = 4) -> None:
        self.compress_ratio = compress_ratio

    def _forward_attention(self, layer_name, hidden_states, kv_cache, layer_metadata):
        ascend_runtime.write_blocks(layer_name, kv_cache, layer_metadata)  # MLA prolog
        if self.compress_ratio > 1:
            ascend_runtime.trace.append(f"compressor:{layer_name}")
        notify_kv_cache_written(layer_name)
        record_attention_compute_start()
        attn_op = DeviceOperator.get_dsa_sparse_attn_op()
        attn_kwargs: dict[str, Any] = DeviceOperator.get_dsa_sparse_attn_base_kwargs()
        attn_kwargs.update(ori_kv=(layer_name, kv_cache, layer_metadata))
        return attn_op(hidden_states, **attn_kwargs)[0]

    def forward(self, layer_name, hidden_states, kv_cache, attn_metadata, output=None):
        if attn_metadata is None:
            return output
        wait_for_kv_layer_from_connector(layer_name)
        out = self._forward_attention(layer_name, hidden_states, kv_cache, attn_metadata)
        ascend_runtime.trace.append(f"o_proj:{layer_name}")
        maybe_save_kv_layer_to_connector(layer_name, [kv_cache])
        return out
