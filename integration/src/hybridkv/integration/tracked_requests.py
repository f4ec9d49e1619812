"""The live requests the scheduler follows, and what it keeps of each across steps.

A request is tracked from its first lookup or allocation until it finishes, a cache reset
forgets it, or a failed background load has vLLM look it up afresh. Its record holds what
the other parts decide with: its hashes, how far its saves got, its taint after a reset,
and the block-table mirror.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.coordinator import Masks
from hybridkv.integration.groups import KVPlan
from hybridkv.integration.keying import RequestHashes

NULL_BLOCK_ID = 0


def has_token_ids(request: Any) -> bool:
    """Whether the request's token ids are its prompt: vLLM fills the positions given as
    prompt embeddings with token 0, so such a prompt's hashes would name other KV."""
    return getattr(request, "prompt_embeds", None) is None


@dataclass
class TrackedRequest:
    """What the scheduler keeps per live request."""

    request: Any
    hashes: RequestHashes
    store_mask: Masks
    # The tokens `store_mask` was made for: boundaries up to there are covered.
    mask_tokens: int
    # Per plan group: blocks below this index are decided (saved, loaded or skipped).
    scanned: list[int]
    # The prompt's length when last seen: a streaming-input session's next chunk grows it.
    prompt_tokens: int
    # Fallback block table when vLLM offers no current tables (append-only mirror).
    block_ids: list[list[int]] = field(default_factory=list)
    # Looked up after a reset: what vLLM's own prefix cache gives it is not saved.
    skip_local_hit: bool = False
    # vLLM's own hit may be KV from before a reset: nothing this request computes is saved.
    tainted: bool = False
    # vLLM's own hit below a pool hit, judged when the request is scheduled (None: none).
    local_tokens: int | None = None
    # Tokens whose prefixes this request has put among the fresh ones (a hash-unit multiple).
    remembered: int = 0
    # (plan group, block index) of state blocks holding another state than their end's (a
    # Mamba checkpoint inside the block, or the state a chunk resumed from mid-block and
    # ran past): never saved, even when a failed load moves `scanned` back below them.
    inner: set[tuple[int, int]] = field(default_factory=set)


def block_table(tracked: TrackedRequest, state: Any) -> Sequence[Sequence[int]]:
    """The request's block ids per vLLM group: vLLM's current tables where it offers them
    (`kv_connector_block_state`), else the mirror kept from the scheduler outputs."""
    current = state.get_block_ids(tracked.request.request_id) if state is not None else None
    return current if current is not None else tracked.block_ids


# A request scheduled in a step: its record, the tokens it had computed before the step,
# those it has once the step ran, and a whole new block table (new or resumed) or None.
Scheduled = tuple[TrackedRequest, int, int, "Sequence[Sequence[int]] | None"]
# The save planner's store mask of a request's first tokens, and how it grows one.
StoreMask = Callable[[int, Any], Masks]
RegrowMask = Callable[[TrackedRequest, int], None]


class TrackedRequests:
    """The records of the live requests, by request id: made on first sight, moved on by
    a streaming session's next chunk, and read off each step's scheduler output."""

    def __init__(
        self,
        plan: KVPlan,
        namespace: str,
        local_unit: int,
        store_mask: StoreMask,
        regrow_mask: RegrowMask,
    ) -> None:
        """`local_unit`: where vLLM's own hits may end (the prefixes remembered fresh end
        there too). `store_mask`, `regrow_mask`: the save planner's."""
        self._plan = plan
        self._namespace = namespace
        self._local_unit = local_unit
        self._store_mask = store_mask
        self._regrow_mask = regrow_mask
        self._by_id: dict[str, TrackedRequest] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def get(self, request_id: str) -> TrackedRequest | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: str) -> TrackedRequest | None:
        return self._by_id.pop(request_id, None)

    def clear(self) -> None:
        self._by_id.clear()

    def track(self, request: Any, generation: int) -> TrackedRequest:
        """The request's record, made under `generation`'s hashes if it has none."""
        tracked = self._by_id.get(request.request_id)
        if tracked is not None and tracked.prompt_tokens != request.num_prompt_tokens:
            self._next_chunk(tracked, request.num_computed_tokens)
            tracked.prompt_tokens = request.num_prompt_tokens
            self._regrow_mask(tracked, max(tracked.mask_tokens, request.num_prompt_tokens))
        if tracked is None:
            tracked = TrackedRequest(
                request=request,
                hashes=RequestHashes(self._plan, self._namespace, request, generation),
                store_mask=self._store_mask(request.num_prompt_tokens, request),
                mask_tokens=request.num_prompt_tokens,
                scanned=[0] * len(self._plan.groups),
                prompt_tokens=request.num_prompt_tokens,
            )
            self._by_id[request.request_id] = tracked
        return tracked

    def _next_chunk(self, tracked: TrackedRequest, computed: int) -> None:
        """A streaming-input session's next chunk: vLLM kept the KV of the first
        `computed` tokens and replaced the tokens past them (it drops the token sampled
        last) with the chunk's. Their hashes, and the saves of the blocks reaching them,
        are decided again as they are computed."""
        tracked.hashes.rewind(computed)
        unit = self._local_unit
        tracked.remembered = min(tracked.remembered, computed // unit * unit)
        for group, plan in enumerate(self._plan.groups):
            tracked.scanned[group] = min(tracked.scanned[group], computed // plan.block_size)

    def scheduled(self, output: Any) -> list[Scheduled]:
        """The tracked requests `output` schedules, in vLLM's order, with the spans they
        compute; the mirrors of those that keep their tables grow by the new blocks.

        vLLM caches the blocks a step computes when it schedules them, so a request
        admitted in this step may hit what one scheduled before it computes in it: the
        order lets the caller judge and remember them as vLLM does (a resumed request
        may come before or after a new one)."""
        scheduled: list[Scheduled] = []
        for new in output.scheduled_new_reqs:
            tracked = self._by_id.get(new.req_id)
            if tracked is not None:
                start = new.num_computed_tokens
                done = start + output.num_scheduled_tokens[new.req_id]
                scheduled.append((tracked, start, done, new.block_ids))
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            tracked = self._by_id.get(request_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[index]
            start = cached.num_computed_tokens[index]
            done = start + output.num_scheduled_tokens[request_id]
            if request_id in cached.resumed_req_ids and new_ids is not None:
                # Preempted and resumed: a whole new block table, maybe a new hit to load.
                scheduled.append((tracked, start, done, new_ids))
                continue
            if new_ids is not None:
                for table, ids in zip(tracked.block_ids, new_ids, strict=True):
                    table.extend(ids)
            scheduled.append((tracked, start, done, None))
        order = {request_id: at for at, request_id in enumerate(output.num_scheduled_tokens)}
        scheduled.sort(key=lambda entry: order[entry[0].request.request_id])
        return scheduled
