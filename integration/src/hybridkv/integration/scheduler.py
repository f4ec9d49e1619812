"""Scheduler-side decisions: how much of a prompt the pool holds, what to load and save.

Sans-I/O except for the lookup queries, made through a callable. The hit is the
coordinator's: it asks which blocks any hit could need (`lookup_mask`), learns their
readability in ONE batched query, and picks the largest boundary every group can serve
(`find_hit`). Saves follow the coordinator's `store_mask`, one complete block at a time, in
the step that completes it (a Mamba block holds the state at its end only then).

Prompt tails: where vLLM's own prefix cache hits inside blocks (a Mamba "align" model with
a `prefix_match_unit` finer than its blocks), vLLM ends a prompt's chunk at its last
multiple of that unit, or (Mamba2, KDA) has the prompt's last chunk write the state there
into a checkpoint block. The step that leaves such a prefix stores each group's block
holding it as a partial object, named by the prefix's hash; a lookup then asks, in
further queries, whether such objects extend its aligned hit.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.coordinator import FullAttention, Hit, Masks, RecurrentState
from hybridkv.integration.checkpoints import Checkpoint, PrefillCheckpoints
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.fresh_prefixes import FreshPrefixes
from hybridkv.integration.keying import KeySpace, RequestHashes
from hybridkv.integration.kv_events import EventBuilder
from hybridkv.integration.metadata import BlockRef, HybridKVMetadata, RequestTransfers
from hybridkv.integration.quarantine import Quarantine

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
# Tail boundaries a lookup asks about: the largest whose whole blocks are readable (and
# those inside the block after the aligned hit besides).
MAX_TAIL_CANDIDATES = 512
# Background loads a request may fail before the pool is no longer asked for it: vLLM
# looks a request up again after one, and a failure no object is blamed for (the client
# or the link failed) quarantines nothing, so the same hit would fail for ever.
MAX_FAILED_BACKGROUND_LOADS = 2

Query = Callable[[Sequence[str]], "list[bool] | None"]
# A request's block table in a step (in the one vLLM group of a model with one), the
# tokens it had computed before the step, and those it has once the step ran.
_Span = tuple[Sequence[int], int, int]


def _has_token_ids(request: Any) -> bool:
    """Whether the request's token ids are its prompt: vLLM fills the positions given as
    prompt embeddings with token 0, so such a prompt's hashes would name other KV."""
    return getattr(request, "prompt_embeds", None) is None


@dataclass
class _Tracked:
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


def _block_table(tracked: _Tracked, state: Any) -> Sequence[Sequence[int]]:
    """The request's block ids per vLLM group: vLLM's current tables where it offers them
    (`kv_connector_block_state`), else the mirror kept from the scheduler outputs."""
    current = state.get_block_ids(tracked.request.request_id) if state is not None else None
    return current if current is not None else tracked.block_ids


@dataclass(frozen=True)
class _PendingLoad:
    local_tokens: int
    hit: Hit
    tail_tokens: int = 0  # of the hit, those past the aligned hit (a prompt tail)


