"""Fake of vllm_ascend/attention/attention_v1.py (FA): `forward` writes the cache with
`reshape_and_cache`, then `forward_impl` records the fence and runs paged / FIA attention.
"""

from __future__ import annotations

from typing import Any

from vllm_ascend.attention.utils import notify_kv_cache_written
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.attention_fence import (
    record_attention_compute_start,
)

from fakes import ascend_runtime


class AscendAttentionBackendImpl:
    def __init__(self) -> None:
        self.key_cache: Any = None
        self.layer_name_seen: str | None = None

    def reshape_and_cache(self, query, key, value, kv_cache, attn_metadata, output):
        self.key_cache = kv_cache
        ascend_runtime.write_blocks(self.layer_name_seen or "", kv_cache, attn_metadata)
        notify_kv_cache_written()
        return query, key, value, output

    def forward_paged_attention(self, query, attn_metadata, output):
        ascend_runtime.attention(self.layer_name_seen or "", self.key_cache, attn_metadata)
        return output

    def forward_fused_infer_attention(self, query, key, value, attn_metadata, output, kv_cache):
        ascend_runtime.attention(self.layer_name_seen or "", kv_cache, attn_metadata)
        return output

    def forward_impl(self, query, key, value, kv_cache, attn_metadata, output):
        record_attention_compute_start()
        if attn_metadata.attn_state == "DecodeOnly":
            return self.forward_paged_attention(query, attn_metadata, output)
        return self.forward_fused_infer_attention(
            query, key, value, attn_metadata, output, kv_cache
        )

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output=None,
        output_scale=None,
        output_block_scale=None,
    ):
        self.layer_name_seen = layer.layer_name  # the real impl has no name: only the layer does
        if attn_metadata is None:
            return output
        query, key, value, output = self.reshape_and_cache(
            query, key, value, kv_cache, attn_metadata, output
        )
        return self.forward_impl(query, key, value, kv_cache, attn_metadata, output)
