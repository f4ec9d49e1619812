"""A small hybrid model's KV caches in numpy memory, as the engine tests' "device".

The layout is the issue's example: three groups with unequal entry counts and sizes, and
physical layer 2 shared by two groups.

| group | kind          | tokens/block | physical layers | commits after |
| 0     | full attention| 16           | 0, 2            | layer 2       |
| 1     | compressed KV | 32           | 1, 2, 3         | layer 3       |
| 2     | window/state  | 16           | 0, 3            | layer 3       |
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.transport.layout import CacheEntry, GroupLayout
from hybridkv.transport.ownership import BlockTransfer

# group -> (layer, cache name, bytes per block, stride padding)
SPECS: dict[int, list[tuple[int, str, int, int]]] = {
    0: [(0, "k", 512, 0), (0, "v", 512, 64), (2, "kv", 1024, 0)],
    1: [
        (1, "latent", 576, 0),
        (2, "latent", 576, 0),
        (2, "indexer", 136, 8),
        (3, "latent", 576, 0),
    ],
    2: [(0, "window", 256, 0), (3, "state", 1000, 24)],
}
NUM_LAYERS = 4


class Caches:
    """Numpy arrays standing for one worker's KV cache tensors."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.num_blocks = num_blocks
        self.rng = np.random.default_rng(seed)
        self.arrays: dict[tuple[int, int, str], np.ndarray] = {}
        layouts = []
        for group, specs in SPECS.items():
            entries = []
            for layer, name, nbytes, pad in specs:
                array = np.zeros((num_blocks, nbytes + pad), dtype=np.uint8)
                self.arrays[(group, layer, name)] = array
                entries.append(
                    CacheEntry(
                        layer=layer,
                        name=name,
                        base_ptr=array.ctypes.data,
                        block_bytes=nbytes,
                        block_stride=nbytes + pad,
                        num_blocks=num_blocks,
                    )
                )
            layouts.append(GroupLayout(group, entries))
        self.layouts = layouts

    def fill(self, layers: Sequence[int] | None = None) -> None:
        """Random bytes everywhere (or in the given layers only)."""
        for (_, layer, _), array in self.arrays.items():
            if layers is None or layer in layers:
                array[:] = self.rng.integers(0, 256, size=array.shape, dtype=np.uint8)

    def clear(self) -> None:
        for array in self.arrays.values():
            array[:] = 0

    def block_bytes(self, group: int, block: int, layers: Sequence[int] | None = None) -> bytes:
        """The object a block should become: its entries' bytes in (layer, name) order."""
        layout = self.layouts[group]
        return b"".join(
            self.arrays[(group, entry.layer, entry.name)][block, : entry.block_bytes].tobytes()
            for entry in layout.entries
            if layers is None or entry.layer in layers
        )


def transfers(
    blocks: dict[int, Sequence[int]], request_id: str = "req", prefix: str = "k"
) -> list[BlockTransfer]:
    """One transfer per (group, logical block); key names group and block index."""
    return [
        BlockTransfer(
            key=f"{prefix}@group:{group}@{index}",
            group=group,
            local_block=local,
            request_id=request_id,
            block_index=index,
        )
        for group, locals_ in blocks.items()
        for index, local in enumerate(locals_)
    ]
