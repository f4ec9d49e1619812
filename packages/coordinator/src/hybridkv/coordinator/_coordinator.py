"""One cache-hit boundary for all KV cache groups of a hybrid model.

A pooled prefix is usable only at a boundary where every group has what it needs there;
this module finds that boundary and says which blocks to store, to ask about and to load.
It never talks to a store: readability comes in as plain data or a callable, so any store
(Mooncake, Memcache, a dict) plugs in unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from hybridkv.coordinator._columns import Column, Descending, Readable, columns_of
from hybridkv.coordinator._kinds import GroupKind
from hybridkv.coordinator._readable import Masks
from hybridkv.coordinator._search import HitSearch
from hybridkv.coordinator._tails import (
    ends_inside_every_block,
    last_tail,
    search_tails,
    tails_in_group,
)


@dataclass(frozen=True, slots=True)
class Hit:
    """`tokens` usable from the pool, and per group the blocks to load for them."""

    tokens: int
    load_masks: Masks


def _ascending(aligned: range, tails: list[int]) -> Sequence[int]:
    """Aligned boundaries and tails in one ascending sequence (the range itself if none)."""
    return sorted([*aligned, *tails]) if tails else aligned


def _require_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _drafted_groups(
    eagle_groups: Collection[int] | None, use_eagle: bool, count: int
) -> frozenset[int]:
    """Indices of the groups EAGLE's block drop applies to (before each kind has its say)."""
    if eagle_groups is None:
        return frozenset(range(count) if use_eagle else ())
    if not use_eagle:
        raise ValueError("eagle_groups has no effect without use_eagle")
    drafted = list(eagle_groups)  # once: a generator would be spent by the checks
    for index in drafted:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(
                f"eagle_groups: {index!r} is not the index of one of the {count} groups"
            )
    return frozenset(drafted)


