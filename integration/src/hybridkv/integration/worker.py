"""Worker-side: move each step's blocks between vLLM's caches and the pool.

The worker owns the store client and a TransferEngine over the caches' entries (see
`cache_layouts`); how a step's transfers are issued is its `TransferStrategy` (whole
blocks, or layer by layer), where it stands in vLLM's step its `StepState`. Saves may
still be running when the forward returns; `barrier()` waits for them before the next
step can reuse a block (vLLM may free and reallocate a saved block as soon as the next
schedule, e.g. a block that left a sliding window or a superseded Mamba state), for
`save_deadline_s` at most: saves still running then are called off (see
`Ticket.call_off`) and count as failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from hybridkv.integration.keying import KeySpace
from hybridkv.integration.kv_events import HeadStored
from hybridkv.integration.metadata import BlockRef, HybridKVMetadata
from hybridkv.integration.stats import Counters
from hybridkv.integration.step_state import StepState
from hybridkv.integration.topologies import WriterReads
from hybridkv.integration.transfer_strategy import (
    PendingSave,
    TransferStrategy,
    all_failed,
    given_up,
)
from hybridkv.transport import BlockTransfer, Event, Ticket, TransferEngine, TransferResult

logger = logging.getLogger(__name__)

# A step that computed nothing waits this long at most for a background load to finish,
# polling it this often (sleeping: the load gets the CPU).
IDLE_LOAD_WAIT_S = 0.05


class WorkerSide:
    """The worker role: renders this rank's keys, runs the strategy, reports outcomes.

    `counters` are taken by vLLM's per-step stats snapshots (with each load's and save's
    duration); `totals` keep summing the same counts until
    `HybridKVConnector.transfer_totals(reset=True)` (for in-process benchmarks).
    """

    def __init__(
        self,
        keys: KeySpace,
        engine: TransferEngine,
        strategy: TransferStrategy,
        tp_rank: int,
        new_event: Callable[[], Event],
        any_rank: Callable[[bool], bool] | None = None,
        steps_ahead: int = 1,
        saves_outlive_step: bool = True,
        save_deadline_s: float = 10.0,
        writer_reads: WriterReads | None = None,
        load_deadline_s: float = 10.0,
    ) -> None:
        """`any_rank(flag)`: whether the flag is set on any TP rank, called by every rank
        of the TP group together (None: this rank alone). `steps_ahead`: how many steps
        vLLM schedules before it learns a step's outcome (1 with async scheduling, 0
        without). `saves_outlive_step`: whether a step's saves may still read their blocks
        after `wait_for_save` returns, until the next step's `handle_preemptions` (the
        barrier): only where vLLM calls that before it zeroes, copies or computes into any
        block; else every save completes within `wait_for_save`. `save_deadline_s`: how
        long the barrier waits in all for the saves still running. `writer_reads`: how
        this rank reads another writer topology's objects (loads whose metadata names
        it). `load_deadline_s`: how long a background load may run before it is given up
        (the strategy bounds the step's own loads)."""
        if keys.stages != 1:
            raise ValueError(
                f"a worker moves one pipeline stage's objects, not {keys.stages} stages': "
                "give its KeySpace the worker's pp_rank"
            )
        self.keys = keys
        self._writer_reads = writer_reads
        self._any_rank = any_rank
        self._steps_ahead = steps_ahead
        self._saves_outlive_step = saves_outlive_step
        self._save_deadline_s = save_deadline_s
        self._load_deadline_s = load_deadline_s
        self.engine = engine
        self.strategy = strategy
        self.tp_rank = tp_rank
        self._new_event = new_event
        self.counters = Counters()
        self.totals = Counters()
        # Waits for issued saves, with the events of the blocks each one stores and how
        # many blocks it puts.
        self._saves: list[tuple[PendingSave, dict[str, HeadStored], int]] = []
        # Saves given up at the deadline whose store calls still run (a stalled pool):
        # the send thread is theirs, so a save issued meanwhile would only wait behind them.
        self._given_up: list[PendingSave] = []
        self._step_saves: list[BlockTransfer] = []
        # (request id, plan group, block index) for the scheduler to plan saving again:
        # saves left out because their step computed over a failed load, and blocks whose
        # own load failed (vLLM recomputes them).
        self._unsaved: set[tuple[str, int, int]] = set()
        self._sync_loads: list[BlockTransfer] = []  # the step's loads before or in its forward
        self._step = StepState()
        self._announce: dict[str, HeadStored] = {}
        self._stored: list[HeadStored] = []
        self._async_waiting: dict[str, list[BlockTransfer]] = {}
        # Background loads: ticket, transfers, and when they are given up (monotonic).
        self._async_loads: dict[str, tuple[Ticket, list[BlockTransfer], float]] = {}
        self._unstarted: dict[str, list[BlockTransfer]] = {}  # background loads that raised
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()
        self._failed_keys: set[str] = set()

    def _count(self, **values: float) -> None:
        self.counters.add(**values)
        self.totals.add(**values)

    def _writer_loads(self, request_id: str, refs: Iterable[BlockRef]) -> list[BlockTransfer]:
        """Loads of another writer topology's objects: every object a block needs."""
        if self._writer_reads is None:
            raise RuntimeError("the scheduler planned loads of a writer topology this rank lacks")
        return [
            transfer
            for ref in refs
            for transfer in self._writer_reads.transfers(
                ref, request_id, -ref.tail if ref.tail else ref.index
            )
        ]

    def _plan_group(self, layout_id: int) -> int:
        """The plan group a transfer's layout loads (its own, or a writer object's)."""
        reads = self._writer_reads
        return layout_id if reads is None else reads.plan_group(layout_id)

    def _transfers(
        self, request_id: str, refs: Iterable[BlockRef], writing: bool
    ) -> list[BlockTransfer]:
        transfers = []
        for ref in refs:
            heads = self.keys.plan.groups[ref.group].heads
            if writing and not heads.writes(self.tp_rank, ref.index):
                continue
            head = heads.head_of(self.tp_rank)
            key = self.keys.keys(ref.group, [ref.block_hash], [head])[0]
            # A tail's partial object is another object than the whole block at its index
            # (which the prompt may complete later): owned under minus its token count.
            owner_index = -ref.tail if ref.tail else ref.index
            transfers.append(BlockTransfer(key, ref.group, ref.block_id, request_id, owner_index))
            if writing and ref.stored is not None:
                # One writer per head of each stage: the scheduler counts them all.
                writer = self.keys.pp_rank * heads.storing + head
                self._announce[key] = HeadStored(writer, ref.stored, self._step.generation)
        return transfers if writing else self._spread(transfers)

    def _spread(self, loads: list[BlockTransfer]) -> list[BlockTransfer]:
        """Ranks holding one head read the same objects: each starts at its own share of
        a group's blocks (vLLM's MooncakeStoreConnector rotates by rank likewise), so they
        do not all ask the same holders for the same objects at once."""
        by_group: dict[int, list[BlockTransfer]] = {}
        for load in loads:
            by_group.setdefault(load.group, []).append(load)
        spread = []
        for group, members in by_group.items():
            replicas = self.keys.plan.groups[self._plan_group(group)].heads.replicas
            shift = len(members) * (self.tp_rank % replicas) // replicas
            spread.extend(members[shift:] + members[:shift])
        return spread

    def _record_load(self, result: TransferResult, request_id: str | None = None) -> None:
        """Count a load and report its failures: a load before the forward by block ids
        (vLLM keeps the blocks that did load), a background load by its `request_id`
        (vLLM's `failed_recving`: it computes the request from its first token; block ids
        would stop the engine of a hybrid model, whose groups repeat them). Either way the
        failed keys go to the scheduler, which quarantines them."""
        failed = {block for blocks in result.failed_blocks.values() for block in blocks}
        # Objects, as `loaded_blocks` counts them: a hybrid model's groups repeat block ids.
        failed_objects = sum(len(blocks) for blocks in result.failed_blocks.values())
        self._failed_keys.update(result.blamed_keys)
        if failed:
            logger.warning(
                "hybridkv: %d blocks failed to load; vLLM recomputes them", failed_objects
            )
            if request_id is not None:
                self._failed_requests.add(request_id)
            else:
                self._load_errors |= failed
        self._count(
            loaded_bytes=result.bytes,
            load_seconds=result.seconds,
            failed_load_blocks=failed_objects,
        )
        # Timed loads only: a step without loads settles an empty result, and layerwise
        # loads carry no clock (they overlap the forward; its waits are counted instead).
        if (result.bytes or failed_objects) and result.seconds:
            self.counters.record(load_duration_s=result.seconds)

    def _record_sync_load(self, result: TransferResult, loads: Sequence[BlockTransfer]) -> None:
        """A load before or in the forward: besides `_record_load`, its failed blocks go
        back to the scheduler, which counted them as in the pool, to be saved once vLLM
        has recomputed them."""
        self._record_load(result)
        lost = {
            (group, block) for group, blocks in result.failed_blocks.items() for block in blocks
        }
        self._leave_unsaved(
            load for load in loads if (self._plan_group(load.group), load.local_block) in lost
        )

    def barrier(self) -> None:
        """Wait for every save issued so far: their source blocks may be reused next. Saves
        still running after `save_deadline_s` in all are given up: called off, so that
        they read no block vLLM may reuse, and counted as failed, never announced."""
        pending, self._saves = self._saves, []
        deadline = time.monotonic() + self._save_deadline_s
        for save, announce, blocks in pending:
            try:
                result = save.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                save.call_off()
                self._given_up.append(save)
                logger.warning(
                    "hybridkv: saves of %d blocks still running after save_deadline_s "
                    "(%g s): given up, those blocks stay uncached; no save is issued until "
                    "their store calls end",
                    blocks,
                    self._save_deadline_s,
                )
                self._count(failed_save_blocks=blocks)
                continue
            except Exception:
                logger.exception("hybridkv: a save failed; those blocks stay uncached")
                self._count(failed_save_blocks=blocks)
                continue
            self._count(
                saved_bytes=result.bytes,
                save_seconds=result.seconds,
                failed_save_blocks=len(result.failed_keys),
            )
            if blocks and result.seconds:  # (as loads: timed ones only)
                self.counters.record(save_duration_s=result.seconds)
            # A contended key was another instance's to store: that one announces it.
            unstored = {*result.failed_keys, *result.contended_keys}
            self._stored.extend(event for key, event in announce.items() if key not in unstored)

    def before_step(self) -> None:
        """vLLM's `handle_preemptions`, its first hook of a step, before any block is
        written: end the last step if vLLM did not (its V1 runner defers `wait_for_save`
        past the draft model's forward, which a pipeline stage before the last never
        runs), then settle the saves still reading blocks."""
        if self._step.open:
            self.end_step()
        self.barrier()

    def begin_step(self, meta: HybridKVMetadata) -> None:
        """The step's metadata is bound, the forward not started: hand the strategy its plan."""
        self.barrier()
        self._step.idle = meta.idle
        if meta.generation != self._step.generation:  # the scheduler reset the cache
            self.engine.release_all()
            self._step.generation = meta.generation
        if meta.finished:  # (before a new request reusing one's id claims its keys)
            self.engine.release(sorted(meta.finished))
        sync: list[BlockTransfer] = []
        saves: list[BlockTransfer] = []
        loaded_blocks = 0
        for request in meta.requests:
            if request.topology:
                loads = self._spread(self._writer_loads(request.request_id, request.loads))
            else:
                loads = self._transfers(request.request_id, request.loads, writing=False)
            loaded_blocks += len(request.loads)  # (a block may read several objects)
            if request.load_async:  # vLLM waits for its report, even with nothing to load
                self._async_waiting[request.request_id] = loads
            else:
                sync.extend(loads)
            saves.extend(self._transfers(request.request_id, request.saves, writing=True))
        if self._step.take_blind_step():
            # vLLM scheduled this step before it learnt of the failed load: requests it
            # rolls back compute over the failed blocks again.
            self._leave_unsaved(saves)
            for save in saves:
                self._announce.pop(save.key, None)
            saves = []
        self._given_up = [save for save in self._given_up if not save.done]
        if saves and (self._given_up or self.strategy.saves_in_background()):
            # Saves given up at their deadline still run (a stalled holder): this step's
            # would only queue behind them (and a layerwise step's would hold the forward).
            for save in saves:
                self._announce.pop(save.key, None)
            self._count(failed_save_blocks=len(saves))
            saves = []
        self._count(loaded_blocks=loaded_blocks)
        self._step_saves = saves
        self._sync_loads = sync
        self._step.begin()
        if sync:
            # Work vLLM queued on the device (e.g. zeroing new blocks) lands before our writes.
            fence = self._new_event()
            fence.record()
            fence.synchronize()
        # Another rank's failed load reaches this rank's KV through the model's
        # all-reduces: with several ranks, a step that loads saves only once they agree.
        # (And a state vLLM moves into its block after sampling is read only then.)
        hold = (bool(sync) and self._any_rank is not None) or meta.hold_saves
        try:
            self.strategy.begin_step(sync, saves, hold_saves=hold)
        except Exception:
            logger.exception("hybridkv: starting a step with %d loads failed", len(sync))
            if sync:  # the forward runs over blocks that were not loaded: reported at its end
                self._step.lose_loads()
                self.strategy.discard_saves()

    def start_async_loads(self) -> None:
        """vLLM's `start_load_kv`: background loads of requests waiting for their KV."""
        waiting, self._async_waiting = self._async_waiting, {}
        if not waiting:
            return
        # Device work vLLM queued this step lands first: a copy-on-write of the block its
        # own hit ends inside, which the load then overwrites from that hit on.
        ready = self._new_event()
        ready.record()
        due = time.monotonic() + self._load_deadline_s
        for request_id, transfers in waiting.items():
            try:
                ticket = self.engine.load(transfers, ready)
                self._async_loads[request_id] = (ticket, transfers, due)
            except Exception:  # reported as a failed load: vLLM computes the request
                logger.exception("hybridkv: starting the background load of %s failed", request_id)
                self._unstarted[request_id] = transfers

    def settle_loads(self) -> bool:
        """Wait for the step's loads and record their failures, once per step (vLLM asks
        for failed blocks before `wait_for_save` when it defers that call past a draft
        model's forward); whether the step computed over a failed load on any rank."""
        if self._step.unsettled:
            loaded = self.strategy.finish_loads()
            failed = self._step.loads_raised or any(loaded.failed_blocks.values())
            loads, self._sync_loads = self._sync_loads, []
            if loads and self._any_rank is not None:
                failed = self._any_rank(failed)  # every rank, every step that loads
            # A begin that raised lost every load, whatever the strategy made of them (the
            # client raised: no object is to blame).
            self._record_sync_load(
                all_failed(loads, loaded.blamed_keys) if self._step.loads_raised else loaded, loads
            )
            self._step.settle(failed)
        return bool(self._step.loads_failed)

    def end_step(self) -> None:
        """vLLM's `wait_for_save`: settle this step's loads, issue its saves.

        A step whose loads failed computed over blocks without valid KV, and so did every
        block it completed after them: the strategy saves none of those (see
        `TransferStrategy`), and they go back to the scheduler to be saved once vLLM
        has recomputed them."""
        self._step.end()
        failed = self.settle_loads()
        announce, self._announce = self._announce, {}
        saves, self._step_saves = self._step_saves, []
        try:
            wait = self.strategy.end_step(keep_saves=not failed)
        except Exception:  # the client raised: none of the step's saves is stored
            logger.exception("hybridkv: this step's saves could not be issued; not stored")
            wait = None
        if wait is None:  # it raised now, or its step raised before: no save went out
            announce = {}
            if not failed:  # (else they go back to the scheduler below)
                self._count(failed_save_blocks=len(saves))
                saves = []
        if failed:
            self._step.blind_for(self._steps_ahead)
            self._leave_unsaved(saves)
            announce = {}  # what committed before the failure is announced when saved again
            saves = []
        if wait is not None:
            self._saves.append((wait, announce, len(saves)))
        self._count(saved_blocks=len(saves), **self.strategy.take_stats())
        if not self._saves_outlive_step:
            self.barrier()

    def _leave_unsaved(self, saves: Iterable[BlockTransfer]) -> None:
        """Hand blocks to save back to the scheduler (a prompt tail, owned under a
        negative index, is not planned again: it is lost)."""
        self._unsaved.update(
            (save.request_id, self._plan_group(save.group), save.block_index)
            for save in saves
            if save.block_index >= 0
        )

    def finished(self) -> set[str]:
        """Async loads that completed, or that ran past `load_deadline_s` and were given up
        (their failures already reported: see `_record_load`).

        vLLM's `finished_req_ids` of the step are not released here: `begin_step` did (the
        metadata's `finished`), and a new request may own keys under one of those ids since."""
        if self._step.idle:
            self._wait_for_a_load()
        now = time.monotonic()
        done = {rid for rid, (ticket, _, _) in self._async_loads.items() if ticket.done}
        late = {rid for rid, (_, _, due) in self._async_loads.items() if now >= due} - done
        for request_id in late:
            ticket, transfers, _ = self._async_loads.pop(request_id)
            ticket.call_off()  # it writes the caches no more: vLLM may compute the request
            logger.warning(
                "hybridkv: the background load of %s still running after load_deadline_s "
                "(%g s): given up, vLLM computes the request",
                request_id,
                self._load_deadline_s,
            )
            self._record_load(given_up(transfers), request_id)
        for request_id in done:
            ticket, transfers, _ = self._async_loads.pop(request_id)
            try:
                self._record_load(ticket.wait(), request_id)
            except Exception:  # the client raised: only what the store failed is to blame
                logger.exception("hybridkv: async load of %s failed", request_id)
                self._record_load(all_failed(transfers, ticket.blamed_keys()), request_id)
        unstarted, self._unstarted = self._unstarted, {}
        for request_id, transfers in unstarted.items():
            self._record_load(all_failed(transfers, []), request_id)
        return done | late | unstarted.keys()

    def _wait_for_a_load(self) -> None:
        """On a step that computed nothing, block (at most IDLE_LOAD_WAIT_S, or until its
        deadline) for the oldest background load: vLLM would otherwise run empty steps back
        to back, and the engine spinning through them starves the transfer of the CPU."""
        if not self._async_loads:
            return
        ticket, _, due = next(iter(self._async_loads.values()))  # the first queued
        now = time.monotonic()
        try:
            ticket.wait(max(0.0, min(due, now + IDLE_LOAD_WAIT_S) - now))
        except Exception:  # still running, or failed: `finished` tells which
            return

    def take_stored_events(self) -> list[HeadStored]:
        """Events of the blocks whose puts were settled (by the barrier) since the last call:
        a step's saves are announced with the next step's output."""
        stored, self._stored = self._stored, []
        return stored

    def take_load_errors(self) -> set[int]:
        """Local blocks whose load failed, this step's included (settled here if vLLM asks
        before `wait_for_save`)."""
        self.settle_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """Requests whose background load failed, once `finished` reported them done."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def take_failed_keys(self) -> set[str]:
        """Keys whose reads failed since the last call."""
        keys, self._failed_keys = self._failed_keys, set()
        return keys

    def take_unsaved(self) -> set[tuple[str, int, int]]:
        """(request id, plan group, block index) to plan saving again, since the last
        call: saves left out because their step computed over a failed load, and blocks
        whose own load failed (the scheduler had counted them as in the pool)."""
        unsaved, self._unsaved = self._unsaved, set()
        return unsaved

    def close(self) -> None:
        self.strategy.close()
        self.barrier()
        for ticket, _, _ in self._async_loads.values():
            try:
                ticket.wait()
            except Exception:
                logger.exception("hybridkv: async load failed during shutdown")
        self._async_loads.clear()
        self._async_waiting.clear()
        self._unstarted.clear()
        self._sync_loads = []
        self._step.settle(False)  # nothing left to settle
        self.engine.close()
