"""A small hybrid model's KV caches in numpy memory, as the engine tests' "device".

The layout is the issue's example: three groups with unequal entry counts and sizes, and
physical layer 2 shared by two groups.

| group | kind          | tokens/block | physical layers | commits after |
| 0     | full attention| 16           | 0, 2            | layer 2       |
| 1     | compressed KV | 32           | 1, 2, 3         | layer 3       |
| 2     | window/state  | 16           | 0, 3            | layer 3       |
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

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
BLOCK_PADDING = 40  # after each block of a block-major group
ALL_GROUPS = tuple(SPECS)


class Caches:
    """Numpy arrays standing for one worker's KV cache tensors.

    Each entry has its own array (per-layer tensors, vLLM's layer-outermost layouts),
    except in the `block_major` groups: there one array per group holds every block's
    entries back to back in object order, with some padding after each block (vLLM's
    block-outermost layouts), so each object is one run of memory.
    """

    def __init__(self, num_blocks: int, seed: int = 0, block_major: Collection[int] = ()) -> None:
        self.num_blocks = num_blocks
        self.rng = np.random.default_rng(seed)
        self.arrays: dict[tuple[int, int, str], np.ndarray] = {}
        self.padding: dict[int, np.ndarray] = {}  # block-major group -> bytes after each block
        layouts = []
        for group, specs in SPECS.items():
            if group in block_major:
                entries = self._block_major(group, sorted(specs))
            else:
                entries = [self._own_array(group, *spec) for spec in specs]
            layouts.append(GroupLayout(group, entries))
        self.layouts = layouts

    def _own_array(self, group: int, layer: int, name: str, nbytes: int, pad: int) -> CacheEntry:
        array = np.zeros((self.num_blocks, nbytes + pad), dtype=np.uint8)
        self.arrays[(group, layer, name)] = array
        return CacheEntry(layer, name, array.ctypes.data, nbytes, nbytes + pad, self.num_blocks)

    def _block_major(
        self, group: int, specs: Sequence[tuple[int, str, int, int]]
    ) -> list[CacheEntry]:
        stride = sum(nbytes for _, _, nbytes, _ in specs) + BLOCK_PADDING
        memory = np.zeros((self.num_blocks, stride), dtype=np.uint8)
        self.padding[group] = memory[:, stride - BLOCK_PADDING :]
        entries, offset = [], 0
        for layer, name, nbytes, _ in specs:
            view = memory[:, offset : offset + nbytes]
            self.arrays[(group, layer, name)] = view
            entries.append(
                CacheEntry(layer, name, view.ctypes.data, nbytes, stride, self.num_blocks)
            )
            offset += nbytes
        return entries

    def fill(self, layers: Sequence[int] | None = None) -> None:
        """Random bytes everywhere (or in the given layers only)."""
        for (_, layer, _), array in self.arrays.items():
            if layers is None or layer in layers:
                array[:] = self.rng.integers(0, 256, size=array.shape, dtype=np.uint8)

    def clear(self) -> None:
        for array in self.arrays.values():
            array[:] = 0

    def block_address(self, group: int, block: int) -> int:
        """Where a block's first entry lives (in a block-major group: the whole object)."""
        first = self.layouts[group].entries[0]
        return int(self.arrays[(group, first.layer, first.name)][block].ctypes.data)

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
