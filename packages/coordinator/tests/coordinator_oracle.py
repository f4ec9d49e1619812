"""The issue's definitions computed the slow, obvious way: token by token, boundary by
boundary, with no shared code from the package beyond the kind classes themselves."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from hybridkv.coordinator import (
    ChunkedLocal,
    FullAttention,
    GroupKind,
    RecurrentState,
    SlidingWindow,
)

IsReadable = Callable[[int, int], bool]


def needs(kind: GroupKind, tokens: int) -> set[int]:
    """Blocks holding the tokens the next token after `tokens` depends on."""
    if tokens == 0:
        return set()
    bs = kind.block_size
    if isinstance(kind, FullAttention):
        needed_tokens = range(tokens)
    elif isinstance(kind, SlidingWindow):
        needed_tokens = range(max(0, tokens - (kind.window - 1)), tokens)
    elif isinstance(kind, ChunkedLocal):
        needed_tokens = range(tokens // kind.chunk * kind.chunk, tokens)
    elif isinstance(kind, RecurrentState):
        needed_tokens = range(tokens - 1, tokens)
    else:
        raise AssertionError(kind)
    return {token // bs for token in needed_tokens}


def drops_eagle(kind: GroupKind) -> bool:
    return not isinstance(kind, RecurrentState)


def dropping(
    groups: Sequence[GroupKind], use_eagle: bool, eagle_groups: Collection[int] | None
) -> frozenset[int]:
    """The groups whose hits EAGLE drops a block of: its attention groups, all of them
    or those named."""
    return frozenset(
        group
        for group, kind in enumerate(groups)
        if use_eagle and drops_eagle(kind) and (eagle_groups is None or group in eagle_groups)
    )


def eagle_fits(
    groups: Sequence[GroupKind], eagle: Collection[int], tokens: int, known: int
) -> bool:
    """Each dropping group's dropped block (the one starting at `tokens`) must lie inside
    the known tokens."""
    return all(tokens + groups[group].block_size <= known for group in eagle)


def reach(kind: GroupKind, drops: bool, tokens: int) -> set[int]:
    blocks = needs(kind, tokens)
    if drops and tokens > 0:
        blocks.add(tokens // kind.block_size)
    return blocks


def candidates(
    groups: Sequence[GroupKind], alignment: int, eagle: Collection[int], cap: int, known: int
) -> list[int]:
    return [
        tokens
        for tokens in range(alignment, cap + 1, alignment)
        if eagle_fits(groups, eagle, tokens, known)
    ]


def as_mask(blocks: set[int], length: int) -> tuple[bool, ...]:
    return tuple(block in blocks for block in range(length))


def find_hit(
    groups: Sequence[GroupKind],
    alignment: int,
    eagle: Collection[int],
    max_tokens: int,
    is_readable: IsReadable,
    known: int | None = None,
) -> tuple[int, tuple[tuple[bool, ...], ...]]:
    hit = 0
    known = max_tokens if known is None else known
    for tokens in candidates(groups, alignment, eagle, max_tokens, known):
        if all(
            is_readable(group, block)
            for group, kind in enumerate(groups)
            for block in reach(kind, group in eagle, tokens)
        ):
            hit = tokens
    return hit, load_mask(groups, hit)


def load_mask(groups: Sequence[GroupKind], tokens: int) -> tuple[tuple[bool, ...], ...]:
    return tuple(as_mask(needs(kind, tokens), tokens // kind.block_size) for kind in groups)


def tails(groups: Sequence[GroupKind], eagle: Collection[int], unit: int, stop: int) -> list[int]:
    """Where a prompt tail can be: multiples of `unit` up to `stop` inside a block of every
    group (none with EAGLE: its dropped block would lie past a partial one)."""
    if not unit or eagle:
        return []
    return [
        tokens
        for tokens in range(1, stop + 1)
        if tokens % unit == 0 and all(tokens % kind.block_size for kind in groups)
    ]


def whole_needs(kind: GroupKind, tokens: int) -> set[int]:
    """A tail's needs but its partial block (stored as the tail's own object)."""
    return needs(kind, tokens) - {tokens // kind.block_size}


def _kept_mask(
    groups: Sequence[GroupKind],
    alignment: int,
    eagle: Collection[int],
    retention: int,
    cap: int,
    known: int,
    replays: set[int],
    tail_boundaries: Sequence[int],
) -> tuple[tuple[bool, ...], ...]:
    masks = []
    for group, kind in enumerate(groups):
        thinned = retention > 1 and isinstance(kind, SlidingWindow | RecurrentState)
        blocks: set[int] = set()
        for tokens in candidates(groups, alignment, eagle, cap, known):
            if thinned and tokens % (retention * alignment) and tokens not in replays:
                continue
            blocks |= reach(kind, group in eagle, tokens)
        for tokens in tail_boundaries:
            if not thinned or tokens in replays:
                blocks |= whole_needs(kind, tokens)
        masks.append(as_mask(blocks, known // kind.block_size))
    return tuple(masks)


def top(
    groups: Sequence[GroupKind], alignment: int, eagle: Collection[int], cap: int, known: int
) -> int:
    return max(candidates(groups, alignment, eagle, cap, known), default=0)


def lookup_mask(
    groups: Sequence[GroupKind],
    alignment: int,
    eagle: Collection[int],
    max_tokens: int,
    known: int,
    tail_unit: int = 0,
) -> tuple[tuple[bool, ...], ...]:
    """Every boundary's needs, whatever the retention: another request's replay
    boundaries can be any; and every tail's whole blocks."""
    at = tails(groups, eagle, tail_unit, max_tokens)
    return _kept_mask(groups, alignment, eagle, 1, max_tokens, known, set(), at)


