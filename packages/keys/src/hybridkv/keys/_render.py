"""Bulk rendering of the keys of one group.

A long prompt asks for blocks x heads keys per group at once (a 128k-token prompt with four
groups and eight heads is a quarter of a million keys). Building and validating a key object
for each would dominate the lookup, yet every key of a group shares its prefix: the prefix is
validated and rendered once here, and each key costs one hex conversion and a concatenation.
The strings are exactly ``str()`` of the matching BlockKey/HybridKey.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._keys import BlockKey, HybridKey, KeyFormatError, check_head

# Stands in for the block hash while the constructors validate a group's prefix fields.
_ANY_HASH = "00"


class KeyRenderer:
    """Renders the key strings of one group's objects; build it with a classmethod.

    The prefix fields are validated at construction and the heads on every call. The block
    hashes are trusted to be BlockHasher output: any non-empty ``bytes`` renders as valid
    lowercase hex, so they get no per-key check beyond that.
    """

    __slots__ = ("_prefix",)

    def __init__(self, template: BlockKey | HybridKey) -> None:
        self._prefix = template.prefix

    @classmethod
    def single_group(cls, model: str) -> KeyRenderer:
        """Keys in the single-group format, ``{model}@{block_hash}@{head}``."""
        return cls(BlockKey(model, _ANY_HASH, 0))

    @classmethod
    def hybrid(
        cls, model: str, layout: str, group: int, block_size: int, pp_rank: int | None = None
    ) -> KeyRenderer:
        """Keys of one KV cache group in the mooncake_hybrid_v1 format."""
        return cls(HybridKey(model, layout, group, block_size, _ANY_HASH, 0, pp_rank))

    @property
    def prefix(self) -> str:
        """Everything before the block hash, shared by all keys this renderer makes."""
        return self._prefix

    def render(self, block_hash: bytes, head: int) -> str:
        """The key of one block stored by ``head``."""
        return self.render_all((block_hash,), (head,))[0]

    def render_all(self, block_hashes: Iterable[bytes], heads: Iterable[int]) -> list[str]:
        """Keys of every block for every head: block-major, ``heads`` order within a block."""
        # Both are read twice (checked, then rendered): an iterator would be spent by the check.
        block_hashes = tuple(block_hashes)
        heads = tuple(heads)
        for head in heads:
            check_head(head)
        if not all(block_hashes):
            raise KeyFormatError("block_hash", "is empty")
        suffixes = [f"@{head}" for head in heads]
        prefix = self._prefix
        # bytes.hex (not h.hex) so that a str or bytearray hash is a TypeError, not a key.
        stems = [prefix + bytes.hex(block_hash) for block_hash in block_hashes]
        return [stem + suffix for stem in stems for suffix in suffixes]
