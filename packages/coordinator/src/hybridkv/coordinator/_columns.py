"""Readability as each group's column of blocks: asked for the first unreadable block of a
range, from data in hand or from a callable asked each block at most once."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice
from typing import Protocol, TypeAlias

from hybridkv.coordinator._readable import is_bool, require_bools

#: Per group, block-indexed readability (indices past the end are unreadable), or
#: `readable(group, block) -> bool`.
Readable: TypeAlias = Sequence[Sequence[bool]] | Callable[[int, int], bool]


class Column(Protocol):
    def first_miss(self, first: int, stop: int) -> int | None: ...


class ListColumn:
    """Readability already in hand: `list.index` scans in C, fast enough for 131k tokens."""

    __slots__ = ("_values",)

    def __init__(self, values: list[bool]) -> None:
        self._values = values

    def first_miss(self, first: int, stop: int) -> int | None:
        try:
            return self._values.index(False, first, stop)
        except ValueError:
            return None


class CallableColumn:
    """Readability asked block by block, each block at most once, only where it matters."""

    __slots__ = ("_answers", "_group", "_readable")

    def __init__(self, readable: Callable[[int, int], bool], group: int) -> None:
        self._readable = readable
        self._group = group
        self._answers: dict[int, bool] = {}

    def first_miss(self, first: int, stop: int) -> int | None:
        for block in range(first, stop):
            answer = self._answers.get(block)
            if answer is None:
                answer = self._readable(self._group, block)
                if not is_bool(answer):
                    raise ValueError(
                        f"readable({self._group}, {block}) must return True or False, "
                        f"got {answer!r}"
                    )
                answer = self._answers[block] = bool(answer)
            if not answer:
                return block
        return None


class SearchedColumn:
    """A column a search learnt a few blocks of: readable below `run`, unreadable from
    there, except the blocks `answers` knows. Asked in time linear in the answers, not
    the column's length (a million-token prompt has 65,536 blocks of 16 tokens)."""

    __slots__ = ("_answers", "_misses", "_run")

    def __init__(self, run: int, answers: Mapping[int, bool]) -> None:
        self._run = run
        self._answers = answers
        self._misses = sorted(block for block, ok in answers.items() if not ok)

    def first_miss(self, first: int, stop: int) -> int | None:
        miss = next((block for block in self._misses if first <= block < stop), None)
        beyond = max(first, self._run)  # the first block past the run not known readable
        while beyond < stop and self._answers.get(beyond, False):
            beyond += 1
        if beyond < stop and (miss is None or beyond < miss):
            return beyond
        return miss


class Descending:
    """A column asked about block ranges whose ends never grow (tail boundaries, largest
    first): blocks already found readable below the current end are not scanned again, so
    a search scans each block about once, not once per boundary."""

    __slots__ = ("_column", "_known")

    def __init__(self, column: Column) -> None:
        self._column = column
        self._known = sys.maxsize  # blocks [_known, the last end) are readable

    def first_miss(self, first: int, stop: int) -> int | None:
        if first >= stop:
            return None
        miss = self._column.first_miss(first, min(stop, self._known))
        if miss is None:
            self._known = min(self._known, first)
        return miss


def columns_of(readable: Readable, reach: Sequence[int]) -> list[Column]:
    """One column per group; `reach[group]`: how many of its blocks a sequence covers
    (shorter ones are padded unreadable, longer ones cut)."""
    if callable(readable):
        return [CallableColumn(readable, group) for group in range(len(reach))]
    if not isinstance(readable, Sequence) or isinstance(readable, (str, bytes, bytearray)):
        raise ValueError(
            "readable must be a callable or one sequence of bools per group, "
            f"got a {type(readable).__name__}"
        )
    if len(readable) != len(reach):
        raise ValueError(f"readable has {len(readable)} entries for {len(reach)} groups")
    columns: list[Column] = []
    for group, (length, given) in enumerate(zip(reach, readable, strict=True)):
        # Unordered (a set of indices, a mapping) would be read by iteration order.
        unordered = isinstance(given, (str, bytes, bytearray, AbstractSet, Mapping))
        if unordered or not isinstance(given, Iterable):
            raise ValueError(
                f"readable[{group}] must be a sequence of bools, got a {type(given).__name__}"
            )
        values = list(islice(given, length))
        require_bools(f"readable[{group}]", values)
        values.extend([False] * (length - len(values)))
        columns.append(ListColumn(values))
    return columns
