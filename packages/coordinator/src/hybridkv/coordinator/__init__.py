"""Store-agnostic cache-hit boundary decisions across hybrid KV cache groups."""

from hybridkv.coordinator._columns import Readable
from hybridkv.coordinator._coordinator import Coordinator, Hit
from hybridkv.coordinator._kinds import (
    ChunkedLocal,
    FullAttention,
    GroupKind,
    RecurrentState,
    SlidingWindow,
)
from hybridkv.coordinator._readable import Masks, marked_blocks, scatter_readable
from hybridkv.coordinator._search import Asks, HitSearch

__all__ = [
    "Asks",
    "ChunkedLocal",
    "Coordinator",
    "FullAttention",
    "GroupKind",
    "Hit",
    "HitSearch",
    "Masks",
    "Readable",
    "RecurrentState",
    "SlidingWindow",
    "marked_blocks",
    "scatter_readable",
]
