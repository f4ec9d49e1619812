"""The fast coordinator agrees with the naive definitions on random hybrid models."""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import coordinator_oracle as oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.coordinator import (
    ChunkedLocal,
    Coordinator,
    FullAttention,
    GroupKind,
    Masks,
    RecurrentState,
    SlidingWindow,
    marked_blocks,
    scatter_readable,
)

BLOCK_SIZES = st.sampled_from([16, 32, 64])
KINDS = st.one_of(
    st.builds(FullAttention, BLOCK_SIZES),
    st.builds(SlidingWindow, BLOCK_SIZES, window=st.integers(1, 300)),
    st.builds(ChunkedLocal, BLOCK_SIZES, chunk=st.one_of(st.integers(1, 400), BLOCK_SIZES)),
    st.builds(RecurrentState, BLOCK_SIZES),
)
DEEPSEEK_V4 = [FullAttention(16), FullAttention(32), SlidingWindow(16, window=16)]


@dataclass(frozen=True)
class Case:
    groups: list[GroupKind]
    alignment: int
    use_eagle: bool
    retention: int
    eagle_groups: frozenset[int] | None = None

    def coordinator(self) -> Coordinator:
        return Coordinator(
            self.groups, self.alignment, self.use_eagle, self.retention, self.eagle_groups
        )

    @property
    def eagle(self) -> frozenset[int]:
        """The groups whose hits EAGLE drops a block of."""
        return oracle.dropping(self.groups, self.use_eagle, self.eagle_groups)


@st.composite
def cases(draw: st.DrawFn, groups: st.SearchStrategy[list[GroupKind]] | None = None) -> Case:
    kinds: list[GroupKind] = draw(
        groups if groups is not None else st.lists(KINDS, min_size=1, max_size=4)
    )
    lcm = math.lcm(*(kind.block_size for kind in kinds))
    alignment = lcm * draw(st.sampled_from([1, 1, 2, 3]))
    sparse = any(isinstance(kind, SlidingWindow | RecurrentState) for kind in kinds)
    retention = draw(st.integers(1, 4)) if sparse else 1
    use_eagle = draw(st.booleans())
    # vLLM names the draft head's groups (`is_eagle_group`) or, naming none, drops on all.
    eagle_groups = None
    if use_eagle and draw(st.booleans()):
        eagle_groups = draw(st.frozensets(st.integers(0, len(kinds) - 1)))
    return Case(kinds, alignment, use_eagle, retention, eagle_groups)


@st.composite
def readable_sets(draw: st.DrawFn, case: Case, max_tokens: int) -> list[list[bool]]:
    """Mostly-readable columns with a few misses (random bools almost never hit), of
    random length so indices past the end are exercised too."""
    columns = []
    for kind in case.groups:
        blocks = max_tokens // kind.block_size
        length = draw(st.integers(0, blocks + 2))
        if draw(st.booleans()):
            misses = draw(st.sets(st.integers(0, max(0, length - 1)), max_size=3))
            columns.append([block not in misses for block in range(length)])
        else:
            columns.append(draw(st.lists(st.booleans(), min_size=length, max_size=length)))
    return columns


def reader(columns: list[list[bool]]) -> oracle.IsReadable:
    return lambda group, block: block < len(columns[group]) and columns[group][block]


TOKENS = st.integers(0, 1100)
# Tokens known past the cap (vLLM: the request's length, one past its cap).
PAST_CAP = st.integers(0, 70)


@settings(max_examples=400, deadline=None)
@given(st.data(), cases(), TOKENS, PAST_CAP)
def test_find_hit_matches_oracle(
    data: st.DataObject, case: Case, max_tokens: int, past_cap: int
) -> None:
    known = max_tokens + past_cap
    columns = data.draw(readable_sets(case, known))
    expected = oracle.find_hit(
        case.groups, case.alignment, case.eagle, max_tokens, reader(columns), known
    )
    coord = case.coordinator()
    hit = coord.find_hit(max_tokens, columns, known)
    assert (hit.tokens, hit.load_masks) == expected
    assert coord.find_hit(max_tokens, reader(columns), known) == hit
    assert hit.tokens % case.alignment == 0
    if not past_cap:
        assert coord.find_hit(max_tokens, columns) == hit


