"""vLLM's KV cache tensors as the transport's cache entries, one GroupLayout per group.

The transport moves bytes by address: each layer's tensor(s) become entries giving where
block `b` starts and how long it is, whatever the backend's layout (block-major,
K/V-split, kernel blocks, several state tensors per layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.integration.keying import KeySpace
from hybridkv.transport import CacheEntry, GroupLayout


def tensor_entries(layer: int, name: str, tensor: Any, num_blocks: int) -> list[CacheEntry]:
    """Cache entries of one layer's tensor(s); block-major layouts and K/V-split ones.

    `[num_blocks, ...]`: one entry per tensor (attention on CPU, Mamba/conv state pages).
    `[2, num_blocks, ...]`: separate K and V entries (FlashAttention-style layouts).
    A list or tuple (several state tensors of one Mamba layer) gives one entry each.
    A backend that splits each block into `r` kernel blocks (vLLM-Ascend for hybrid
    models: 128-token kernel blocks) has `num_blocks * r` rows where `num_blocks` are
    expected; block `b` is kernel blocks `b*r` to `b*r + r - 1` (vLLM's and vLLM-Ascend's
    block tables map them so), moved together as one run when they lie back to back.
    """
    if isinstance(tensor, list | tuple):
        return [
            entry
            for index, part in enumerate(tensor)
            for entry in tensor_entries(layer, f"{name}#{index}", part, num_blocks)
        ]
    shape = tuple(tensor.shape)
    whole = _by_block(tensor, num_blocks)
    if whole is not None:
        parts = [(name, whole)]
    elif (
        len(shape) >= 2 and shape[0] == 2 and (keys := _by_block(tensor[0], num_blocks)) is not None
    ):
        parts = [(f"{name}#k", keys), (f"{name}#v", _by_block(tensor[1], num_blocks))]
    else:
        raise ValueError(
            f"KV cache tensor of {name} has shape {shape}: expected [{num_blocks}, ...] or "
            f"[2, {num_blocks}, ...] (num_blocks first, or a multiple of it: kernel blocks)"
        )
    entries = []
    for part_name, part in parts:
        if not _one_run(part[0]):
            raise ValueError(
                f"{part_name}: a block's bytes are not one run of memory (shape "
                f"{tuple(part.shape)}, strides {part.stride()})"
            )
        size = part.element_size()
        entries.append(
            CacheEntry(
                layer=layer,
                name=part_name,
                base_ptr=part.data_ptr(),
                block_bytes=part[0].numel() * size,
                block_stride=part.stride(0) * size,
                num_blocks=num_blocks,
            )
        )
    return entries


def _by_block(tensor: Any, num_blocks: int) -> Any:
    """`tensor` with one row per block (kernel blocks grouped by block), or None."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if rows == num_blocks:
        return tensor
    if rows > num_blocks and rows % num_blocks == 0:
        return tensor.unflatten(0, (num_blocks, rows // num_blocks))
    return None


def _one_run(block: Any) -> bool:
    """Whether a block's elements fill one run of memory, in any axis order (vLLM's LBNHC
    views a block as [H, N, C] over memory ordered [N, H, C]: not `is_contiguous`, yet one
    run, moved as it lies)."""
    expected = 1
    for size, stride in sorted(zip(block.shape, block.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def build_layouts(
    keys: KeySpace,
    kv_caches: Mapping[str, Any],
    layer_index: Mapping[str, int],
    num_blocks: int,
) -> list[GroupLayout]:
    """One GroupLayout per plan group, entries from the real tensors of its layers."""
    layouts = []
    for group, plan in enumerate(keys.plan.groups):
        if not plan.layer_names:
            raise ValueError(
                f"KV cache group {plan.vllm_group_id} has no layer on pipeline stage "
                f"{keys.pp_rank}: HybridKVConnector needs every stage to hold layers of every "
                "group (use fewer stages)"
            )
        missing = [name for name in plan.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KV cache group {plan.vllm_group_id}: no tensors for {missing}")
        entries = [
            entry
            for name in plan.layer_names
            for entry in tensor_entries(layer_index[name], name, kv_caches[name], num_blocks)
        ]
        layouts.append(GroupLayout(group, entries))
    return layouts
