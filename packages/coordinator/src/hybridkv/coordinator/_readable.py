"""The round trip between a coordinator's lookup mask and one batched store query.

The integration asks the store about exactly the marked blocks, in one batch, and hands
the flat answer back; these two functions fix the order both sides agree on (group by
group, blocks ascending) so neither re-derives it.
"""

from __future__ import annotations

from collections.abc import Sequence

Masks = tuple[tuple[bool, ...], ...]


def marked_blocks(masks: Masks) -> list[tuple[int, int]]:
    """`(group, block)` of every marked block, in batched-query order."""
    return [
        (group, block)
        for group, mask in enumerate(masks)
        for block, marked in enumerate(mask)
        if marked
    ]


def scatter_readable(masks: Masks, answers: Sequence[bool]) -> Masks:
    """Per-group readability from the flat answers to `marked_blocks(masks)`.

    Blocks that were not asked about come back unreadable, which is what `find_hit` must
    assume of them.
    """
    expected = sum(sum(mask) for mask in masks)
    if len(answers) != expected:
        raise ValueError(f"scatter_readable: {len(answers)} answers for {expected} marked blocks")
    require_bools("scatter_readable: answers", answers)
    flat = iter(answers)
    return tuple(tuple(bool(next(flat)) if marked else False for marked in mask) for mask in masks)


def is_bool(value: object) -> bool:
    """True and False (1 and 0 equal them): a store's error code (-1) is truthy, not
    readable."""
    return value == True or value == False  # noqa: E712


def require_bools(name: str, values: Sequence[object]) -> None:
    """Refuses anything that is not `is_bool`."""
    if not isinstance(values, (list, tuple)):
        values = list(values)
    if values.count(True) + values.count(False) == len(values):  # counted in C
        return
    index, value = next((i, v) for i, v in enumerate(values) if not is_bool(v))
    raise ValueError(f"{name} must hold bools, got {value!r} at index {index}")
