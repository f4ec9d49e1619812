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

__all__ = [
    "HYBRID_TAG",
    "BlockHasher",
    "BlockKey",
    "HybridKey",
    "KeyFormatError",
    "KeyRenderer",
    "layout_digest",
    "model_name",
    "parse_key",
    "scope_digest",
    "topology_digest",
]
