"""Object keys, layout digests and content-chained block hashes for hybridkv.

Pure functions and values, no I/O: everything another package needs to name an object in
the store the same way in every process.
"""

from ._digest import layout_digest, scope_digest, topology_digest
from ._hasher import BlockHasher
from ._keys import (
    HYBRID_TAG,
    BlockKey,
    HybridKey,
    KeyFormatError,
    model_name,
    parse_key,
)
from ._render import KeyRenderer
from ._topology import (
    Entry,
    GroupReads,
    ObjectMap,
    Piece,
    Source,
    Span,
    TopologyMismatch,
    plan_reads,
)

__all__ = [
    "HYBRID_TAG",
    "BlockHasher",
    "BlockKey",
    "Entry",
    "GroupReads",
    "HybridKey",
    "KeyFormatError",
    "KeyRenderer",
    "ObjectMap",
    "Piece",
    "Source",
    "Span",
    "TopologyMismatch",
    "layout_digest",
    "model_name",
    "parse_key",
    "plan_reads",
    "scope_digest",
    "topology_digest",
]
