"""Reuse without Mooncake: a dict-backed store answers readability, the coordinator is
used unchanged. Blocks are keyed as the integration keys them, by `hybridkv.keys`: the
chain hash at the block's end, rendered into a hybrid key, so a request that diverges
from a stored one stops matching at the divergence."""

from __future__ import annotations

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
from hybridkv.keys import BlockHasher, KeyRenderer

HASH_UNIT = 16  # divides every block size below; prompt tails lie on its multiples


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


def hashed(tokens: list[int]) -> BlockHasher:
    hasher = BlockHasher(HASH_UNIT, "")
    hasher.extend(tokens)
    return hasher


def renderer(coord: Coordinator, group: int) -> KeyRenderer:
    size = coord.groups[group].block_size
    return KeyRenderer.hybrid("tiny", "0f", group=group, block_size=size, pp_rank=None)


def block_keys(coord: Coordinator, tokens: list[int]) -> list[list[str]]:
    """Per group, one key per full block (one storing head)."""
    hasher = hashed(tokens)
    return [
        renderer(coord, group).render_all(hasher.hashes_for(kind.block_size), [0])
        for group, kind in enumerate(coord.groups)
    ]


def save(coord: Coordinator, store: DictStore, tokens: list[int], tail_unit: int = 0) -> int:
    keys = block_keys(coord, tokens)
    saved = 0
    for group, mask in enumerate(coord.store_mask(len(tokens), tail_unit)):
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


def tail_keys(coord: Coordinator, tokens: list[int], at: int) -> list[str]:
    """The keys of the partial objects a prompt tail at `at` keeps, one per group that
    keeps one."""
    tail_hash = hashed(tokens[:at]).boundary_hash(at)
    return [renderer(coord, group).render(tail_hash, 0) for group in coord.partial_groups(at)]


def load_with_tail(coord: Coordinator, store: DictStore, tokens: list[int]) -> int:
    """The aligned hit from one batched query, then the largest tail whose partial
    objects the store holds."""
    keys = block_keys(coord, tokens)
    cap = len(tokens) - 1
    mask = coord.lookup_mask(cap, len(tokens), HASH_UNIT)
    asked = marked_blocks(mask)
    answers = store.batch_exists([keys[group][block] for group, block in asked])
    readable = scatter_readable(mask, answers)
    hit = coord.find_hit(cap, readable, len(tokens))
    for tail in coord.tail_boundaries(hit.tokens, cap, HASH_UNIT, readable, 512):
        if all(store.batch_exists(tail_keys(coord, tokens, tail))):
            return tail
    return hit.tokens


@settings(max_examples=100, deadline=None)
@given(st.data(), st.integers(1, 700), st.integers(1, 300))
def test_a_prompt_diverging_at_d_resumes_at_its_last_tail_before_d(
    data: st.DataObject, stored: int, extra: int
) -> None:
    """Attention blocks of 64 beside states of 128, tails every 16 tokens: a request
    sharing `shared` tokens with a stored prompt resumes at the last of the prompt's
    tails (or aligned boundaries) within them, never past them. (A tail in the prompt's
    last 64 tokens past its last aligned boundary needs a block that boundary does not.)"""
    coord = Coordinator([FullAttention(64), RecurrentState(128)])
    store = DictStore()
    first = list(range(stored))
    save(coord, store, first, HASH_UNIT)
    inside = [t for t in range(HASH_UNIT, stored + 1, HASH_UNIT) if coord.is_tail_boundary(t)]
    tails = data.draw(st.lists(st.sampled_from(inside), max_size=3)) if inside else []
    if inside and data.draw(st.booleans(), label="the prompt's last tail"):
        tails.append(inside[-1])
    for at in tails:
        for key in tail_keys(coord, first, at):
            store.put(key, b"partial")
    shared = data.draw(st.one_of(st.just(stored), st.integers(0, stored)), label="shared")
    second = [*first[:shared], *range(10_000, 10_000 + extra)]
    common = min(shared, len(second) - 1)
    aligned = common // coord.alignment * coord.alignment
    expected = max([aligned, *(t for t in tails if t <= common)])
    assert load_with_tail(coord, store, second) == expected
