"""The local blocks holding KV computed over a failed synchronous load: never saved.

vLLM reports a failed load before the forward by block id (for a model of one KV cache
group only, whose loads may run before the forward). It rolls back only the first request
holding such a block; others sharing it through vLLM's prefix cache wait for that one's
recompute, or (admitted before the failure was known, under async scheduling) keep what
they computed over it. So the blocks are followed by id, through every block written over
one, until a step rewrites them whole over right KV.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence

from hybridkv.integration.metadata import RequestTransfers
from hybridkv.integration.tracked_requests import NULL_BLOCK_ID

# A request's block table in a step (in the one vLLM group of a model with one), the
# tokens it had computed before the step, and those it has once the step ran.
Span = tuple[Sequence[int], int, int]


class PoisonedBlocks:
    """Block id -> how many of its first tokens were rewritten since over right KV, and
    the spans each step not yet reported on computed over."""

    def __init__(self, block_size: int, steps_ahead: int) -> None:
        """`steps_ahead`: how many steps vLLM schedules before it reports a step's
        outcome (async scheduling, pipeline stages)."""
        self._size = block_size
        self._poisoned: dict[int, int] = {}
        # What each step not yet reported on computed over (its spans in that group): a
        # failed load is reported after `steps_ahead` more steps were scheduled, maybe
        # once a request that computed over it has finished (and is forgotten) or was
        # preempted (its mirror then names blocks that other requests own).
        self._computed: deque[list[Span]] = deque(maxlen=steps_ahead + 1)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._poisoned

    def failed(self, invalid: Collection[int]) -> None:
        """vLLM's block ids whose read failed before the forward: they, and every block
        after one in a table of a step not yet reported on, are poisoned."""
        size = self._size
        for spans in self._computed:
            for ids, _, done in spans:
                end = -(-done // size)
                at = next((i for i in range(end) if ids[i] in invalid), None)
                if at is not None:
                    self._poisoned.update((b, 0) for b in ids[at:end] if b != NULL_BLOCK_ID)
        self._poisoned.update((b, 0) for b in invalid)

    def follow(self, spans: Sequence[Span], step: Mapping[str, RequestTransfers]) -> None:
        """Keep what this step computes over until its outcome is reported (ids below a
        step's end never change in a table: vLLM builds a new one on each request, the
        mirror only grows), and follow the poisoned blocks through what it writes."""
        size = self._size
        computed = [(ids, start, min(done, len(ids) * size)) for ids, start, done in spans]
        self._computed.append(computed)
        if self._poisoned:
            self._heal(self._meeting_poison(computed), step)

    def _meeting_poison(self, spans: Sequence[Span]) -> list[Span]:
        """The spans that may meet a poisoned block in this step: those holding one, and
        those holding a block that one of those writes (it may turn poisoned now). The
        others leave the poisoned blocks as they are."""
        size = self._size
        reach = set(self._poisoned)
        meeting = [False] * len(spans)
        grew = True
        while grew:
            grew = False
            for at, (ids, start, done) in enumerate(spans):
                end = -(-done // size)
                if not meeting[at] and not reach.isdisjoint(ids[:end]):
                    meeting[at] = grew = True
                    reach.update(ids[start // size : end])
        return [span for span, meets in zip(spans, meeting, strict=True) if meets]

    def _heal(self, spans: Sequence[Span], step: Mapping[str, RequestTransfers]) -> None:
        """Follow the poisoned blocks through the blocks this step writes. A block written
        whole over right KV (every block below it in the writer's table right once this
        step's writes land, which precede any attention over them) is right again; one
        written over poisoned KV is poisoned. A block loaded whole is right (a failed load
        is reported again)."""
        size = self._size
        for transfers in step.values():
            for ref in transfers.loads:
                if not ref.tail:
                    self._poisoned.pop(ref.block_id, None)
        clean_below = [True] * len(spans)  # per span: its blocks below `index` are right
        top = max((-(-done // size) for _, _, done in spans), default=0)
        for index in range(top):  # lower blocks first: each depends on those below it
            for at, (ids, start, done) in enumerate(spans):
                if not start // size <= index < -(-done // size) or ids[index] == NULL_BLOCK_ID:
                    continue
                block_id = ids[index]
                offset = max(start - index * size, 0)  # its tokens written before the step
                valid = self._poisoned.get(block_id, size)  # its first tokens still right
                written = min(done - index * size, size)
                if clean_below[at] and valid >= offset:
                    if written >= size:
                        self._poisoned.pop(block_id, None)
                    elif block_id in self._poisoned:
                        self._poisoned[block_id] = written
                else:
                    self._poisoned[block_id] = min(valid, offset)
            for at, (ids, _, _) in enumerate(spans):
                if index < len(ids) and ids[index] in self._poisoned:
                    clean_below[at] = False
