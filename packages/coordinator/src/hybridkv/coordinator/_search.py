"""A lookup that asks the store about the few blocks a hit depends on, not every block.

`lookup_mask` and one query decide any hit exactly, at a cost linear in the prompt (times
heads and groups). A pool that keeps prefixes whole holds, in each group that needs the
whole prefix (full attention), a run of blocks from block 0, so the run's end can be
searched: `HitSearch` probes the first such group (one cheap question per block; two
rounds find the end of a run of up to a million blocks, see `_points`), then confirms
with full questions only the blocks the hit depends on: each whole-prefix group's last
needed block, and every needed block of the other kinds (window tails, state snapshots,
chunks). A whole-prefix group whose last block misses is searched again, every head
asked. After `CONFIRM_ROUNDS` the rest is asked at once. Sans-I/O in h11's style:
`next_asks` says what to ask, `answer` takes the answers, until `next_asks` is None.

The hit is never smaller than the exact one. It is larger only where a whole-prefix block
below the last one the hit needs is unreadable though no probe said so: a hole in the
middle of a stored prefix that the probes stepped over, or a head missing from such a
block (a probe asks one). Loading that block then fails, and vLLM recomputes the request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridkv.coordinator._columns import SearchedColumn
from hybridkv.coordinator._readable import Masks, require_bools

if TYPE_CHECKING:
    from hybridkv.coordinator._coordinator import Coordinator, Hit

#: Blocks one probe round asks at least, and a range it asks whole (see `_points`).
FAN = 64
SWEEP = 512
#: Confirm rounds before the search asks every remaining block (bounded round trips where
#: confirmations keep failing, e.g. a head missing from a long run of blocks).
CONFIRM_ROUNDS = 3

Block = tuple[int, int]  # (group, block)


@dataclass(frozen=True, slots=True)
class Asks:
    """One round trip's questions. `probes`: whether a block's first object is readable
    (a no is certain, a yes only likely); `confirms`: whether every object of the block is."""

    probes: tuple[Block, ...]
    confirms: tuple[Block, ...]


class HitSearch:
    """The hit of one lookup, learnt over a few small queries (see the module)."""

    __slots__ = (
        "_confirmed",
        "_confirming",
        "_coordinator",
        "_hit",
        "_known_tokens",
        "_lengths",
        "_local",
        "_max_tokens",
        "_pending",
        "_rounds",
        "_runs",
        "_tail_unit",
        "_tails",
    )

    def __init__(
        self,
        coordinator: Coordinator,
        max_tokens: int,
        known_tokens: int | None = None,
        local_tokens: int = 0,
        tail_unit: int = 0,
    ) -> None:
        """As `find_hit(max_tokens, ..., known_tokens)`; blocks within `local_tokens` (held
        by vLLM already) count as readable and are never asked. With a `tail_unit`, the
        blocks prompt tails past the hit need are confirmed too (`readable`)."""
        self._coordinator = coordinator
        self._max_tokens = max_tokens
        self._known_tokens = known_tokens
        self._tail_unit = tail_unit
        self._tails = coordinator.tails_possible(tail_unit)
        known = max_tokens if known_tokens is None else known_tokens
        groups = coordinator.groups
        # Per group, the blocks of the known tokens: every block a hit or tail can need.
        self._lengths = [known // kind.block_size for kind in groups]
        self._local = [
            min(length, local_tokens // kind.block_size)
            for kind, length in zip(groups, self._lengths, strict=True)
        ]
        self._confirmed: list[dict[int, bool]] = [{} for _ in groups]
        # Whole-prefix group -> [lo, hi): blocks below lo probed readable, hi the first
        # probed miss (or the end of what a hit could need); searched until lo == hi.
        # Probed: the first (the others' runs end where it does in a pool kept whole,
        # which their confirmed last block checks).
        self._runs = {
            group: [self._local[group], self._lengths[group]]
            for group, kind in enumerate(groups)
            if kind.needs_whole_prefix
        }
        for group in list(self._runs)[1:]:
            del self._runs[group]
        # Whole-prefix groups searched with every head asked (see `answer`).
        self._confirming: set[int] = set()
        self._rounds = 0
        self._pending: tuple[Asks, list[tuple[int, list[int]]]] | None = None
        self._hit: Hit | None = None

    def most_blocks(self) -> list[int]:
        """Per group, at most how many blocks the exact one-query lookup asks about (its
        `lookup_mask`, left uncomputed: long lookups never need it)."""
        return [length - local for length, local in zip(self._lengths, self._local, strict=True)]

    def ask_all(self) -> None:
        """Ask every block in the next round (exact: for lookups small enough that one
        query costs less than the round trips of a search)."""
        if self._pending is not None or self._hit is not None:
            raise RuntimeError("ask_all: the search has started")
        self._runs.clear()
        self._rounds = CONFIRM_ROUNDS

    def next_asks(self) -> Asks | None:
        """What to ask next (the same until answered); None once the hit is known."""
        if self._hit is None and self._pending is None:
            self._pending = self._plan()
        return None if self._pending is None else self._pending[0]

    def answer(self, probes: Sequence[bool], confirms: Sequence[bool]) -> None:
        """The answers to `next_asks`, in its order."""
        if self._pending is None:
            raise RuntimeError("answer: nothing was asked")
        asks, sampled = self._pending
        for name, given, asked in (
            ("probes", probes, asks.probes),
            ("confirms", confirms, asks.confirms),
        ):
            if len(given) != len(asked):
                raise ValueError(f"answer: {len(given)} {name} for {len(asked)} asked")
            require_bools(f"answer: {name}", given)
        self._pending = None
        for (group, block), ok in zip(asks.confirms, confirms, strict=True):
            self._confirmed[group][block] = bool(ok)
        positions = {False: 0, True: 0}
        for group, points in sampled:
            full = group in self._confirming
            start = positions[full]
            positions[full] += len(points)
            answers = (confirms if full else probes)[start : start + len(points)]
            run = self._runs[group]
            for block, ok in zip(points, answers, strict=True):
                if not ok:  # the run ends there (answers past it are not looked at)
                    run[1] = block
                    self._confirmed[group][block] = False
                    break
                run[0] = block + 1
        if sampled or self._rounds > CONFIRM_ROUNDS:  # a search round, or every block asked
            return
        groups = self._coordinator.groups
        for group, block in asks.confirms:
            if self._confirmed[group][block] or not groups[group].needs_whole_prefix:
                continue
            if group not in self._confirming:
                # Its run ends below the probed one (another head stored less than head
                # 0, or another group less than the probed one): search it, every head
                # asked, below the miss.
                self._confirming.add(group)
                self._runs[group] = [self._local[group], block]

    @property
    def hit(self) -> Hit:
        if self._hit is None:
            raise RuntimeError("hit: the search is not done (see next_asks)")
        return self._hit

    def readable(self) -> Masks:
        """Per group, the readability the hit was decided on: confirmed answers, blocks
        vLLM holds, a whole-prefix group's probed run; with tails, every block a tail past
        the hit needs is confirmed."""
        columns = []
        for group, length in enumerate(self._lengths):
            run = self._runs.get(group)
            if run is None:
                column = [True] * length  # until confirmed, as hoped
            else:
                column = [True] * run[0] + [False] * (length - run[0])
            for block, ok in self._confirmed[group].items():
                column[block] = ok
            local = self._local[group]
            column[:local] = [True] * local
            columns.append(tuple(column))
        return tuple(columns)

    def _plan(self) -> tuple[Asks, list[tuple[int, list[int]]]] | None:
        sampled = [(group, _points(lo, hi)) for group, (lo, hi) in self._runs.items() if lo < hi]
        if sampled:
            probes = tuple(
                (group, block)
                for group, points in sampled
                if group not in self._confirming
                for block in points
            )
            confirms = tuple(
                (group, block)
                for group, points in sampled
                if group in self._confirming
                for block in points
            )
            return Asks(probes, confirms), sampled
        if self._rounds >= CONFIRM_ROUNDS:
            unknown = self._unknown(self._everything())
        else:
            tokens = self._boundary()
            unknown = self._unknown(self._deciding(tokens))
            if not unknown and self._tails:
                self._tails = False  # asked once
                unknown = self._unknown(self._tail_blocks(tokens))
        if unknown:
            self._rounds += 1
            return Asks((), tuple(unknown)), []
        self._hit = self._coordinator.hit_at(self._boundary())
        return None

    def _boundary(self) -> int:
        """`find_hit`'s boundary on what is known and hoped so far."""
        coordinator = self._coordinator
        top = coordinator.max_boundary(self._max_tokens, self._known_tokens)
        if self._rounds > CONFIRM_ROUNDS:  # every block asked: as many answers as blocks
            return coordinator.find_hit(
                self._max_tokens, self.readable(), self._known_tokens
            ).tokens
        columns = []
        for group, length in enumerate(self._lengths):
            run = self._runs.get(group)
            answers = self._confirmed[group]
            local = self._local[group]
            columns.append(SearchedColumn(max(local, length if run is None else run[0]), answers))
        return coordinator._boundary_in(top, columns)

    def _unknown(self, blocks: Sequence[Block]) -> list[Block]:
        return [
            (group, block)
            for group, block in blocks
            if self._local[group] <= block < self._lengths[group]
            and block not in self._confirmed[group]
        ]

    def _deciding(self, tokens: int) -> list[Block]:
        """The blocks a hit at `tokens` depends on beyond the probed runs."""
        if not tokens:
            return []
        blocks: list[Block] = []
        for group, kind in enumerate(self._coordinator.groups):
            first, stop = self._coordinator.reach(group, tokens)
            if kind.needs_whole_prefix:
                first = max(first, stop - 1)
            blocks.extend((group, block) for block in range(first, stop))
        return blocks

    def _tail_blocks(self, tokens: int) -> list[Block]:
        """Every block a prompt tail past the hit at `tokens` can need: from where the
        hit's own needs begin (needs only slide right) to where the probed runs end."""
        groups = self._coordinator.groups
        frontier = self._max_tokens
        for group, (lo, _) in self._runs.items():
            frontier = min(frontier, (lo + 1) * groups[group].block_size - 1)
        blocks: list[Block] = []
        for group, kind in enumerate(groups):
            size = kind.block_size
            low = min(kind.first_needed(tokens), tokens // size) if tokens else 0
            blocks.extend((group, block) for block in range(low, frontier // size))
        return blocks

    def _everything(self) -> list[Block]:
        """Every block the exact lookup asks about."""
        mask = self._coordinator.lookup_mask(self._max_tokens, self._known_tokens, self._tail_unit)
        return [
            (group, block)
            for group, marks in enumerate(mask)
            for block, marked in enumerate(marks)
            if marked
        ]


def _points(lo: int, hi: int) -> list[int]:
    """Blocks of [lo, hi): all of a range up to `SWEEP`, else `FAN` or the square root of
    the range where more, spread evenly, both ends included, so that two rounds find the
    end of a run of up to a million blocks (a round trip costs more than the keys)."""
    if hi - lo <= SWEEP:
        return list(range(lo, hi))
    fan = max(FAN, math.isqrt(hi - lo - 1) + 1)
    return sorted({lo + i * (hi - 1 - lo) // (fan - 1) for i in range(fan)})
