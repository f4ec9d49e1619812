"""From a lookup's hit to the per-block loads, once vLLM has placed the blocks.

A hit found at lookup waits here until vLLM allocates it (maybe cut shorter), then turns
into the block loads of the next step's metadata. Background loads that keep failing
stop being offered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.coordinator import Coordinator, Hit
from hybridkv.integration.groups import KVPlan
from hybridkv.integration.metadata import BlockRef, RequestTransfers
from hybridkv.integration.tracked_requests import NULL_BLOCK_ID, TrackedRequest

logger = logging.getLogger(__name__)

# Background loads a request may fail before the pool is no longer asked for it: vLLM
# looks a request up again after one, and a failure no object is blamed for (the client
# or the link failed) quarantines nothing, so the same hit would fail for ever.
MAX_FAILED_BACKGROUND_LOADS = 2


@dataclass(frozen=True)
class PendingLoad:
    local_tokens: int
    hit: Hit
    tail_tokens: int = 0  # of the hit, those past the aligned hit (a prompt tail)
    topology: int = 0  # whose objects the hit is (see `RequestTransfers.topology`)


class LoadPlanner:
    """The hits awaiting allocation, the loads ready for the next step, and how often
    each request's background loads failed; counts the tokens hit."""

    def __init__(self, plan: KVPlan, coordinator: Coordinator, load_async: bool) -> None:
        """`load_async`: the loads run in the background (vLLM's async KV loading)."""
        self._plan = plan
        self._coordinator = coordinator
        self.load_async = load_async
        self._pending: dict[str, PendingLoad] = {}
        self._ready: dict[str, RequestTransfers] = {}
        # Requests whose background loads failed, and how often (until they finish).
        self._failed: dict[str, int] = {}
        self.hit_tokens = 0
        self.hit_requests = 0
        self.tail_hit_tokens = 0

    def gave_up(self, request_id: str) -> bool:
        """Whether the request's background loads failed too often: vLLM computes it."""
        return self._failed.get(request_id, 0) >= MAX_FAILED_BACKGROUND_LOADS

    def expect(self, request_id: str, pending: PendingLoad) -> None:
        self._pending[request_id] = pending

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def load_failed(self, request_id: str) -> None:
        self._failed[request_id] = self._failed.get(request_id, 0) + 1

    def take_ready(self) -> dict[str, RequestTransfers]:
        """This step's loads, by request (each handed out once)."""
        ready, self._ready = self._ready, {}
        return ready

    def reset(self) -> None:
        self._pending.clear()
        self._ready.clear()

    def forget(self, request_id: str) -> None:
        self._failed.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._ready.pop(request_id, None)

    def allocated(
        self,
        request: Any,
        tracked: TrackedRequest,
        block_ids: Sequence[list[int]],
        external: int,
    ) -> None:
        """Turn the pending hit into per-block loads once vLLM has placed the blocks."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None or external == 0:
            return
        allocated = self._allocated_hit(request.request_id, pending, external)
        if tracked.skip_local_hit:  # judged once scheduled, with the step's other requests
            tracked.local_tokens = pending.local_tokens
        loads: list[BlockRef] = []
        hit = allocated.tokens
        tail_hash = b""  # the prefix's own hash, for the partial blocks of a prompt tail
        for group, plan in enumerate(self._plan.groups):
            size = plan.block_size
            hashes = tracked.hashes.for_group(size)
            ids = block_ids[plan.vllm_group_id]
            for block, needed in enumerate(allocated.load_masks[group]):
                if not needed or (block + 1) * size <= pending.local_tokens:
                    continue  # vLLM's own prefix cache already holds it
                # (a block vLLM's own hit ends inside is loaded: past that hit its copy
                # holds another prompt's KV, which vLLM would take for this one's)
                if ids[block] == NULL_BLOCK_ID:
                    raise RuntimeError(
                        f"request {request.request_id}: vLLM gave the null block to "
                        f"group {plan.vllm_group_id} block {block}, which the hit needs"
                    )
                if (block + 1) * size <= hit:
                    loads.append(BlockRef(group, block, ids[block], hashes[block]))
                else:
                    tail_hash = tail_hash or tracked.hashes.prefix(request.all_token_ids, hit)
                    loads.append(BlockRef(group, block, ids[block], tail_hash, tail=hit))
            tracked.scanned[group] = max(tracked.scanned[group], hit // size)
        self.hit_tokens += external
        self.hit_requests += 1
        self.tail_hit_tokens += pending.tail_tokens if allocated is pending.hit else 0
        self._ready[request.request_id] = RequestTransfers(
            request_id=request.request_id,
            loads=loads,
            load_async=self.load_async,
            topology=pending.topology,
        )

    def _allocated_hit(self, request_id: str, pending: PendingLoad, external: int) -> Hit:
        """The hit vLLM allocated: the one looked up, or one it cut shorter.

        vLLM cuts a hit when DeepSeek-V4.1's sliding-window groups replay it (bounded
        replay, groups this connector does not store): to a multiple of its scheduler
        block size, the lcm over every group, stored or not. The shorter boundary's needs
        were asked about but not required (a window or a state there): one the pool lacks
        fails its load, and vLLM recomputes the request rather than read KV that is not
        there. vLLM 0.32 cuts to no other count: the refusal below guards its contract.
        """
        tokens = pending.local_tokens + external
        if tokens == pending.hit.tokens:
            return pending.hit
        alignment = self._coordinator.alignment
        if tokens > pending.hit.tokens or tokens % alignment:
            raise RuntimeError(
                f"request {request_id}: vLLM allocated {external} external tokens after "
                f"{pending.local_tokens} local ones, but the hit was {pending.hit.tokens} "
                f"tokens and no shorter hit can end at {tokens} (not a multiple of "
                f"{alignment})"
            )
        logger.debug(
            "request %s: vLLM took %d of the %d tokens hit; loading what %d tokens need",
            request_id,
            tokens,
            pending.hit.tokens,
            tokens,
        )
        return Hit(tokens, self._coordinator.load_mask(tokens))