@settings(max_examples=200, deadline=None)
@given(st.data(), cases(st.just(DEEPSEEK_V4)), TOKENS)
def test_deepseek_v4_shape_matches_oracle(data: st.DataObject, case: Case, max_tokens: int) -> None:
    columns = data.draw(readable_sets(case, max_tokens))
    hit = case.coordinator().find_hit(max_tokens, columns)
    assert (hit.tokens, hit.load_masks) == oracle.find_hit(
        case.groups, case.alignment, case.eagle, max_tokens, reader(columns)
    )


# Tail units: none, finer than every block, and some that some block size divides.
TAIL_UNITS = st.sampled_from([0, 1, 3, 4, 8, 24, 32])


@settings(max_examples=300, deadline=None)
@given(cases(), TOKENS, PAST_CAP, TAIL_UNITS, st.one_of(st.none(), TOKENS))
def test_masks_match_oracle(
    case: Case, tokens: int, past_cap: int, tail_unit: int, tail_tokens: int | None
) -> None:
    coord = case.coordinator()
    known = tokens + past_cap
    lookup = oracle.lookup_mask(case.groups, case.alignment, case.eagle, tokens, known, tail_unit)
    assert coord.lookup_mask(tokens, known, tail_unit) == lookup
    if not tail_unit:
        assert coord.lookup_mask(tokens, known) == lookup
    args = (case.groups, case.alignment, case.eagle, case.retention, tokens)
    assert coord.store_mask(tokens, tail_unit, tail_tokens) == oracle.store_mask(
        *args, tail_unit, tail_tokens
    )
    assert coord.store_mask(tokens) == oracle.store_mask(*args)
    aligned = tokens // case.alignment * case.alignment
    assert coord.load_mask(aligned) == oracle.load_mask(case.groups, aligned)


@settings(max_examples=300, deadline=None)
@given(st.data(), cases(), TOKENS, PAST_CAP)
def test_one_batched_lookup_decides_the_hit(
    data: st.DataObject, case: Case, max_tokens: int, past_cap: int
) -> None:
    """Asking the store only about `lookup_mask` blocks, in one flat batch, loses no hit,
    under retention too."""
    known = max_tokens + past_cap
    columns = data.draw(readable_sets(case, known))
    coord = case.coordinator()
    mask = coord.lookup_mask(max_tokens, known)
    is_readable = reader(columns)
    answers = [is_readable(group, block) for group, block in marked_blocks(mask)]
    hit = coord.find_hit(max_tokens, scatter_readable(mask, answers), known)
    assert hit == coord.find_hit(max_tokens, columns, known)


@settings(max_examples=300, deadline=None)
@given(st.data(), cases(), st.integers(1, 1100))
def test_store_then_lookup_finds_the_aligned_prefix(
    data: st.DataObject, case: Case, num_tokens: int
) -> None:
    """What one request stores, a later request over the same tokens finds again, as
    vLLM asks (capped one below its length, which it knows): a resend, an extension
    however much longer (under retention too: it lands on the stored request's end, not
    the last retained boundary), and with dense retention any shorter request."""
    coord = case.coordinator()
    stored = coord.store_mask(num_tokens)
    longer = num_tokens + data.draw(st.integers(1, 300), label="extension")
    requests = {num_tokens: coord.max_boundary(num_tokens - 1, num_tokens)}
    requests[longer] = coord.max_boundary(num_tokens)
    if case.retention == 1:
        shorter = data.draw(st.integers(1, num_tokens), label="shorter")
        requests[shorter] = coord.max_boundary(shorter - 1, shorter)
    for length, expected in requests.items():
        mask = coord.lookup_mask(length - 1, length)
        answers = [
            block < len(stored[group]) and stored[group][block]
            for group, block in marked_blocks(mask)
        ]
        hit = coord.find_hit(length - 1, scatter_readable(mask, answers), length)
        # Past the stored request's end only if nothing there is needed (a window of one).
        assert hit.tokens == expected or (length == longer and hit.tokens > expected), length
        assert hit.load_masks == coord.load_mask(hit.tokens)