class Coordinator:
    """Decides the hit boundary and the blocks behind it for a fixed set of groups.

    `alignment` (default: lcm of the block sizes and chunks) is the step hits land on; it
    must be a multiple of every block size so a boundary never splits a block. A smaller
    explicit alignment lets hits land inside a `ChunkedLocal` chunk. With `use_eagle`,
    every group with `drops_eagle_block` must also have the block starting at the
    boundary readable and within the known tokens (`known_tokens`, default `max_tokens`):
    the matched run reaches one block further and vLLM drops that last matched block to
    recompute it for the draft head. `eagle_groups` narrows that to the groups the draft
    head writes (vLLM's `is_eagle_group`); None means every group. With
    `retention_interval=k`, sparse groups keep their needs only at every k-th aligned
    boundary plus the replay boundaries of each request (lookups still ask about every
    boundary: another request's replay boundaries can be any).
    """

    __slots__ = ("_alignment", "_eagle", "_eagle_tokens", "_groups", "_retention", "_use_eagle")

    def __init__(
        self,
        groups: Sequence[GroupKind],
        alignment: int | None = None,
        use_eagle: bool = False,
        retention_interval: int = 1,
        eagle_groups: Collection[int] | None = None,
    ) -> None:
        groups = tuple(groups)
        if not groups:
            raise ValueError("groups: a coordinator needs at least one KV cache group")
        for index, group in enumerate(groups):
            if not isinstance(group, GroupKind):
                raise ValueError(
                    f"groups[{index}]: unknown group kind {type(group).__name__} "
                    "(use FullAttention, SlidingWindow, ChunkedLocal or RecurrentState)"
                )
        block_sizes = [group.block_size for group in groups]
        if alignment is None:
            alignment = math.lcm(*(group.alignment_unit for group in groups))
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"alignment must be a positive int, got {alignment!r}")
        for index, size in enumerate(block_sizes):
            if alignment % size:
                raise ValueError(
                    f"alignment {alignment} is not a multiple of groups[{index}].block_size "
                    f"{size}: a hit boundary would split its blocks"
                )
        if not isinstance(use_eagle, bool):
            raise ValueError(f"use_eagle must be a bool, got {use_eagle!r}")
        drafted = _drafted_groups(eagle_groups, use_eagle, len(groups))
        if (
            isinstance(retention_interval, bool)
            or not isinstance(retention_interval, int)
            or retention_interval <= 0
        ):
            raise ValueError(
                f"retention_interval must be a positive int, got {retention_interval!r}"
            )
        if retention_interval > 1 and not any(group.sparse for group in groups):
            raise ValueError(
                f"retention_interval {retention_interval} has no effect: no SlidingWindow "
                "or RecurrentState group keeps per-boundary snapshots"
            )
        self._groups = groups
        self._alignment = alignment
        self._use_eagle = use_eagle
        self._retention = retention_interval
        self._eagle = tuple(
            int(index in drafted and group.drops_eagle_block) for index, group in enumerate(groups)
        )
        self._eagle_tokens = max(
            (group.block_size for group, extra in zip(groups, self._eagle, strict=True) if extra),
            default=0,
        )

    @property
    def groups(self) -> tuple[GroupKind, ...]:
        return self._groups

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def use_eagle(self) -> bool:
        return self._use_eagle

    @property
    def eagle_tokens(self) -> int:
        """How far past a boundary EAGLE's dropped block reaches (its largest block; 0
        without EAGLE): a request that goes on past `n` tokens can hit at `n` itself."""
        return self._eagle_tokens

    @property
    def retention_interval(self) -> int:
        return self._retention

    def max_boundary(self, max_tokens: int, known_tokens: int | None = None) -> int:
        """Largest boundary a hit capped at `max_tokens` could land on.

        With EAGLE the dropped block past the boundary must lie within `known_tokens`, the
        tokens whose blocks exist (default `max_tokens`): vLLM's hybrid coordinator caps a
        hit at the request's length - 1 but matches the dropped block among all the
        request's full blocks. (Its single-group coordinator matches within length - 1
        only: one block shorter where the length is a multiple of the block size; the
        dropped block is recomputed either way.)
        """
        max_tokens = _require_count("max_tokens", max_tokens)
        known = self._known(max_tokens, known_tokens)
        top = min(max_tokens, known - self._eagle_tokens)
        return max(0, top) // self._alignment * self._alignment

    def _known(self, max_tokens: int, known_tokens: int | None) -> int:
        if known_tokens is None:
            return max_tokens
        known = _require_count("known_tokens", known_tokens)
        if known < max_tokens:
            raise ValueError(f"known_tokens {known} is below max_tokens {max_tokens}")
        return known

    def find_hit(self, max_tokens: int, readable: Readable, known_tokens: int | None = None) -> Hit:
        """Largest aligned boundary <= `max_tokens` whose needs are readable in every group
        (with EAGLE, its dropped block within `known_tokens`, as in `max_boundary`).

        Each group in turn lowers the candidate to its own largest readable boundary until
        all agree (vLLM's convergence loop). A group jumps straight below the first miss in
        a candidate's needs: needs only slide left as the boundary shrinks, so every
        boundary in between would still need that block.
        """
        top = self.max_boundary(max_tokens, known_tokens)
        tokens = self._boundary_in(top, self._columns(top, readable))
        return Hit(tokens, self._needed_masks(tokens))

    def _boundary_in(self, top: int, columns: Sequence[Column]) -> int:
        """`find_hit`'s boundary, from columns in hand (`HitSearch` brings its own)."""
        tokens = top
        agreed = 0
        group = 0
        while tokens > 0 and agreed < len(self._groups):
            lower = self._largest_readable(group, tokens, columns[group])
            agreed = agreed + 1 if lower == tokens else 1
            tokens = lower
            group = (group + 1) % len(self._groups)
        return tokens

    def lookup_mask(
        self, max_tokens: int, known_tokens: int | None = None, tail_unit: int = 0
    ) -> Masks:
        """Blocks to ask the store about so one batched query decides any hit.

        Covers every boundary `find_hit(max_tokens, ..., known_tokens)` can land on, with
        EAGLE's extra block. Under retention too: a shorter request keeps its replay
        boundaries, which need not be retained ones, and a longer one must find them. With
        `tail_unit`, also the whole blocks of every tail `tail_boundaries` may try up to
        `max_tokens` (they can lie past the last aligned boundary, or between two).
        """
        max_tokens = _require_count("max_tokens", max_tokens)
        known = self._known(max_tokens, known_tokens)
        top = self.max_boundary(max_tokens, known)
        unit = self._tail_unit(tail_unit)
        aligned = range(self._alignment, top + 1, self._alignment)
        return tuple(
            self._reach_mask(
                group, _ascending(aligned, self._tails(group, unit, max_tokens)), known
            )
            for group in range(len(self._groups))
        )

    def store_mask(
        self, num_tokens: int, tail_unit: int = 0, tail_tokens: int | None = None
    ) -> Masks:
        """Blocks to persist after computing `num_tokens` so later lookups can hit.

        Dense groups keep every block some reachable boundary needs; sparse groups keep
        only the windows/snapshots of aligned boundaries (under retention, of every k-th
        one and of the two replay boundaries: a resend capped at `num_tokens - 1` and an
        extension capped at `num_tokens`, both knowing the blocks of `num_tokens`). With
        `tail_unit`, also the whole blocks of the prompt tails stored up to `tail_tokens`
        (default and at most `num_tokens`): every one in dense groups, under retention
        only the two replay tails in sparse ones. (Each tail's partial block is its own
        object, not in the mask.)
        """
        num_tokens = _require_count("num_tokens", num_tokens)
        tail_stop = num_tokens
        if tail_tokens is not None:
            tail_stop = min(tail_stop, _require_count("tail_tokens", tail_tokens))
        unit = self._tail_unit(tail_unit)
        top = self.max_boundary(num_tokens)
        replays = (
            top,
            self.max_boundary(max(0, num_tokens - 1), num_tokens),
            # The tails a resend (capped below the prompt's end) and an extension find.
            last_tail(self._groups, unit, tail_stop - 1),
            last_tail(self._groups, unit, tail_stop),
        )
        return tuple(
            self._reach_mask(
                group, self._boundaries(group, top, replays, unit, tail_stop), num_tokens
            )
            for group in range(len(self._groups))
        )

    def hit_at(self, tokens: int) -> Hit:
        """The hit at aligned boundary `tokens`, with its `load_mask`."""
        return Hit(tokens, self.load_mask(tokens))

    def load_mask(self, tokens: int) -> Masks:
        """Blocks needed at exactly boundary `tokens`."""
        tokens = _require_count("tokens", tokens)
        if tokens % self._alignment:
            raise ValueError(
                f"tokens {tokens} is not a multiple of the alignment {self._alignment}"
            )
        return self._needed_masks(tokens)

    def is_tail_boundary(self, tokens: int) -> bool:
        """Whether a prefix of `tokens` ends inside a block of every group.

        Only there can a prefix cut mid-block (a prompt's tail) be stored and found: each
        group keeps its partial block, a recurrent state its snapshot after exactly
        `tokens` tokens.
        """
        return ends_inside_every_block(self._groups, _require_count("tokens", tokens))

    def tail_boundaries(
        self, hit: int, max_tokens: int, unit: int, readable: Readable, limit: int
    ) -> list[int]:
        """Where a prefix cut mid-block could extend aligned hit `hit`, largest first.

        The `limit` largest multiples of `unit` in (`hit`, `max_tokens`] that end inside a
        block of every group and whose needs, each group's partial block apart, are
        `readable` (as in `find_hit`): one more query about their partial objects decides
        the tail. They may lie blocks past `hit`: a Mamba group whose prompt's last chunk
        left its state only at a checkpoint inside it has no state at the block ends in
        between, while attention keeps every block. None when a group drops EAGLE's block
        (it would have to reach past a partial one). Token counts only: a lookup may weigh
        hundreds, and `partial_groups` says what the next query needs of each, while
        `tail_hit` builds the masks of the one taken.
        """
        hit = _require_count("hit", hit)
        max_tokens = _require_count("max_tokens", max_tokens)
        if isinstance(unit, bool) or not isinstance(unit, int) or unit <= 0:
            raise ValueError(f"unit must be a positive int, got {unit!r}")
        limit = _require_count("limit", limit)
        if hit % self._alignment:
            raise ValueError(f"hit {hit} is not a multiple of the alignment {self._alignment}")
        if not self._tail_unit(unit):
            return []
        columns = [Descending(column) for column in self._columns(max_tokens, readable)]
        return search_tails(self._groups, columns, hit, max_tokens, unit, limit)

    def tail_hit(self, tokens: int) -> Hit:
        """The hit of a prefix cut mid-block: per group the blocks needed at `tokens`, the
        last of them the partial block (`tokens // block_size`)."""
        self._require_tail_boundary(tokens)
        return Hit(tokens, self._needed_masks(tokens))

    def partial_groups(self, tokens: int) -> tuple[int, ...]:
        """The groups whose tail at `tokens` loads its partial block, the prefix's own
        object (`tail_hit`'s masks end marked there): a group whose next token depends on
        no earlier token (a window of one, a chunk's first token) needs none."""
        self._require_tail_boundary(tokens)
        return tuple(
            group
            for group, kind in enumerate(self._groups)
            if kind.first_needed(tokens) <= tokens // kind.block_size
        )

    def _require_tail_boundary(self, tokens: int) -> None:
        if not self.is_tail_boundary(tokens):
            raise ValueError(
                f"tokens {tokens} does not end inside a block of every group "
                f"(block sizes {[group.block_size for group in self._groups]})"
            )

    def search(
        self,
        max_tokens: int,
        known_tokens: int | None = None,
        local_tokens: int = 0,
        tail_unit: int = 0,
    ) -> HitSearch:
        """`find_hit` learnt over a few small queries instead of one about every block
        `lookup_mask` marks (see `HitSearch`)."""
        return HitSearch(self, max_tokens, known_tokens, local_tokens, tail_unit)

    def tails_possible(self, tail_unit: int) -> bool:
        """Whether `tail_boundaries` can find any tail with this unit."""
        return self._tail_unit(tail_unit) > 0

    def reach(self, group: int, tokens: int) -> tuple[int, int]:
        """Blocks `[first, stop)` of `group` a hit at `tokens` (> 0) needs, EAGLE's
        dropped block included."""
        return self._reach(group, tokens)

    def _reach(self, group: int, tokens: int) -> tuple[int, int]:
        """Blocks `[first, stop)` that must be readable for a hit at `tokens` (> 0)."""
        kind = self._groups[group]
        return kind.first_needed(tokens), tokens // kind.block_size + self._eagle[group]

    def _largest_readable(self, group: int, tokens: int, column: Column) -> int:
        """Largest aligned boundary <= `tokens` at which this group alone can hit."""
        block_size = self._groups[group].block_size
        extra = self._eagle[group]
        while tokens > 0:
            miss = column.first_miss(*self._reach(group, tokens))
            if miss is None:
                return tokens
            # The next candidate's reach must stop before the miss.
            tokens = max(0, (miss - extra) * block_size // self._alignment * self._alignment)
        return 0

    def _columns(self, top: int, readable: Readable) -> list[Column]:
        reach = [
            top // kind.block_size + extra if top else 0
            for kind, extra in zip(self._groups, self._eagle, strict=True)
        ]
        return columns_of(readable, reach)

    def _boundaries(
        self, group: int, top: int, replays: Iterable[int], unit: int, tail_stop: int
    ) -> Sequence[int]:
        """Ascending boundaries whose needs this group keeps: aligned ones up to `top` and
        tails up to `tail_stop` (under retention, sparse groups only every k-th aligned
        one and the `replays`)."""
        step = self._alignment
        if self._retention == 1 or not self._groups[group].sparse:
            return _ascending(range(step, top + 1, step), self._tails(group, unit, tail_stop))
        retained = set(range(step * self._retention, top + 1, step * self._retention))
        retained.update(replay for replay in replays if replay > 0)
        return sorted(retained)

    def _tail_unit(self, unit: int) -> int:
        """`unit` if tails can exist: 0 where EAGLE drops a block (`tail_boundaries` then finds
        none) or a block size divides it (no multiple ends inside every group's block)."""
        unit = _require_count("tail_unit", unit)
        if self._eagle_tokens or any(unit % group.block_size == 0 for group in self._groups):
            return 0
        return unit

    def _tails(self, group: int, unit: int, stop: int) -> list[int]:
        return tails_in_group(self._groups, self._alignment, group, unit, stop)

    def _reach_mask(self, group: int, boundaries: Sequence[int], tokens: int) -> tuple[bool, ...]:
        """Union of the reach of ascending `boundaries` over the full blocks of `tokens`
        tokens (a tail's stops before its partial block, which is an object of its own).

        A long prompt has a boundary per block: rather than each one's reach, spans of
        boundaries are taken whole where their two ends' reaches overlap (`_runs`).
        """
        marks = [False] * (tokens // self._groups[group].block_size)
        for first, stop in self._runs(group, boundaries):
            marks[first:stop] = [True] * (stop - first)
        return tuple(marks)

    def _runs(self, group: int, boundaries: Sequence[int]) -> list[tuple[int, int]]:
        """The blocks `boundaries` (ascending) reach, as ascending disjoint runs.

        Where the reaches of a span's first and last boundaries are non-empty and overlap,
        the span reaches exactly from the first's start to the last's stop: neither a
        reach's start (where non-empty) nor its stop ever decreases as the boundary grows
        (`GroupKind`), so every reach between lies inside. Other spans are halved: a
        full-attention group takes one step, one with k gaps about k log n.
        """
        kind = self._groups[group]
        first_needed, block_size, extra = kind.first_needed, kind.block_size, self._eagle[group]
        runs: list[tuple[int, int]] = []
        spans = [(0, len(boundaries) - 1)] if boundaries else []
        while spans:  # depth first, lower half first: runs come out ascending
            low, high = spans.pop()
            first = first_needed(boundaries[low])
            stop = boundaries[low] // block_size + extra
            last_first = first_needed(boundaries[high])
            last_stop = boundaries[high] // block_size + extra
            if first < stop and last_first < last_stop and last_first <= stop:
                span = (first, last_stop)
            elif low == high:
                if first >= stop:
                    continue  # needs nothing but a partial block: an empty reach
                span = (first, stop)
            else:
                middle = (low + high) // 2
                spans += [(middle + 1, high), (low, middle)]
                continue
            if runs and span[0] <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], span[1]))
            else:
                runs.append(span)
        return runs

    def _needed_masks(self, tokens: int) -> Masks:
        masks = []
        for kind in self._groups:
            blocks = -(-tokens // kind.block_size)
            first = kind.first_needed(tokens) if tokens else 0
            masks.append((False,) * first + (True,) * (blocks - first))
        return tuple(masks)
