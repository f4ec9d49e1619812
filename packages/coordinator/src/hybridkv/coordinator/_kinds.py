"""What each kind of KV cache group needs at a cache-hit boundary.

Every kind answers the same questions, so neither the coordinator nor a scheduler using
it asks which kind it holds (as vLLM's single-type managers do): the earliest token the
next one depends on (the needs always end at the block holding the boundary's last
token), whether the kind takes part in EAGLE's dropped block, whether its blocks stay
while a request runs, and whether a block holds one recurrent state. Needs only ever
slide right as the boundary grows, which is what lets the coordinator skip past a miss
and leave out tails another boundary covers: precisely,
`min(first_needed(T), T // block_size)` never decreases as T grows (`first_needed` alone
may, past a boundary that needs nothing, as at a chunk's start).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


def _require_positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class GroupKind(ABC):
    """One KV cache group. `block_size` is the raw tokens one block covers.

    Needs at boundary T > 0 are the blocks `first_needed(T) .. ceil(T / block_size) - 1`:
    when T is inside a block, that last block is partial (the prefix cut mid-block);
    T = 0 needs nothing.
    """

    block_size: int

    #: The group's KV at boundary T is a snapshot (a window or a state), not a prefix, so
    #: keeping it at every boundary costs storage that `retention_interval` may thin.
    sparse: ClassVar[bool]
    #: The group is attention that EAGLE re-drafts: its matched run must reach one block
    #: past the hit, which vLLM then drops and recomputes.
    drops_eagle_block: ClassVar[bool]
    #: vLLM keeps every block of the group while the request runs, so a block passed
    #: over can still be stored later (windows and states behind the boundary are freed).
    keeps_passed_blocks: ClassVar[bool]
    #: A block holds one recurrent state, the prefix's summary at a single position,
    #: written in place as a chunk runs: a chunk crossing its end leaves the state further
    #: on, not at the end (Mamba "align" snapshots).
    holds_state: ClassVar[bool]
    #: Every boundary needs the whole prefix, so a pool kept prefix-closed holds a run of
    #: the group's blocks from block 0: the one kind whose boundary a search can bisect.
    needs_whole_prefix: ClassVar[bool]

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, "block_size", self.block_size)

    @property
    def alignment_unit(self) -> int:
        """The step this group's natural hit boundaries fall on (the default alignment's lcm)."""
        return self.block_size

    def first_needed(self, tokens: int) -> int:
        """First block index needed at boundary `tokens` (> 0); a subclass keeps
        `min(first_needed(T), T // block_size)` from ever decreasing as T grows."""
        first = self.first_token_needed(tokens)
        if first >= tokens:  # the next token depends on no earlier one
            return -(-tokens // self.block_size)
        if first < 0:  # a subclass's bug: it would mark blocks from the end of a column
            raise ValueError(
                f"{type(self).__name__}.first_token_needed({tokens}) returned {first}, "
                "not a token index"
            )
        return first // self.block_size

    @abstractmethod
    def first_token_needed(self, tokens: int) -> int:
        """The earliest token the one after `tokens` (> 0) depends on (`tokens`: none)."""


@dataclass(frozen=True, slots=True)
class FullAttention(GroupKind):
    """Attends to the whole prefix (also compressed-KV and indexer caches)."""

    sparse: ClassVar[bool] = False
    drops_eagle_block: ClassVar[bool] = True
    keeps_passed_blocks: ClassVar[bool] = True
    holds_state: ClassVar[bool] = False
    needs_whole_prefix: ClassVar[bool] = True

    def first_token_needed(self, tokens: int) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class SlidingWindow(GroupKind):
    """Attends to the last `window` tokens, the current one included.

    The next token sees `window - 1` earlier tokens, from the block holding token
    `T - window + 1` on (at a block boundary: `ceil((window - 1) / bs)` blocks, vLLM's
    `cdiv(sliding_window - 1, block_size)`).
    """

    window: int

    sparse: ClassVar[bool] = True
    drops_eagle_block: ClassVar[bool] = True
    keeps_passed_blocks: ClassVar[bool] = False
    holds_state: ClassVar[bool] = False
    needs_whole_prefix: ClassVar[bool] = False

    def __post_init__(self) -> None:
        GroupKind.__post_init__(self)
        _require_positive("SlidingWindow", "window", self.window)

    def first_token_needed(self, tokens: int) -> int:
        return max(0, tokens - self.window + 1)


@dataclass(frozen=True, slots=True)
class ChunkedLocal(GroupKind):
    """Attends only within its `chunk`-token chunk (Llama 4 style local attention).

    `chunk` need not be a multiple of `block_size`: the block holding the chunk's first
    token is then needed too, as vLLM's chunked local manager floors the same way.
    """

    chunk: int

    sparse: ClassVar[bool] = False
    drops_eagle_block: ClassVar[bool] = True
    keeps_passed_blocks: ClassVar[bool] = False
    holds_state: ClassVar[bool] = False
    needs_whole_prefix: ClassVar[bool] = False

    def __post_init__(self) -> None:
        GroupKind.__post_init__(self)
        _require_positive("ChunkedLocal", "chunk", self.chunk)

    @property
    def alignment_unit(self) -> int:
        return math.lcm(self.block_size, self.chunk)

    def first_token_needed(self, tokens: int) -> int:
        return tokens // self.chunk * self.chunk


@dataclass(frozen=True, slots=True)
class RecurrentState(GroupKind):
    """State that summarises the whole prefix (Mamba "align" snapshots, compressor state).

    Only the snapshot in the block holding the boundary's last token is needed. Draft
    heads carry no such state, so EAGLE adds nothing here.
    """

    sparse: ClassVar[bool] = True
    drops_eagle_block: ClassVar[bool] = False
    keeps_passed_blocks: ClassVar[bool] = False
    holds_state: ClassVar[bool] = True
    needs_whole_prefix: ClassVar[bool] = False

    def first_token_needed(self, tokens: int) -> int:
        return tokens - 1
