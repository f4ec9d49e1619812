"""Prompt tails: prefixes cut inside a block of every group, where a prompt's KV and
state can be stored past its last block end. Plain functions of the groups."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.coordinator._columns import Column
from hybridkv.coordinator._kinds import GroupKind


def ends_inside_every_block(groups: Sequence[GroupKind], tokens: int) -> bool:
    """Whether a prefix of `tokens` (> 0) ends inside a block of every group."""
    return tokens > 0 and all(tokens % group.block_size for group in groups)


def search_tails(
    groups: Sequence[GroupKind],
    columns: Sequence[Column],
    hit: int,
    max_tokens: int,
    unit: int,
    limit: int,
) -> list[int]:
    """The `limit` largest tails in (`hit`, `max_tokens`] whose whole blocks `columns`
    hold, largest first (`Coordinator.tail_boundaries` checks the arguments)."""
    boundaries: list[int] = []
    tokens = max_tokens // unit * unit
    while tokens > hit and len(boundaries) < limit:
        if not ends_inside_every_block(groups, tokens):
            tokens -= unit
            continue
        below = below_tail_miss(groups, tokens, columns, unit)
        if below is None:
            boundaries.append(tokens)
            tokens -= unit
        else:
            tokens = below
    return boundaries


def below_tail_miss(
    groups: Sequence[GroupKind], tokens: int, columns: Sequence[Column], unit: int
) -> int | None:
    """None if a tail at `tokens` has every whole block it needs readable, else the
    largest multiple of `unit` below it that could: needs only slide left as the
    boundary shrinks, so every boundary whose partial block lies past a miss needs it."""
    for kind, column in zip(groups, columns, strict=True):
        block_size = kind.block_size
        miss = column.first_miss(kind.first_needed(tokens), tokens // block_size)
        if miss is not None:
            return ((miss + 1) * block_size - 1) // unit * unit
    return None


def tails_in_group(
    groups: Sequence[GroupKind], alignment: int, group: int, unit: int, stop: int
) -> list[int]:
    """Ascending tails (multiples of `unit` ending inside a block of every group) up to
    `stop` whose whole blocks in `group` no aligned boundary needs too.

    Needs only slide right, so a tail in a block that an aligned boundary starts needs
    a part of what that boundary does, and in each other block the block's first tail
    needs all its later ones do: only those first tails are left, none at all where
    the group's blocks are the alignment.
    """
    if not unit:
        return []
    size = groups[group].block_size
    found = []
    for aligned in range(0, stop, alignment):
        for start in range(aligned + size, min(aligned + alignment, stop), size):
            tokens = (start // unit + 1) * unit
            while tokens < start + size and not ends_inside_every_block(groups, tokens):
                tokens += unit
            if tokens < start + size and tokens <= stop:
                found.append(tokens)
    return found


def last_tail(groups: Sequence[GroupKind], unit: int, stop: int) -> int:
    """The largest tail up to `stop` (0: none)."""
    if not unit:
        return 0
    tokens = max(0, stop) // unit * unit
    while tokens > 0 and not ends_inside_every_block(groups, tokens):
        tokens -= unit
    return tokens