@settings(max_examples=400, deadline=None)
@given(st.data(), cases(), TOKENS, st.sampled_from([1, 3, 4, 8]), st.integers(0, 6))
def test_tail_hit_matches_oracle(
    data: st.DataObject, case: Case, max_tokens: int, unit: int, limit: int
) -> None:
    """The aligned hit from one batched query, then one more query about the partial
    objects of the tail boundaries, gives the oracle's largest usable boundary."""
    columns = data.draw(readable_sets(case, max_tokens))
    coord = case.coordinator()
    hit = coord.find_hit(max_tokens, columns)
    # Partial objects anywhere, and some just past the hit where they can matter.
    tails = data.draw(st.sets(st.integers(1, max_tokens + 1), max_size=4))
    tails |= {hit.tokens + unit * k for k in data.draw(st.sets(st.integers(1, 16), max_size=4))}
    stored_tails = {
        (group, tokens)
        for group in range(len(case.groups))
        for tokens in tails
        if data.draw(st.integers(0, 5), label="group keeps it") > 0
    }
    readable = reader(columns) if data.draw(st.booleans(), label="asked lazily") else columns
    candidates = coord.tail_boundaries(hit.tokens, max_tokens, unit, readable, limit)
    assert len(candidates) <= limit
    assert candidates == sorted(set(candidates), reverse=True)
    assert all(coord.is_tail_boundary(tokens) for tokens in candidates)
    # A group needs its partial object where its tail mask ends marked (a window of one
    # sees no earlier token, so needs none).
    assert all(
        coord.partial_groups(tokens)
        == tuple(g for g, mask in enumerate(coord.tail_hit(tokens).load_masks) if mask[-1])
        for tokens in candidates
    )
    usable = [
        tokens
        for tokens in candidates
        if all((group, tokens) in stored_tails for group in coord.partial_groups(tokens))
    ]
    got = coord.tail_hit(usable[0]) if usable else hit
    expected = oracle.tail_hit(
        case.groups,
        case.alignment,
        case.eagle,
        max_tokens,
        unit,
        limit,
        reader(columns),
        lambda group, tokens: (group, tokens) in stored_tails,
    )
    assert (got.tokens, got.load_masks) == expected


def _found(
    coord: Coordinator, stored: Masks, partials: AbstractSet[int], length: int, unit: int
) -> tuple[int, int]:
    """The aligned hit of a request of `length` tokens (capped one below, as vLLM asks),
    asking the store only about `lookup_mask` blocks, and where it resumes after asking
    about tails' partial objects."""
    mask = coord.lookup_mask(length - 1, length, unit)
    answers = [
        block < len(stored[group]) and stored[group][block] for group, block in marked_blocks(mask)
    ]
    readable = scatter_readable(mask, answers)
    hit = coord.find_hit(length - 1, readable, length)
    tails = coord.tail_boundaries(hit.tokens, length - 1, unit, readable, length) if unit else []
    return hit.tokens, next((tokens for tokens in tails if tokens in partials), hit.tokens)


@settings(max_examples=300, deadline=None)
@given(st.data(), cases(), st.integers(1, 1100), st.sampled_from([1, 3, 4, 8, 24]))
def test_store_then_lookup_finds_the_tail(
    data: st.DataObject, case: Case, num_tokens: int, unit: int
) -> None:
    """A prompt stores its whole blocks by `store_mask` and tails (every group's partial
    object) at some multiples of `unit` inside blocks: a resend and an extension resume
    at the last of those tails past their aligned hit, with blocks of unequal sizes too
    (the tail's whole blocks can lie past the last aligned boundary). Under retention,
    sparse groups keep only the tails those two find."""
    coord = case.coordinator()
    stored = coord.store_mask(num_tokens, unit)
    candidates = oracle.tails(case.groups, case.eagle, unit, num_tokens)
    partials = (
        set(data.draw(st.lists(st.sampled_from(candidates), max_size=4))) if candidates else set()
    )
    for length in (num_tokens, num_tokens + data.draw(st.integers(1, 300), label="extension")):
        cap = min(length - 1, num_tokens)
        aligned, got = _found(coord, stored, partials, length, unit)
        usable = [tokens for tokens in partials if aligned < tokens <= cap]
        replay = max((tokens for tokens in candidates if tokens <= cap), default=0)
        kept = usable if case.retention == 1 else [t for t in usable if t == replay]
        if case.retention == 1 or kept:
            assert got == max(kept, default=aligned), length
        assert got == aligned or got in usable, length


@settings(max_examples=200, deadline=None)
@given(KINDS)
def test_needs_slide_right_as_the_boundary_grows(kind: GroupKind) -> None:
    """What the coordinator's jumps and its tail pruning rely on of every kind: the first
    block needed, or the block holding the boundary where it needs none before, never
    moves left."""
    firsts = [min(kind.first_needed(t), t // kind.block_size) for t in range(1, 1200)]
    assert firsts == sorted(firsts)
