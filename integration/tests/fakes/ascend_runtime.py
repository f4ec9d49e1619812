"""What the fake vllm-ascend kernels run on: a fake NPU stream, a trace and a connector slot.

Caches are numpy byte arrays shaped [num_blocks, block_bytes]; a "kernel" is a closure the
fake device runs later, in stream order, exactly as an NPU runs queued ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fakes.npu import FakeNpuDevice

device: FakeNpuDevice | None = None
trace: list[str] = []  # host-side order of ops and connector calls
connector: Any = None  # what vLLM's get_kv_transfer_group() would return


def launch(op: str, layer: str, kernel: Callable[[], None]) -> None:
    trace.append(f"{op}:{layer}")
    assert device is not None, "fake NPU device not started"
    device.launch(kernel)


@dataclass
class FakeAttnMetadata:
    """The fields the fake kernels use: which blocks this step writes and reads."""

    write_blocks: list[int]
    read_blocks: list[int]
    fill: int
    attn_state: str = "PrefillNoCache"
    num_prefills: int = 1  # requests vLLM-Ascend counts as prefills (short queries: decodes)
    seen: dict[str, int] = field(default_factory=dict)  # layer -> checksum the kernel read


def write_blocks(layer: str, cache: np.ndarray, metadata: FakeAttnMetadata) -> None:
    def kernel() -> None:
        cache[metadata.write_blocks] = metadata.fill

    launch("cache_write", layer, kernel)


def attention(layer: str, cache: np.ndarray, metadata: FakeAttnMetadata) -> None:
    def kernel() -> None:
        metadata.seen[layer] = int(cache[metadata.read_blocks].astype(np.int64).sum())

    launch("attention", layer, kernel)


class AttentionLayer:
    """vLLM's `Attention` around an impl: connector load before, save after (its decorator)."""

    def __init__(self, layer_name: str, impl: Any) -> None:
        self.layer_name = layer_name
        self.impl = impl

    def forward(self, kv_cache: Any, attn_metadata: FakeAttnMetadata) -> None:
        if connector is not None:  # vLLM skips it without connector metadata
            connector.wait_for_layer_load(self.layer_name)
        self.impl.forward(self, None, kv_cache, kv_cache, kv_cache, attn_metadata, output=[])
        if connector is not None:
            connector.save_kv_layer(self.layer_name, kv_cache, attn_metadata)
        trace.append(f"o_proj:{self.layer_name}")
