"""What a lookup asks the pool: block hashes, with the group and heads that name their
objects; the keys are rendered where the store is.

A long prompt's exact lookup names hundreds of thousands of objects: as rendered keys
(about 130 B each) that is tens of MB over the lookup socket, as hashes 32 B a block
whatever the heads and stages. The scheduler asks by hashes (`BlockQuery`); worker rank
0 renders them with a key space equal to the scheduler's (`render`). An in-process pool
asked by keys (tests, benchmarks) renders on the caller's side (`RenderingQuery`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.integration.keying import KeySpace

# (plan group, block hashes, heads): every stage's objects of those heads of each hash.
BlockBatch = tuple[int, Sequence[bytes], Sequence[int]]
# Per hash, batch after batch, whether all its objects are readable (None: no answer).
BlockQuery = Callable[[Sequence[BlockBatch]], "list[bool] | None"]
# Readability of each rendered key (None: no answer).
Query = Callable[[Sequence[str]], "list[bool] | None"]


def render(keys: KeySpace, batches: Sequence[BlockBatch]) -> list[str]:
    """The keys of `batches`, batch after batch, each block-major (`KeySpace.keys`); a
    ValueError names a group or head the plan has not."""
    groups = keys.plan.groups
    rendered: list[str] = []
    for group, hashes, heads in batches:
        if not 0 <= group < len(groups):
            raise ValueError(f"group {group} is not one of the plan's {len(groups)} groups")
        storing = groups[group].heads.storing
        wrong = [head for head in heads if not 0 <= head < storing]
        if wrong:
            raise ValueError(f"heads {wrong} of group {group}: it stores heads 0..{storing - 1}")
        rendered.extend(keys.keys(group, hashes, heads))
    return rendered


def per_block(keys: KeySpace, batches: Sequence[BlockBatch], answers: Sequence[bool]) -> list[bool]:
    """Per hash of `batches`, whether all its keys' `answers` (in `render`'s order) hold."""
    blocks: list[bool] = []
    position = 0
    for _, hashes, heads in batches:
        width = len(heads) * keys.stages
        stop = position + width * len(hashes)
        blocks.extend(all(answers[at : at + width]) for at in range(position, stop, width))
        position = stop
    return blocks


class RenderingQuery:
    """A pool asked by keys, asked by block hashes: renders them here."""

    def __init__(self, keys: KeySpace, query: Query) -> None:
        self._keys = keys
        self.query = query

    def __call__(self, batches: Sequence[BlockBatch]) -> list[bool] | None:
        answers = self.query(render(self._keys, batches))
        return None if answers is None else per_block(self._keys, batches, answers)
