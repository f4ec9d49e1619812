"""Reuse without Mooncake: a dict-backed store answers readability, the coordinator is
used unchanged. Blocks are keyed by a chain hash of the tokens up to the block's end,
as a prefix cache keys them, so a request that diverges from a stored one stops matching
at the divergence."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.coordinator import (
    Coordinator,
    FullAttention,
    RecurrentState,
    SlidingWindow,
    marked_blocks,
    scatter_readable,
)


class DictStore:
    """Key -> payload; the only questions asked of it are batched `exists` and `get`."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.queries = 0

    def put(self, key: str, payload: bytes) -> None:
        self.objects[key] = payload

    def batch_exists(self, keys: list[str]) -> list[bool]:
        self.queries += 1
        return [key in self.objects for key in keys]

    def get(self, key: str) -> bytes:
        return self.objects[key]


def block_keys(coord: Coordinator, tokens: list[int]) -> list[list[str]]:
    """Per group, one key per full block: group id plus the chain hash at the block end."""
    keys = []
    for group, kind in enumerate(coord.groups):
        chain = b""
        group_keys = []
        for start in range(0, len(tokens) - kind.block_size + 1, kind.block_size):
            block = tokens[start : start + kind.block_size]
            chain = hashlib.sha256(chain + repr(block).encode()).digest()
            group_keys.append(f"group{group}@{chain.hex()}")
        keys.append(group_keys)
    return keys


def save(coord: Coordinator, store: DictStore, tokens: list[int]) -> int:
    keys = block_keys(coord, tokens)
    saved = 0
    for group, mask in enumerate(coord.store_mask(len(tokens))):
        for block in (index for index, keep in enumerate(mask) if keep):
            store.put(keys[group][block], f"kv of {keys[group][block]}".encode())
            saved += 1
    return saved


def load(coord: Coordinator, store: DictStore, tokens: list[int]) -> tuple[int, int]:
    """The integration's round trip: one batched query, scatter, decide, then fetch."""
    keys = block_keys(coord, tokens)
    mask = coord.lookup_mask(len(tokens) - 1)
    asked = marked_blocks(mask)
    answers = store.batch_exists([keys[group][block] for group, block in asked])
    hit = coord.find_hit(len(tokens) - 1, scatter_readable(mask, answers))
    loaded = 0
    for group, load_mask in enumerate(hit.load_masks):
        for block in (index for index, needed in enumerate(load_mask) if needed):
            assert store.get(keys[group][block]) == f"kv of {keys[group][block]}".encode()
            loaded += 1
    return hit.tokens, loaded


def hybrid() -> Coordinator:
    return Coordinator([FullAttention(16), SlidingWindow(16, window=48), RecurrentState(64)])


def test_a_second_request_reuses_the_shared_prefix_from_a_dict_store() -> None:
    coord = hybrid()
    store = DictStore()
    first = list(range(1000))
    save(coord, store, first)

    second = [*first[:700], *range(5000, 5300)]  # diverges at token 700
    hit, loaded = load(coord, store, second)
    assert hit == 640  # the last boundary (multiple of 64) before the divergence
    assert loaded == 40 + 3 + 1  # full prefix, a 3-block window, one snapshot
    assert store.queries == 1

    resend_hit, _ = load(coord, store, first)
    assert resend_hit == 960  # capped at 999 tokens


def test_sparse_groups_store_only_what_a_boundary_needs() -> None:
    coord = hybrid()
    store = DictStore()
    saved = save(coord, store, list(range(1024)))
    assert saved == 64 + 48 + 16  # window: blocks 1..3 of every 4; state: every block


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 600), st.integers(0, 600), st.integers(1, 600))
def test_the_hit_is_the_aligned_shared_prefix(stored: int, shared: int, extra: int) -> None:
    coord = hybrid()
    store = DictStore()
    first = list(range(stored))
    save(coord, store, first)
    second = [*first[:shared], *range(10_000, 10_000 + extra)]
    hit, _ = load(coord, store, second)
    common = min(shared, stored, len(second) - 1)
    assert hit == common // coord.alignment * coord.alignment
