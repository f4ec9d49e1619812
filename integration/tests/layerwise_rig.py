"""A small hybrid model's caches for layerwise tests: the three-group table of the issue.

| group | kind            | tokens/block | layers  | commits after |
|-------|-----------------|--------------|---------|---------------|
| 0     | full attention  | 16           | 0, 2    | 2             |
| 1     | compressed KV   | 32           | 1, 2, 3 | 3             |
| 2     | window / state  | 16           | 0, 3    | 3             |

Layers 0-2 report through attention windows; layer 3 is a Mamba-type mixer whose state
the kernel updates, so it reports through the post-compute hook. Caches are numpy byte
arrays whose addresses go to the real `TransferEngine`; stores are real `MemoryStore`s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hybridkv.integration.layerwise.compute_window import LayerwiseStrategy
from hybridkv.transport import (
    BlockTransfer,
    CacheEntry,
    CpuEvent,
    Event,
    GroupLayout,
    MemoryStore,
    PipelineOptions,
    TransferEngine,
)

GROUPS = {0: (16, (0, 2)), 1: (32, (1, 2, 3)), 2: (16, (0, 3))}
BLOCK_BYTES = {0: 64, 1: 96, 2: 40}
NUM_BLOCKS = 6
REPORTERS = {
    "model.layers.0.self_attn.attn": 0,
    "model.layers.1.self_attn.attn": 1,
    "model.layers.2.self_attn.attn": 2,
    "model.layers.3.mixer": 3,
}
ATTENTION = [name for name in REPORTERS if name.endswith("attn")]
MIXER = "model.layers.3.mixer"


class Rig:
    """Caches, layouts, an engine over `store`, and a strategy driving it."""

    def __init__(
        self,
        store: MemoryStore | None = None,
        options: PipelineOptions | None = None,
        groups: dict[int, tuple[int, tuple[int, ...]]] = GROUPS,
        reporters: dict[str, int] = REPORTERS,
        new_event: Callable[[], Event] = CpuEvent,
        always_report: Sequence[str] = (),
    ) -> None:
        self.groups = groups
        self.store = store if store is not None else MemoryStore()
        self.caches = {
            (group, layer): np.zeros((NUM_BLOCKS, BLOCK_BYTES[group % 3]), dtype=np.uint8)
            for group, (_, layers) in groups.items()
            for layer in layers
        }
        self.layouts = [
            GroupLayout(
                group,
                [
                    CacheEntry(
                        layer,
                        f"g{group}.l{layer}",
                        self.caches[group, layer].ctypes.data,
                        BLOCK_BYTES[group % 3],
                        BLOCK_BYTES[group % 3],
                        NUM_BLOCKS,
                    )
                    for layer in layers
                ],
            )
            for group, (_, layers) in groups.items()
        ]
        # "layer": ranged puts and gets per layer, the device-memory path the window models
        options = options or PipelineOptions(granularity="layer")
        self.engine = TransferEngine(self.store, self.layouts, options)
        all_layers = sorted({layer for _, layers in groups.values() for layer in layers})
        try:
            self.strategy = LayerwiseStrategy(
                self.engine, all_layers, reporters, new_event, always_report
            )
        except BaseException:
            self.engine.close()  # its threads would outlive the test
            raise

    def transfers(
        self, blocks: Sequence[int], groups: Sequence[int] | None = None, tag: str = ""
    ) -> list[BlockTransfer]:
        return [
            BlockTransfer(self.key(group, block, tag), group, block, "req-1", index)
            for group in (self.groups if groups is None else groups)
            for index, block in enumerate(blocks)
        ]

    @staticmethod
    def key(group: int, block: int, tag: str = "") -> str:
        return f"rig{tag}@group:{group}@block:{block}"

    def fill(self, layer: int, blocks: Sequence[int], value: int) -> None:
        """What a layer's kernel does: write its caches in every group that has it."""
        for (_, cache_layer), cache in self.caches.items():
            if cache_layer == layer:
                cache[list(blocks)] = value

    def readable(self, group: int, blocks: Sequence[int], tag: str = "") -> bool:
        return all(self.store.batch_is_readable([self.key(group, b, tag) for b in blocks]))

    def close(self) -> None:
        self.strategy.abort()
        self.engine.close()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll for something the transfer threads do asynchronously (never a speed check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.002)
    return condition()


class GatedStore(MemoryStore):
    """A `MemoryStore` whose ranged calls can be held at a gate, observed or broken."""

    def __init__(self) -> None:
        super().__init__()
        self.put_gate = threading.Event()
        self.put_gate.set()
        self.get_gate = threading.Event()
        self.get_gate.set()
        self.get_gate_from_offset = 0  # only gets reading at or past this offset wait
        self.put_started = threading.Event()
        self.put_error: BaseException | None = None
        self.get_error: BaseException | None = None
        self.gets_waiting = 0  # get_ranges calls blocked at the gate right now

    def put_ranges(self, keys, ptrs, sizes, offsets):  # type: ignore[no-untyped-def]
        self.put_started.set()
        if self.put_error is not None:
            raise self.put_error
        self.put_gate.wait()
        return super().put_ranges(keys, ptrs, sizes, offsets)

    def get_ranges(self, keys, ptrs, sizes, offsets):  # type: ignore[no-untyped-def]
        if self.get_error is not None:
            raise self.get_error
        if any(offset >= self.get_gate_from_offset for row in offsets for offset in row):
            self.gets_waiting += 1
            self.get_gate.wait()
            self.gets_waiting -= 1
        return super().get_ranges(keys, ptrs, sizes, offsets)


class ClientFailsReads(MemoryStore):
    """Ranged reads raise once `broken`: an error of the client, not a store status."""

    broken = False

    def get_ranges(self, *args: Any, **kwargs: Any) -> Any:
        if self.broken:
            raise RuntimeError("the client broke")
        return super().get_ranges(*args, **kwargs)
