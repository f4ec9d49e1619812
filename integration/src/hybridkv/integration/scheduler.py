"""The scheduler role of the connector: how much of a prompt the pool holds, what to load
and what to save, each step.

Sans-I/O except for the lookup queries, made through a callable. `SchedulerSide` answers
vLLM's scheduler-side connector calls by delegating, each concern to a class of its own
that owns its state: `TrackedRequests` (what is kept per live request), `HitFinder` (the
pool queries and the hit), `LoadPlanner` (from a hit to the loads once vLLM allocates it),
`SavePlanner` (the blocks a step completes that are worth saving, prompt tails included),
`PoisonedBlocks` (local blocks computed over a failed load) and `ResetTaint` (KV from
before a cache reset).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hybridkv.coordinator import Hit
from hybridkv.integration.answer_memory import AnswerMemory
from hybridkv.integration.block_query import BlockQuery, Query, RenderingQuery
from hybridkv.integration.checkpoints import PrefillCheckpoints
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.hit_finder import HitFinder
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.kv_events import EventBuilder
from hybridkv.integration.load_planner import LoadPlanner, PendingLoad
from hybridkv.integration.metadata import HybridKVMetadata, RequestTransfers
from hybridkv.integration.poisoned_blocks import PoisonedBlocks
from hybridkv.integration.quarantine import Quarantine
from hybridkv.integration.reset_taint import ResetTaint
from hybridkv.integration.save_planner import SavePlanner
from hybridkv.integration.tracked_requests import (
    Scheduled,
    TrackedRequest,
    TrackedRequests,
    block_table,
    has_token_ids,
)

__all__ = ["Query", "SchedulerSide"]


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
        block_query: BlockQuery | None = None,
        writer_keys: KeySpace | None = None,
    ) -> None:
        """`tail_unit`: vLLM's hash unit where its prefix cache hits inside blocks (prompt
        tails are stored and looked up at its multiples); 0: whole blocks only.
        `load_async_required`: load in the background even if `load_async` is off (vLLM
        recovers from a failed load of a hybrid model only while the request waits).
        `clock`: the time that quarantined keys are released by, and remembered answers
        age by. `checkpoints`: the Mamba groups whose prefill chunks leave a block holding
        an inner state (saved only as a prompt tail). `use_eagle`: vLLM drops the last
        block of its own hits (see `drops_eagle_block`); hits from the pool, and the
        states saved for them, follow.
        `local_hit_unit`: vLLM's hash block size, which its own prefix-cache hits end on a
        multiple of (0: the plan's hash unit). `steps_ahead`: how many steps vLLM schedules
        before it reports a step's outcome (async scheduling, pipeline stages).
        `block_query`: the pool asked by block hashes, their keys rendered where the store
        is (the lookup socket); None: `query` asked by keys rendered here.
        `writer_keys`: the keys of another writer topology this reader reads (its groups
        are this plan's): a request takes the longer hit, its own on a tie."""
        self.keys = keys
        self.plan = keys.plan
        self.config = config
        self._loads_enabled = config.loads_for(kv_role)
        self._saves_enabled = config.saves_for(kv_role)
        self.coordinator = self.plan.coordinator(use_eagle)
        tail_unit = tail_unit if config.prompt_tails else 0
        # Where vLLM's own hits may end: the prefixes remembered fresh end there too.
        local_unit = math.gcd(self.plan.hash_block_size, local_hit_unit)
        quarantine = Quarantine(config.failed_load_quarantine_s, clock)
        self._queried_tokens = 0  # asked of the pool past vLLM's own hits: hit rate's base
        asked = RenderingQuery(keys, query) if block_query is None else block_query
        self._hits = HitFinder(
            keys, self.coordinator, asked, quarantine, tail_unit, config.test_exact_lookup_keys
        )
        self._writer_hits = None
        if writer_keys is not None:
            self._writer_hits = HitFinder(
                writer_keys,
                self.coordinator,
                RenderingQuery(writer_keys, query),  # (the socket renders its own keys only)
                quarantine,
                tail_unit,
                config.test_exact_lookup_keys,
            )
        load_async = config.load_async or load_async_required
        self._loads = LoadPlanner(self.plan, self.coordinator, load_async)
        self._poisoned = PoisonedBlocks(self.plan.groups[0].block_size, steps_ahead)
        self._saves = SavePlanner(
            self.plan,
            self.coordinator,
            config.save_decode_cache,
            tail_unit,
            self._poisoned,
            checkpoints,
            events,
        )
        self._taint = ResetTaint(self.plan, local_unit)
        self._requests = TrackedRequests(
            self.plan,
            config.namespace,
            local_unit,
            self._saves.store_mask,
            self._saves.regrow_mask,
        )
        self._lookup_seconds = 0.0
        self._answers: AnswerMemory[tuple[Hit, Hit, int]] = AnswerMemory(
            config.lookup_memory_s, clock
        )

    @property
    def generation(self) -> int:
        """Cache resets so far: the generation every hash (and so key) belongs to."""
        return self._taint.generation

    @property
    def quarantine(self) -> Quarantine:
        return self._hits.quarantine

    def reset(self) -> None:
        """Nothing stored before this call is looked up again: hashes (and so keys) move
        to a new generation. A request vLLM looks up again (a reset that preempts the
        running ones) is tracked afresh; one that keeps the KV it had (still running, or
        finishing a background load) is not saved again."""
        self._taint.reset(self._requests)
        self._requests.clear()
        self._loads.reset()
        self._answers.clear()

    def _track(self, request: Any) -> TrackedRequest:
        return self._requests.track(request, self._taint.generation)

    # -- lookup -----------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """(tokens to load beyond `num_computed`, load asynchronously?); the time it takes
        is on vLLM's scheduling path, summed in `lookup_seconds`."""
        started = time.perf_counter()
        try:
            return self._matched_tokens(request, num_computed)
        finally:
            self._lookup_seconds += time.perf_counter() - started

    def _matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        self._taint.looked_up(request.request_id)  # vLLM computes it afresh
        if self._taint.generation and has_token_ids(request):
            self._track(request).skip_local_hit = True
        if not self._loads_enabled or not has_token_ids(request):
            return 0, False  # a consumer told not to load, or no token ids to hash
        if self._loads.gave_up(request.request_id):
            return 0, False  # vLLM computes it
        if not self._hits.worth_asking(request, num_computed):
            return 0, False
        self._queried_tokens += request.num_tokens - num_computed
        found = self._answers.answer(
            request, num_computed, lambda: self._find(request, num_computed)
        )
        if found is None:
            return 0, False
        hit, aligned, topology = found
        if hit.tokens <= num_computed:
            self._loads.drop(request.request_id)
            return 0, False
        tail_tokens = hit.tokens - max(aligned.tokens, num_computed)
        pending = PendingLoad(num_computed, hit, tail_tokens, topology)
        self._loads.expect(request.request_id, pending)
        return hit.tokens - num_computed, self._loads.load_async

    def _find(self, request: Any, num_computed: int) -> tuple[Hit, Hit, int] | None:
        """The longer of this topology's hit and the writer topology's (0 or 1), its own
        on a tie; None: the pool did not answer."""
        tracked = self._track(request)
        found = self._hits.find(request, tracked, num_computed)
        if self._writer_hits is not None:
            theirs = self._writer_hits.find(request, tracked, num_computed)
            if theirs is not None and (found is None or theirs[0].tokens > found[0].tokens):
                return (*theirs, 1)
        return None if found is None else (*found, 0)

    # -- allocation -------------------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: Sequence[list[int]], external: int) -> None:
        """Turn the pending hit into per-block loads once vLLM has placed the blocks."""
        # Placed: it waits no more. Asked again (a preemption), the pool may hold its own
        # blocks by then: a new lookup, not the answer it got while waiting.
        self._answers.forget(request.request_id)
        if not has_token_ids(request) or self._taint.is_stale(request.request_id):
            return  # never saved: placeholder token ids, or KV from before a reset
        self._loads.allocated(request, self._track(request), block_ids, external)

    # -- per step ---------------------------------------------------------------------

    def build_meta(self, output: Any) -> HybridKVMetadata:
        """This step's loads (decided at allocation) and saves (blocks it completes).

        (`output.finished_req_ids` are forgotten already, at `request_finished`; an id
        vLLM reuses for a new request in this very step names that request.)"""
        step: dict[str, RequestTransfers] = self._loads.take_ready()
        state = getattr(output, "kv_connector_block_state", None)
        # Judged and remembered in vLLM's order: a request admitted in this step may hit
        # what one scheduled before it computes in it, fresh as well.
        scheduled = self._requests.scheduled(output)
        for tracked, start, done, restarted in scheduled:
            if restarted is not None:
                self._taint.skip_local_hit(tracked, start)
                tracked.block_ids = [list(ids) for ids in restarted]  # new, or resumed
            if (
                self._taint.generation
                and self._saves_enabled
                and not (tracked.skip_local_hit or tracked.tainted)
            ):
                self._taint.remember_fresh(tracked, done)
        hold = False
        if self._saves_enabled:  # (each request's table resolved once: vLLM builds it on request)
            tables = [block_table(tracked, state) for tracked, _, _, _ in scheduled]
            if self._loads_enabled and len(self.plan.groups) == 1:  # (hybrid: background loads)
                self._follow_failed_loads(scheduled, tables, step)
            for (tracked, start, done, _), current in zip(scheduled, tables, strict=True):
                if tracked.tainted:
                    continue
                if self._taint.generation:
                    self._taint.remember_fresh(tracked, done)
                hold |= self._saves.plan(tracked, start, done, current, step)
        idle = output.total_num_scheduled_tokens == 0
        finished = frozenset(output.finished_req_ids)
        return HybridKVMetadata(list(step.values()), self.generation, idle, hold, finished)

    def _follow_failed_loads(
        self,
        scheduled: Sequence[Scheduled],
        tables: Sequence[Sequence[Sequence[int]]],
        step: dict[str, RequestTransfers],
    ) -> None:
        """Hand what this step computes over, in the one vLLM group, to the poisoned blocks."""
        group = self.plan.groups[0].vllm_group_id
        spans = [
            (table[group], start, done)
            for (_, start, done, _), table in zip(scheduled, tables, strict=True)
        ]
        self._poisoned.follow(spans, step)

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
        request until a step has written them again over right KV (`PoisonedBlocks`)."""
        invalid = set(invalid)
        if invalid and len(self.plan.groups) == 1:  # (hybrid models load in the background)
            self._poisoned.failed(invalid)
        for request_id, group, index in unsaved:
            tracked = self._requests.get(request_id)
            if tracked is not None:
                tracked.scanned[group] = min(tracked.scanned[group], index)
        failed_keys, request_ids = list(keys), list(request_ids)
        self._hits.quarantine_failed(failed_keys)  # (the writer's finder shares it)
        if failed_keys or request_ids or invalid:  # rare: any answer may count on them
            self._answers.clear()
        for request_id in request_ids:
            dropped = self._requests.pop(request_id)
            if dropped is not None:  # (not one that finished while it loaded)
                self._loads.load_failed(request_id)
                self._taint.load_failed(request_id, dropped)

    def forget(self, request_id: str) -> None:
        self._answers.forget(request_id)
        self._taint.forget(request_id)
        self._loads.forget(request_id)
        self._requests.pop(request_id)

    def take_stats(self) -> dict[str, float]:
        """Counts since the last call; lookups of the writer topology's keys count too."""
        loads = self._loads
        finders = [self._hits] if self._writer_hits is None else [self._hits, self._writer_hits]
        stats = {
            "queried_tokens": self._queried_tokens,
            "hit_tokens": loads.hit_tokens,
            "hit_requests": loads.hit_requests,
            "tail_hit_tokens": loads.tail_hit_tokens,
            "lookups": sum(hits.lookups for hits in finders),
            "failed_lookups": sum(hits.failed_lookups for hits in finders),
            "remembered_lookups": self._answers.given_again,
            "lookup_seconds": self._lookup_seconds,
            "quarantined_keys": sum(hits.quarantined_keys for hits in finders),
        }
        self._lookup_seconds = 0.0
        self._answers.given_again = self._queried_tokens = 0
        loads.hit_tokens = loads.hit_requests = loads.tail_hit_tokens = 0
        for hits in finders:
            hits.lookups = hits.failed_lookups = hits.quarantined_keys = 0
        return stats