def store_mask(
    groups: Sequence[GroupKind],
    alignment: int,
    eagle: Collection[int],
    retention: int,
    num_tokens: int,
    tail_unit: int = 0,
    tail_tokens: int | None = None,
) -> tuple[tuple[bool, ...], ...]:
    """Under retention, sparse groups keep the aligned boundaries and the tails that a
    resend (capped one below the length) and an extension (capped at it) find."""
    tail_stop = num_tokens if tail_tokens is None else min(tail_tokens, num_tokens)
    at = tails(groups, eagle, tail_unit, tail_stop)
    replays = {
        top(groups, alignment, eagle, num_tokens, num_tokens),
        top(groups, alignment, eagle, max(0, num_tokens - 1), num_tokens),
        max([t for t in at if t < tail_stop], default=0),
        max(at, default=0),
    }
    return _kept_mask(groups, alignment, eagle, retention, num_tokens, num_tokens, replays, at)


def tail_hit(
    groups: Sequence[GroupKind],
    alignment: int,
    eagle: Collection[int],
    max_tokens: int,
    unit: int,
    limit: int,
    is_readable: IsReadable,
    is_tail_readable: Callable[[int, int], bool],
) -> tuple[int, tuple[tuple[bool, ...], ...]]:
    """The aligned hit, extended to the largest multiple of `unit` up to `max_tokens`
    ending inside a block of every group whose needs are readable: full blocks as such,
    the block holding the boundary's last token as that group's partial object
    (`is_tail_readable(group, T)`), among the `limit` largest whose full blocks are."""
    hit, masks = find_hit(groups, alignment, eagle, max_tokens, is_readable)
    inside = [tokens for tokens in reversed(tails(groups, eagle, unit, max_tokens)) if tokens > hit]
    whole = [
        tokens
        for tokens in inside
        if all(
            is_readable(group, block)
            for group, kind in enumerate(groups)
            for block in whole_needs(kind, tokens)
        )
    ]
    for tokens in whole[:limit]:
        if all(
            is_tail_readable(group, tokens)
            for group, kind in enumerate(groups)
            if tokens // kind.block_size in needs(kind, tokens)
        ):
            return tokens, tuple(
                as_mask(needs(kind, tokens), -(-tokens // kind.block_size)) for kind in groups
            )
    return hit, masks
