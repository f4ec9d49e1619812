"""What a cache reset taints: KV from before it is never saved under the new generation.

A reset moves every hash (and so every key) to a new generation. vLLM may still hold KV
from before it: in requests that keep running or finish a background load, and in its
own prefix cache (kept when its own reset is refused for running requests). Such KV, and
anything computed over it, would reach other instances under the new keys. This part
knows which requests are stale, which prefixes were computed since (fresh), and judges
each request's own local hit by that.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.integration.fresh_prefixes import FreshPrefixes
from hybridkv.integration.groups import KVPlan
from hybridkv.integration.tracked_requests import TrackedRequest


class ResetTaint:
    """The cache generation, the requests holding KV from before the last reset, and the
    prefixes known computed since."""

    def __init__(self, plan: KVPlan, local_unit: int) -> None:
        """`local_unit`: where vLLM's own prefix-cache hits may end (a hit ending
        elsewhere is never known fresh)."""
        self._plan = plan
        self._local_unit = local_unit
        self.generation = 0
        # Requests that hold KV from before a reset (running, or loading in the background)
        # until vLLM looks them up afresh: never saved under the new generation's keys.
        self._stale: set[str] = set()
        self._fresh = FreshPrefixes()

    def reset(self, live: Iterable[str]) -> None:
        """A new generation; the `live` requests keep KV from before it until looked up."""
        self.generation += 1
        self._stale.update(live)
        self._fresh.clear()

    def looked_up(self, request_id: str) -> None:
        """vLLM computes the request afresh: what it holds from now on is judged anew."""
        self._stale.discard(request_id)

    def is_stale(self, request_id: str) -> bool:
        return request_id in self._stale

    def forget(self, request_id: str) -> None:
        self._stale.discard(request_id)

    def load_failed(self, request_id: str, dropped: TrackedRequest) -> None:
        """A background load failed and its request is forgotten: a local hit waiting to
        be judged is judged now (the request was never scheduled). A tainted request goes
        on from the tokens that did load, without a lookup: still over KV from before the
        reset."""
        if dropped.local_tokens is not None:
            self.judge_local_hit(dropped, dropped.local_tokens)
        if dropped.tainted:
            self._stale.add(request_id)

    def skip_local_hit(self, tracked: TrackedRequest, computed: int) -> None:
        """After a reset, the blocks of vLLM's own prefix-cache hit may hold KV from before
        it (vLLM keeps its prefix cache when its own reset is refused for running
        requests): they are never saved under the new generation's keys, nor is a block
        it ends in, nor, unless the hit is a prefix known fresh, anything the request
        computes over it. (Before any reset they are, which refills a pool that dropped
        them.)
        `computed`: the tokens vLLM admitted the request with, its final local hit (which
        it may have cut after the lookup) and the pool's. Once per lookup."""
        if not tracked.skip_local_hit:
            return
        tracked.skip_local_hit = False
        deferred, tracked.local_tokens = tracked.local_tokens, None
        self.judge_local_hit(tracked, computed if deferred is None else deferred)
        if tracked.tainted or deferred is not None:
            # Tainted: nothing is saved, the next lookup (if any) decides afresh. Under a
            # pool hit: the hit's loads already moved `scanned` past vLLM's own blocks.
            return
        for group, plan in enumerate(self._plan.groups):
            reached = -(-computed // plan.block_size)
            tracked.scanned[group] = max(tracked.scanned[group], reached)

    def judge_local_hit(self, tracked: TrackedRequest, local: int) -> None:
        """Taint the request unless vLLM's own hit of `local` tokens is KV computed since
        the last reset (none is; one ending where vLLM's hits cannot is never known to
        be). A fresh hit's prefixes were remembered by whoever computed them."""
        fresh = local == 0 or (
            local % self._local_unit == 0
            and self._fresh.holds(tracked.hashes.prefix(tracked.request.all_token_ids, local))
        )
        tracked.tainted = not fresh
        if fresh:
            tracked.remembered = max(tracked.remembered, local)

    def remember_fresh(self, tracked: TrackedRequest, done: int) -> None:
        """The prefixes a request not tainted holds once this step is done are fresh: its
        local hit was, and it loads from the new generation and computes the rest. Not
        those of a request that skips vLLM's prefix cache (prompt logprobs): vLLM may
        still hold an older block of the same prefix, and it serves the older first."""
        if getattr(tracked.request, "skip_reading_prefix_cache", False):
            return
        token_ids = tracked.request.all_token_ids
        unit = self._local_unit
        reach = min(done, len(token_ids)) // unit * unit
        for tokens in range(tracked.remembered + unit, reach + 1, unit):
            self._fresh.add(tracked.hashes.prefix(token_ids, tokens))
        tracked.remembered = max(tracked.remembered, reach)
