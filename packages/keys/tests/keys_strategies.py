"""Hypothesis strategies for valid key fields, shared by the test modules."""

from __future__ import annotations

from hypothesis import strategies as st

from hybridkv.keys import BlockKey, HybridKey

MAX_FIELD = 2**63 - 1

models = st.text(
    st.characters(categories=["L", "M", "N", "P", "S"], exclude_characters="@/"),
    min_size=1,
    max_size=40,
)
layouts = st.text("ABCDEFabcdefXYZxyz0123456789", min_size=1, max_size=64)
hex_hashes = st.text("0123456789abcdef", min_size=1, max_size=64)
counters = st.integers(0, MAX_FIELD)
block_sizes = st.integers(1, MAX_FIELD)

block_keys = st.builds(BlockKey, models, hex_hashes, counters)
hybrid_keys = st.builds(
    HybridKey,
    models,
    layouts,
    counters,
    block_sizes,
    hex_hashes,
    counters,
    st.none() | counters,
)
keys = block_keys | hybrid_keys
