"""How much of a prompt the pool holds: the pool queries of a lookup, and the hit.

The hit is the coordinator's. A lookup of at most `exact_keys` keys (2048 unless a test
sets `_exact_lookup_keys`: below it, the search's round trips cost more than the keys
they save) asks about
every block any hit could need (`lookup_mask`) in ONE batched query and picks the largest
boundary every group can serve (`find_hit`). A longer one runs the coordinator's
`HitSearch`: a few small queries, a probe of one head per block where the search bisects a
full-attention group, every storing head of the blocks the hit depends on; while keys are
quarantined (a load failed), every lookup is exact. Where vLLM's own prefix cache hits
inside blocks, further queries ask whether prompt tails (partial objects, named by the
prefix's hash) extend that aligned hit. Every query goes through `_objects_readable`: the
one place that asks the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any

from hybridkv.coordinator import Asks, Coordinator, Hit, HitSearch, Masks
from hybridkv.integration.block_query import BlockBatch, BlockQuery, per_block, render
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.quarantine import Quarantine
from hybridkv.integration.tracked_requests import TrackedRequest

logger = logging.getLogger(__name__)

# The head a probe asks about (every group stores head 0's objects).
PROBE_HEADS = range(1)

# Tail boundaries a lookup asks about: the largest whose whole blocks are readable (and
# those inside the block after the aligned hit besides).
MAX_TAIL_CANDIDATES = 512


class HitFinder:
    """Looks requests up in the pool; counts lookups, failed ones and quarantined keys."""

    def __init__(
        self,
        keys: KeySpace,
        coordinator: Coordinator,
        query: BlockQuery,
        quarantine: Quarantine,
        tail_unit: int,
        exact_keys: int,
    ) -> None:
        """`query`: per block hash asked, whether its objects are readable (None: no
        answer); it may render their keys where the store is. `quarantine`: keys whose
        objects failed to load, absent while held. `tail_unit`: vLLM's hash unit where its
        prefix cache hits inside blocks (prompt tails are looked up at its multiples); 0:
        whole blocks only. `exact_keys`: lookups asking at most this many keys ask them
        all in one query."""
        self._keys = keys
        self.query = query  # (a test swaps it for a pool that stops answering)
        self.quarantine = quarantine
        self._coordinator = coordinator
        self._plan = keys.plan
        self._tail_unit = tail_unit
        self.exact_keys = exact_keys  # (tests and the lookup benchmark swap it)
        self._smallest_block = min(group.block_size for group in self._plan.groups)
        self.lookups = 0
        self.failed_lookups = 0  # lookups whose query got no answer: counted as misses
        self.quarantined_keys = 0

    def worth_asking(self, request: Any, num_computed: int) -> bool:
        """Whether any hit could reach past vLLM's own `num_computed` tokens. vLLM
        computes at least the last token, but matches EAGLE's dropped block among every
        full block of the request."""
        known = request.num_tokens
        max_tokens = known - 1
        top = self._coordinator.max_boundary(max_tokens, known)
        unit = self._tail_unit
        reach = max_tokens // unit * unit if unit else top
        return max(top, reach) > num_computed

    def find(
        self, request: Any, tracked: TrackedRequest, num_computed: int
    ) -> tuple[Hit, Hit] | None:
        """(the hit, the aligned hit it extends by a prompt tail, or itself); None if the
        pool gave no answer."""
        known = request.num_tokens
        max_tokens = known - 1
        tracked.hashes.cover(request.all_token_ids, known)
        search = self._coordinator.search(max_tokens, known, num_computed, self._tail_unit)
        if len(self.quarantine) or self._keys_asked(search) <= self.exact_keys:
            search.ask_all()
        self.lookups += 1
        while (asks := search.next_asks()) is not None:
            answers = self._ask(tracked, asks)
            if answers is None:
                self.failed_lookups += 1
                return None
            search.answer(*answers)
        aligned = hit = search.hit
        if self._tail_unit:
            readable = search.readable()
            hit = self._extend_by_tail(tracked, hit, readable, max_tokens, num_computed)
        return hit, aligned

    def quarantine_failed(self, keys: Sequence[str]) -> None:
        """Pool objects that failed to load count as absent while quarantined."""
        if not keys:
            return
        logger.warning(
            "hybridkv: %d pool objects failed to load; lookups skip them for %g s",
            len(keys),
            self.quarantine.seconds,
        )
        # A key still held failed again (a read looked up before its first failure was
        # reported): one object, counted once.
        self.quarantined_keys += self.quarantine.add(keys)

    def _keys_asked(self, search: HitSearch) -> int:
        """At most the keys of the exact lookup: every storing head and stage of each
        block."""
        groups = self._plan.groups
        return self._keys.stages * sum(
            blocks * groups[group].heads.storing
            for group, blocks in enumerate(search.most_blocks())
        )

    def _ask(self, tracked: TrackedRequest, asks: Asks) -> tuple[list[bool], list[bool]] | None:
        """One query for a search round: probes ask one head, confirmations every
        storing head (None if the query failed)."""
        groups = self._plan.groups
        batches: list[BlockBatch] = []
        for blocks, probing in ((asks.probes, True), (asks.confirms, False)):
            for group, run in groupby(blocks, key=itemgetter(0)):
                hashes = tracked.hashes.for_group(groups[group].block_size)
                heads = PROBE_HEADS if probing else groups[group].heads.heads
                batches.append((group, [hashes[block] for _, block in run], heads))
        answers = self._objects_readable(batches)
        if answers is None:
            return None
        flat = [ok for column in answers for ok in column]
        return flat[: len(asks.probes)], flat[len(asks.probes) :]

    def _extend_by_tail(
        self, tracked: TrackedRequest, hit: Hit, readable: Masks, max_tokens: int, local: int
    ) -> Hit:
        """The largest prompt tail past `hit` (and vLLM's own `local` hit) whose whole
        blocks are `readable` and whose partial objects every group has.

        Tails lie where stored prompts ended, anywhere below the end of the readable
        blocks. A first query asks one group's partial objects of every candidate, a
        second the other groups' of the candidates the first found.
        """
        unit = self._tail_unit
        alignment = self._coordinator.alignment
        floor = max(hit.tokens, local // alignment * alignment)
        near = min(max_tokens, floor + self._smallest_block - 1)
        windows = ((max_tokens, MAX_TAIL_CANDIDATES), (near, -(-self._smallest_block // unit)))
        candidates = {
            tokens
            for stop, limit in windows
            for tokens in self._coordinator.tail_boundaries(floor, stop, unit, readable, limit)
            if tokens > local
        }
        tails = sorted(candidates, reverse=True)
        token_ids = tracked.request.all_token_ids
        hashes = [tracked.hashes.prefix(token_ids, tokens) for tokens in tails]
        keeping = [self._coordinator.partial_groups(tokens) for tokens in tails]
        probes = [(groups[0], [h]) for groups, h in zip(keeping, hashes, strict=True) if groups]
        answers = self._every_head_readable(probes) if probes else []
        if answers is None:
            return hit
        probed = iter(answers)
        found = [i for i, groups in enumerate(keeping) if not groups or next(probed)[0]]
        rest = [(group, [hashes[i]]) for i in found for group in keeping[i][1:]]
        answers = self._every_head_readable(rest) if rest else []
        if answers is None:
            return hit
        others = iter(answers)
        for i in found:  # largest first
            if all([next(others)[0] for _ in keeping[i][1:]]):  # a list: take every answer
                return self._coordinator.tail_hit(tails[i])
        return hit

    def _every_head_readable(
        self, batches: Sequence[tuple[int, Sequence[bytes]]]
    ) -> list[list[bool]] | None:
        """Per (plan group, block hashes) batch, whether every storing head's objects of
        each hash are readable, learnt in ONE query (None if it failed)."""
        groups = self._plan.groups
        return self._objects_readable(
            [(group, hashes, groups[group].heads.heads) for group, hashes in batches]
        )

    def _objects_readable(self, batches: Sequence[BlockBatch]) -> list[list[bool]] | None:
        """Per (plan group, block hashes, heads) batch, whether each hash's objects of
        those heads (every stage's) are all readable, learnt in ONE query (None if it
        failed). Quarantined keys count as absent (rendered here only while any is)."""
        asked = any(hashes for _, hashes, _ in batches)
        answers = self.query(batches) if asked else []
        if answers is None:
            return None
        if len(self.quarantine):
            held = self.quarantine.holding(render(self._keys, batches))
            free = per_block(self._keys, batches, [not out for out in held])
            answers = [ok and unheld for ok, unheld in zip(answers, free, strict=True)]
        readable: list[list[bool]] = []
        position = 0
        for _, hashes, _ in batches:
            readable.append(answers[position : position + len(hashes)])
            position += len(hashes)
        return readable
