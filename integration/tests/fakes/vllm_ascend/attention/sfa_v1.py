"""Fake of vllm_ascend/attention/sfa_v1.py (SFA): cache scatters, fence, indexer top-k,
the sparse attention op, up-projection, output projection, then the connector save.
"""

from __future__ import annotations

from typing import Any

from vllm_ascend.attention.utils import maybe_save_kv_layer_to_connector, notify_kv_cache_written
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.attention_fence import (
    record_attention_compute_start,
)

from fakes import ascend_runtime


class AscendSFAImpl:
    def __init__(self, **kwargs: Any) -> None:
        self.layer_name = kwargs.get("layer_name")

    def indexer_select_post_process(
        self,
        x,
        q_c,
        kv_cache,
        attn_metadata,
        cos,
        sin,
        actual_seq_lengths_query,
        actual_seq_lengths_key,
    ):
        ascend_runtime.trace.append(f"indexer_topk:{self.layer_name}")
        return attn_metadata.read_blocks

    def _execute_sparse_flash_attention_process(
        self,
        ql_nope,
        q_pe,
        kv_cache,
        topk_indices,
        attn_metadata,
        actual_seq_lengths_query,
        actual_seq_lengths_key,
        block_table=None,
    ):
        ascend_runtime.attention(self.layer_name, kv_cache, attn_metadata)
        return ql_nope

    def forward(self, layer_name, hidden_states, kv_cache, attn_metadata, output=None):
        if attn_metadata is None:
            return output
        ascend_runtime.write_blocks(layer_name, kv_cache, attn_metadata)
        notify_kv_cache_written(self.layer_name or "")
        record_attention_compute_start()
        topk = self.indexer_select_post_process(
            hidden_states, None, kv_cache, attn_metadata, None, None, None, None
        )
        attn_output = self._execute_sparse_flash_attention_process(
            hidden_states, None, kv_cache, topk, attn_metadata, None, None
        )
        ascend_runtime.trace.append(f"o_proj:{layer_name}")
        maybe_save_kv_layer_to_connector(layer_name, [kv_cache])
        return attn_output