class SchedulerSide:
    """The scheduler role of the connector."""

    def __init__(
        self,
        keys: KeySpace,
        config: ConnectorConfig,
        query: Query,
        kv_role: str | None = None,
        events: EventBuilder | None = None,
        tail_unit: int = 0,
        load_async_required: bool = False,
        clock: Callable[[], float] = time.monotonic,
        checkpoints: PrefillCheckpoints | None = None,
        use_eagle: bool = False,
        local_hit_unit: int = 0,
        steps_ahead: int = 0,
    ) -> None:
        """`tail_unit`: vLLM's hash unit where its prefix cache hits inside blocks (prompt
        tails are stored and looked up at its multiples); 0: whole blocks only.
        `load_async_required`: load in the background even if `load_async` is off (vLLM
        recovers from a failed load of a hybrid model only while the request waits).
        `clock`: the time that quarantined keys are released by. `checkpoints`: the Mamba
        groups whose prefill chunks leave a block holding an inner state (saved only as a
        prompt tail). `use_eagle`: vLLM drops the last block of its own hits (see
        `drops_eagle_block`); hits from the pool, and the states saved for them, follow.
        `local_hit_unit`: vLLM's hash block size, which its own prefix-cache hits end on a
        multiple of (0: the plan's hash unit). `steps_ahead`: how many steps vLLM schedules
        before it reports a step's outcome (async scheduling, pipeline stages)."""
        self._checkpoints = checkpoints
        self.keys = keys
        self._events = events
        self.plan = keys.plan
        self.config = config
        self._loads = config.loads_for(kv_role)
        self._saves = config.saves_for(kv_role)
        self.coordinator = self.plan.coordinator(use_eagle)
        self._tail_unit = tail_unit if config.prompt_tails else 0
        # Where vLLM's own hits may end: the prefixes remembered fresh end there too.
        self._local_unit = math.gcd(self.plan.hash_block_size, local_hit_unit)
        self._smallest_block = min(group.block_size for group in self.plan.groups)
        self._state_groups = {
            index
            for index, group in enumerate(self.plan.groups)
            if isinstance(group.kind, RecurrentState)
        }
        self._load_async = config.load_async or load_async_required
        self._query = query
        self._tracked: dict[str, _Tracked] = {}
        self._pending: dict[str, _PendingLoad] = {}
        self._ready: dict[str, RequestTransfers] = {}
        # Requests that hold KV from before a reset (running, or loading in the background)
        # until vLLM looks them up afresh: never saved under the new generation's keys.
        self._stale: set[str] = set()
        # Requests whose background loads failed, and how often (until they finish).
        self._failed_loads: dict[str, int] = {}
        self._fresh = FreshPrefixes()
        # Local block ids holding KV computed over a failed synchronous load (vLLM reports
        # those by id for a model of one KV cache group only): block id -> how many of its
        # first tokens were rewritten since over right KV. Never saved, by any request that
        # holds them (vLLM keeps them in its prefix cache, and rolls a request sharing one
        # back only to what it had computed), until a step rewrites them whole.
        self._poisoned: dict[int, int] = {}
        # What each step not yet reported on computed over (its spans in that group): a
        # failed load is reported after `steps_ahead` more steps were scheduled, maybe
        # once a request that computed over it has finished (and is forgotten) or was
        # preempted (its mirror then names blocks that other requests own).
        self._computed: deque[list[_Span]] = deque(maxlen=steps_ahead + 1)
        self.quarantine = Quarantine(config.failed_load_quarantine_s, clock)
        self.hit_tokens = 0
        self.tail_hit_tokens = 0
        self.lookups = 0
        self.failed_lookups = 0  # lookups whose query got no answer: counted as misses
        self.quarantined_keys = 0
        self.generation = 0

    def reset(self) -> None:
        """Nothing stored before this call is looked up again: hashes (and so keys) move
        to a new generation. A request vLLM looks up again (a reset that preempts the
        running ones) is tracked afresh; one that keeps the KV it had (still running, or
        finishing a background load) is not saved again."""
        self.generation += 1
        self._stale.update(self._tracked)
        self._fresh.clear()
        self._tracked.clear()
        self._pending.clear()
        self._ready.clear()

    # -- lookup -----------------------------------------------------------------------

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None and tracked.prompt_tokens != request.num_prompt_tokens:
            self._next_chunk(tracked, request.num_computed_tokens)
            tracked.prompt_tokens = request.num_prompt_tokens
            self._regrow_mask(tracked, max(tracked.mask_tokens, request.num_prompt_tokens))
        if tracked is None:
            tracked = _Tracked(
                request=request,
                hashes=RequestHashes(self.plan, self.config.namespace, request, self.generation),
                store_mask=self._store_mask(request.num_prompt_tokens, request),
                mask_tokens=request.num_prompt_tokens,
                scanned=[0] * len(self.plan.groups),
                prompt_tokens=request.num_prompt_tokens,
            )
            self._tracked[request.request_id] = tracked
        return tracked

    def _store_mask(self, tokens: int, request: Any) -> Masks:
        """What to save of a request's first `tokens` tokens, with the whole blocks its
        prompt's tails need. With `save_decode_cache` the request goes on and stores
        EAGLE's dropped block past them too, so a later one can hit at `tokens` itself:
        its state there is worth keeping."""
        reach = self.coordinator.eagle_tokens if self.config.save_decode_cache else 0
        return self.coordinator.store_mask(
            tokens + reach, self._tail_unit, request.num_prompt_tokens
        )

    def _regrow_mask(self, tracked: _Tracked, tokens: int) -> None:
        """Make the store mask one for `tokens` tokens (a longer prompt, or generated
        tokens past it). Full-attention blocks passed over because no boundary the old
        mask covered needed them, and that a boundary of the new one does, are scanned
        again (vLLM keeps them while the request runs; windows and states passed over may
        be gone)."""
        old = tracked.store_mask
        tracked.store_mask = self._store_mask(tokens, tracked.request)
        tracked.mask_tokens = tokens
        for group, plan in enumerate(self.plan.groups):
            if not isinstance(plan.kind, FullAttention):
                continue
            before, after = old[group], tracked.store_mask[group]
            for block in range(min(tracked.scanned[group], len(after))):
                if after[block] and not (block < len(before) and before[block]):
                    tracked.scanned[group] = block
                    break

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """(tokens to load beyond `num_computed`, load asynchronously?)."""
        self._stale.discard(request.request_id)  # vLLM computes it afresh
        if self.generation and _has_token_ids(request):
            self._track(request).skip_local_hit = True
        if not self._loads or not _has_token_ids(request):
            return 0, False  # a consumer told not to load, or no token ids to hash
        if self._failed_loads.get(request.request_id, 0) >= MAX_FAILED_BACKGROUND_LOADS:
            return 0, False  # vLLM computes it
        # vLLM computes at least the last token, but matches EAGLE's dropped block among
        # every full block of the request.
        known = request.num_tokens
        max_tokens = known - 1
        top = self.coordinator.max_boundary(max_tokens, known)
        reach = max_tokens // self._tail_unit * self._tail_unit if self._tail_unit else top
        if max(top, reach) <= num_computed:
            return 0, False
        tracked = self._track(request)
        tracked.hashes.cover(request.all_token_ids, known)
        mask = self.coordinator.lookup_mask(max_tokens, known, self._tail_unit)
        readable = self._readable(tracked, mask, num_computed)
        if readable is None:
            return 0, False
        aligned = hit = self.coordinator.find_hit(max_tokens, readable, known)
        if self._tail_unit:
            hit = self._extend_by_tail(tracked, hit, readable, max_tokens, num_computed)
        if hit.tokens <= num_computed:
            self._pending.pop(request.request_id, None)
            return 0, False
        tail_tokens = hit.tokens - max(aligned.tokens, num_computed)
        self._pending[request.request_id] = _PendingLoad(num_computed, hit, tail_tokens)
        return hit.tokens - num_computed, self._load_async

    def _skip_local_hit(self, tracked: _Tracked, computed: int) -> None:
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
        self._judge_local_hit(tracked, computed if deferred is None else deferred)
        if tracked.tainted or deferred is not None:
            # Tainted: nothing is saved, the next lookup (if any) decides afresh. Under a
            # pool hit: the hit's loads already moved `scanned` past vLLM's own blocks.
            return
        for group, plan in enumerate(self.plan.groups):
            reached = -(-computed // plan.block_size)
            tracked.scanned[group] = max(tracked.scanned[group], reached)

    def _judge_local_hit(self, tracked: _Tracked, local: int) -> None:
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

    def _remember_fresh(self, tracked: _Tracked, done: int) -> None:
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

    def _readable(self, tracked: _Tracked, mask: Masks, local: int) -> Masks | None:
        """Readability of the masked blocks; blocks vLLM already holds count as readable."""
        asked: list[list[int]] = []
        batches: list[tuple[int, list[bytes]]] = []
        for group, (plan, marks) in enumerate(zip(self.plan.groups, mask, strict=True)):
            size = plan.block_size
            hashes = tracked.hashes.for_group(size)
            blocks = [b for b, marked in enumerate(marks) if marked and (b + 1) * size > local]
            asked.append(blocks)
            batches.append((group, [hashes[b] for b in blocks]))
        self.lookups += 1
        answers = self._every_head_readable(batches)
        if answers is None:
            self.failed_lookups += 1
            return None
        readable = [
            [(b + 1) * plan.block_size <= local for b in range(len(mask[g]))]
            for g, plan in enumerate(self.plan.groups)
        ]
        for group, (blocks, column) in enumerate(zip(asked, answers, strict=True)):
            for block, ok in zip(blocks, column, strict=True):
                readable[group][block] = ok
        return tuple(tuple(column) for column in readable)

    def _extend_by_tail(
        self, tracked: _Tracked, hit: Hit, readable: Masks, max_tokens: int, local: int
    ) -> Hit:
        """The largest prompt tail past `hit` (and vLLM's own `local` hit) whose whole
        blocks are `readable` and whose partial objects every group has.

        Tails lie where stored prompts ended, anywhere below the end of the readable
        blocks. A first query asks one group's partial objects of every candidate, a
        second the other groups' of the candidates the first found.
        """
        unit = self._tail_unit
        alignment = self.coordinator.alignment
        floor = max(hit.tokens, local // alignment * alignment)
        near = min(max_tokens, floor + self._smallest_block - 1)
        windows = ((max_tokens, MAX_TAIL_CANDIDATES), (near, -(-self._smallest_block // unit)))
        candidates = {
            tokens
            for stop, limit in windows
            for tokens in self.coordinator.tail_boundaries(floor, stop, unit, readable, limit)
            if tokens > local
        }
        tails = sorted(candidates, reverse=True)
        token_ids = tracked.request.all_token_ids
        hashes = [tracked.hashes.prefix(token_ids, tokens) for tokens in tails]
        keeping = [self.coordinator.partial_groups(tokens) for tokens in tails]
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
                return self.coordinator.tail_hit(tails[i])
        return hit

    def _every_head_readable(
        self, batches: Sequence[tuple[int, Sequence[bytes]]]
    ) -> list[list[bool]] | None:
        """Per (plan group, block hashes) batch, whether each hash's objects are readable,
        learnt in ONE query (None if it failed): usable only if EVERY storing head's is."""
        keys: list[str] = []
        for group, hashes in batches:
            keys.extend(self.keys.keys(group, hashes, self.plan.groups[group].heads.heads))
        answers = self._query(keys) if keys else []
        if answers is None:
            return None
        held = self.quarantine.holding(keys)
        answers = [ok and not out for ok, out in zip(answers, held, strict=True)]
        readable: list[list[bool]] = []
        position = 0
        for group, hashes in batches:
            heads = self.plan.groups[group].heads.storing * self.keys.stages
            stop = position + heads * len(hashes)
            readable.append([all(answers[at : at + heads]) for at in range(position, stop, heads)])
            position = stop
        return readable

    # -- allocation -------------------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: Sequence[list[int]], external: int) -> None:
        """Turn the pending hit into per-block loads once vLLM has placed the blocks."""
        if not _has_token_ids(request) or request.request_id in self._stale:
            return  # never saved: placeholder token ids, or KV from before a reset
        tracked = self._track(request)
        pending = self._pending.pop(request.request_id, None)
        if pending is None or external == 0:
            return
        allocated = self._allocated_hit(request.request_id, pending, external)
        if tracked.skip_local_hit:  # judged once scheduled, with the step's other requests
            tracked.local_tokens = pending.local_tokens
        loads: list[BlockRef] = []
        hit = allocated.tokens
        tail_hash = b""  # the prefix's own hash, for the partial blocks of a prompt tail
        for group, plan in enumerate(self.plan.groups):
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
        self.tail_hit_tokens += pending.tail_tokens if allocated is pending.hit else 0
        self._ready[request.request_id] = RequestTransfers(
            request_id=request.request_id, loads=loads, load_async=self._load_async
        )

    def _next_chunk(self, tracked: _Tracked, computed: int) -> None:
        """A streaming-input session's next chunk: vLLM kept the KV of the first
        `computed` tokens and replaced the tokens past them (it drops the token sampled
        last) with the chunk's. Their hashes, and the saves of the blocks reaching them,
        are decided again as they are computed."""
        tracked.hashes.rewind(computed)
        unit = self._local_unit
        tracked.remembered = min(tracked.remembered, computed // unit * unit)
        for group, plan in enumerate(self.plan.groups):
            tracked.scanned[group] = min(tracked.scanned[group], computed // plan.block_size)

    def _allocated_hit(self, request_id: str, pending: _PendingLoad, external: int) -> Hit:
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
        if tokens > pending.hit.tokens or tokens % self.coordinator.alignment:
            raise RuntimeError(
                f"request {request_id}: vLLM allocated {external} external tokens after "
                f"{pending.local_tokens} local ones, but the hit was {pending.hit.tokens} "
                f"tokens and no shorter hit can end at {tokens} (not a multiple of "
                f"{self.coordinator.alignment})"
            )
        logger.debug(
            "request %s: vLLM took %d of the %d tokens hit; loading what %d tokens need",
            request_id,
            tokens,
            pending.hit.tokens,
            tokens,
        )
        return Hit(tokens, self.coordinator.load_mask(tokens))

    # -- per step ---------------------------------------------------------------------

    def build_meta(self, output: Any) -> HybridKVMetadata:
        """This step's loads (decided at allocation) and saves (blocks it completes).

        (`output.finished_req_ids` are forgotten already, at `request_finished`; an id
        vLLM reuses for a new request in this very step names that request.)"""
        step: dict[str, RequestTransfers] = dict(self._ready)
        self._ready.clear()
        state = getattr(output, "kv_connector_block_state", None)
        # (tracked, start, done, a whole new block table or None)
        scheduled: list[tuple[_Tracked, int, int, Sequence[Sequence[int]] | None]] = []
        for new in output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                start = new.num_computed_tokens
                done = start + output.num_scheduled_tokens[new.req_id]
                scheduled.append((tracked, start, done, new.block_ids))
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(request_id)
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
        # vLLM caches the blocks a step computes when it schedules them, so a request
        # admitted in this step may hit what one scheduled before it computes in it: fresh
        # as well. Judged and remembered in vLLM's order (a resumed request may come before
        # or after a new one).
        order = {request_id: at for at, request_id in enumerate(output.num_scheduled_tokens)}
        scheduled.sort(key=lambda entry: order[entry[0].request.request_id])
        for tracked, start, done, restarted in scheduled:
            if restarted is not None:
                self._skip_local_hit(tracked, start)
                tracked.block_ids = [list(ids) for ids in restarted]  # new, or resumed
            if self.generation and self._saves and not (tracked.skip_local_hit or tracked.tainted):
                self._remember_fresh(tracked, done)
        hold = False
        if self._saves:  # (each request's table resolved once: vLLM builds it on request)
            tables = [_block_table(tracked, state) for tracked, _, _, _ in scheduled]
            if self._loads and len(self.plan.groups) == 1:  # (hybrid ones load in the background)
                self._follow_failed_loads(scheduled, tables, step)
            for (tracked, start, done, _), current in zip(scheduled, tables, strict=True):
                hold |= self._plan_saves(tracked, start, done, current, step)
        idle = output.total_num_scheduled_tokens == 0
        finished = frozenset(output.finished_req_ids)
        return HybridKVMetadata(list(step.values()), self.generation, idle, hold, finished)

    def _follow_failed_loads(
        self,
        scheduled: Sequence[tuple[_Tracked, int, int, Any]],
        tables: Sequence[Sequence[Sequence[int]]],
        step: Mapping[str, RequestTransfers],
    ) -> None:
        """Keep what this step computes over until its outcome is reported (ids below a
        step's end never change in a table: vLLM builds a new one on each request, the
        mirror only grows), and follow the poisoned blocks through what it writes."""
        plan = self.plan.groups[0]
        size, group = plan.block_size, plan.vllm_group_id
        spans = []
        for (_, start, done, _), table in zip(scheduled, tables, strict=True):
            ids = table[group]
            spans.append((ids, start, min(done, len(ids) * size)))
        self._computed.append(spans)
        if self._poisoned:
            self._heal(self._meeting_poison(spans), step)

    def _meeting_poison(self, spans: Sequence[_Span]) -> list[_Span]:
        """The spans that may meet a poisoned block in this step: those holding one, and
        those holding a block that one of those writes (it may turn poisoned now). The
        others leave the poisoned blocks as they are."""
        size = self.plan.groups[0].block_size
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

    def _heal(self, spans: Sequence[_Span], step: Mapping[str, RequestTransfers]) -> None:
        """Follow the poisoned blocks through the blocks this step writes. A block written
        whole over right KV (every block below it in the writer's table right once this
        step's writes land, which precede any attention over them) is right again; one
        written over poisoned KV is poisoned. A block loaded whole is right (a failed load
        is reported again)."""
        size = self.plan.groups[0].block_size
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

    def _plan_saves(
        self,
        tracked: _Tracked,
        start: int,
        done: int,
        table: Sequence[Sequence[int]],
        step: dict[str, RequestTransfers],
    ) -> bool:
        """Queue the store-worthy blocks this step completes (the prompt's, or with
        `save_decode_cache` also those the generated tokens complete, as far as they are
        known: with async scheduling vLLM counts a step's token before it is sampled, and
        speculative decoding schedules draft tokens that may be rejected). True if one
        is a state that vLLM copies into its block after sampling: a decode step's draft
        tokens ran past the block's end in this step, so the kernel wrote the state
        further on."""
        if not self._saves or tracked.tainted:
            return False
        if self.generation:
            self._remember_fresh(tracked, done)
        request = tracked.request
        known = (
            len(request.all_token_ids)
            if self.config.save_decode_cache
            else request.num_prompt_tokens
        )
        upto = min(done, known)
        if upto > tracked.mask_tokens:  # decode went past the mask: grow it, doubling
            self._regrow_mask(tracked, max(upto, 2 * tracked.mask_tokens))
        saves: list[BlockRef] = []
        checkpoints: dict[int, Checkpoint] = {}
        prefill = start < max(request.num_prompt_tokens, request.num_tokens - 1)  # vLLM's bound
        after_sampling = False
        for group, plan in enumerate(self.plan.groups):
            size = plan.block_size
            written = None
            sources: dict[int, int] = {}  # block -> the block holding its state instead
            if self._checkpoints is not None:
                written = self._checkpoints.written(group, start, done)
                if written is not None and not written.is_block_end(size):
                    tracked.inner.add((group, written.block))
                    checkpoints[group] = written
                    if written.tokens % size == 0:
                        # Another block's end (EAGLE moved the checkpoint back, or its
                        # unit spans blocks): that block's state, kept in this one.
                        sources[written.tokens // size - 1] = written.block
            resumed = start // size
            if (
                prefill
                and group in self._state_groups
                and start % size
                and done > (resumed + 1) * size
                and written != Checkpoint((resumed + 1) * size, resumed)
            ):
                # A prefill chunk resuming inside a block and running past its end writes
                # its final state further on: that block keeps the state it resumed from.
                # (A decode step crossing a block end with draft tokens has vLLM copy the
                # state at the block end into it.)
                tracked.inner.add((group, resumed))
            complete = upto // size
            first = tracked.scanned[group]
            if complete <= first:
                continue
            tracked.hashes.cover(request.all_token_ids, complete * size)
            hashes = tracked.hashes.for_group(size)
            ids = table[plan.vllm_group_id]
            mask = tracked.store_mask[group]
            for block in range(first, min(complete, len(ids))):
                source = sources.get(block, block)
                if ids[block] in self._poisoned or ids[source] in self._poisoned:
                    complete = block  # computed over a failed load: not before it is redone
                    break
                # Null: a window or a state vLLM already dropped; it is never coming back.
                # Inner: a state that is not the one at the block's end (unless this
                # step's checkpoint put that one in another block).
                if (
                    block < len(mask)
                    and mask[block]
                    and source < len(ids)
                    and ids[source] != NULL_BLOCK_ID
                    and (source != block or (group, block) not in tracked.inner)
                ):
                    stored = None
                    if self._events is not None:
                        stored = self._events(request, plan.vllm_group_id, size, block)
                    saves.append(BlockRef(group, block, ids[source], hashes[block], stored))
                    after_sampling |= (
                        not prefill
                        and group in self._state_groups
                        and start < (source + 1) * size < done
                    )
            tracked.scanned[group] = complete
        saves.extend(self._tail_saves(tracked, done, table, checkpoints))
        if saves:
            entry = step.setdefault(
                request.request_id, RequestTransfers(request_id=request.request_id)
            )
            entry.saves.extend(saves)
        return after_sampling

    def _tail_saves(
        self,
        tracked: _Tracked,
        done: int,
        table: Sequence[Sequence[int]],
        checkpoints: Mapping[int, Checkpoint],
    ) -> list[BlockRef]:
        """The prompt tails a step leaves, stored before the next step overwrites a state:
        a chunk ending inside a block at a multiple of the tail unit leaves every group's
        KV of exactly that prefix; a prompt's last chunk whose every state group wrote its
        checkpoint at one such position leaves the states there in the checkpoint blocks,
        and the other groups' KV of that prefix in the blocks holding its last token."""
        if not self._tail_unit:
            return []
        saves = self._tail_at(tracked, done, table, {})
        if (
            checkpoints
            and done >= tracked.request.num_prompt_tokens
            and self._state_groups <= checkpoints.keys()
        ):
            # One position for every group: vLLM's rule places it by the chunk alone.
            position = next(iter(checkpoints.values())).tokens
            sources = {group: checkpoint.block for group, checkpoint in checkpoints.items()}
            saves.extend(self._tail_at(tracked, position, table, sources))
        return saves

    def _tail_at(
        self,
        tracked: _Tracked,
        tokens: int,
        table: Sequence[Sequence[int]],
        sources: Mapping[int, int],
    ) -> list[BlockRef]:
        """Each group's partial object of the prefix of `tokens` tokens, from the block
        `sources` names for the group, else from the block holding the prefix's last token;
        none unless `tokens` is a multiple of the tail unit inside the prompt and inside a
        block of every group."""
        request = tracked.request
        if tokens % self._tail_unit or tokens > request.num_prompt_tokens:
            return []
        if not self.coordinator.is_tail_boundary(tokens):
            return []
        tail_hash = tracked.hashes.prefix(request.all_token_ids, tokens)
        saves = []
        for group in self.coordinator.partial_groups(tokens):
            plan = self.plan.groups[group]
            block = tokens // plan.block_size
            source = sources.get(group, block)
            ids = table[plan.vllm_group_id]
            if source < len(ids) and ids[source] != NULL_BLOCK_ID:
                saves.append(BlockRef(group, block, ids[source], tail_hash, tail=tokens))
        return saves

    def loads_failed(
        self,
        request_ids: Iterable[str],
        keys: Iterable[str],
        unsaved: Iterable[tuple[str, int, int]] = (),
        invalid: Iterable[int] = (),
    ) -> None:
        """Pool reads failed: `keys`, whose objects count as absent while quarantined,
        and `request_ids`, background loads that vLLM now computes from their first token
        (vLLM's `failed_recving`). Such a request is tracked afresh when vLLM asks for it
        again: its hit stops before the first failed block, and the blocks it computes
        past that hit are saved; after `MAX_FAILED_BACKGROUND_LOADS` failures it gets no
        hit (the pool answered, but reading failed with no object to blame). `unsaved`
        (request id, plan group, block index): blocks whose read failed before the forward
        and saves the workers left out because their step computed over a failed read;
        they are planned again. `invalid`: vLLM's block ids whose read failed before the
        forward: they, and every block after one in a table holding it, are saved by no
        request until a step has written them again over right KV (see `_heal`). vLLM
        rolls back only the first request holding such a block; the others sharing it
        through its prefix cache wait for that one's recompute, or (admitted before the
        failure was known, under async scheduling) keep what they computed over it."""
        invalid = set(invalid)
        if invalid and len(self.plan.groups) == 1:  # (hybrid models load in the background)
            size = self.plan.groups[0].block_size
            for spans in self._computed:
                for ids, _, done in spans:
                    end = -(-done // size)
                    at = next((i for i in range(end) if ids[i] in invalid), None)
                    if at is not None:
                        self._poisoned.update((b, 0) for b in ids[at:end] if b != NULL_BLOCK_ID)
            self._poisoned.update((b, 0) for b in invalid)
        for request_id, group, index in unsaved:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                tracked.scanned[group] = min(tracked.scanned[group], index)
        keys = list(keys)
        if keys:
            logger.warning(
                "hybridkv: %d pool objects failed to load; lookups skip them for %g s",
                len(keys),
                self.quarantine.seconds,
            )
            # A key still held failed again (a read looked up before its first failure
            # was reported): one object, counted once.
            self.quarantined_keys += self.quarantine.add(keys)
        for request_id in request_ids:
            dropped = self._tracked.pop(request_id, None)
            if dropped is not None:  # (not one that finished while it loaded)
                self._failed_loads[request_id] = self._failed_loads.get(request_id, 0) + 1
            if dropped is not None and dropped.local_tokens is not None:
                self._judge_local_hit(dropped, dropped.local_tokens)  # never scheduled
            if dropped is not None and dropped.tainted:
                # vLLM goes on from the tokens that did load, without a lookup: still over
                # KV from before the reset.
                self._stale.add(request_id)

    def forget(self, request_id: str) -> None:
        self._stale.discard(request_id)
        self._failed_loads.pop(request_id, None)
        self._tracked.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._ready.pop(request_id, None)

    def take_stats(self) -> dict[str, int]:
        stats = {
            "hit_tokens": self.hit_tokens,
            "tail_hit_tokens": self.tail_hit_tokens,
            "lookups": self.lookups,
            "failed_lookups": self.failed_lookups,
            "quarantined_keys": self.quarantined_keys,
        }
        self.hit_tokens = self.tail_hit_tokens = self.lookups = self.failed_lookups = 0
        self.quarantined_keys = 0
        return stats
