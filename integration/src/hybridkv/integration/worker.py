"""Worker-side: lay out each group's objects over vLLM's tensors and move blocks.

The worker owns the store client and a TransferEngine; what happens in a step is delegated
to a strategy (`WholeBlocks` here: load before the forward, save after it; a layerwise
strategy plugs in through the same interface). Saves run on the engine's send thread while
vLLM finishes the step; `barrier()` waits for them before the next step can reuse a block
(vLLM may free and reallocate a saved block as soon as the next schedule, e.g. a block that
left a sliding window or a superseded Mamba state).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from hybridkv.integration.keying import KeySpace
from hybridkv.integration.metadata import BlockRef, HybridKVMetadata
from hybridkv.integration.stats import Counters
from hybridkv.transport import (
    BlockTransfer,
    CacheEntry,
    Event,
    GroupLayout,
    Ticket,
    TransferEngine,
    TransferResult,
)

logger = logging.getLogger(__name__)


def tensor_entries(layer: int, name: str, tensor: Any, num_blocks: int) -> list[CacheEntry]:
    """Cache entries of one layer's tensor(s); block-major layouts and K/V-split ones.

    `[num_blocks, ...]`: one entry per tensor (attention on CPU, Mamba/conv state pages).
    `[2, num_blocks, ...]`: separate K and V entries (FlashAttention-style layouts).
    A list or tuple (several state tensors of one Mamba layer) gives one entry each.
    """
    if isinstance(tensor, list | tuple):
        return [
            entry
            for index, part in enumerate(tensor)
            for entry in tensor_entries(layer, f"{name}#{index}", part, num_blocks)
        ]
    shape = tuple(tensor.shape)
    if shape and shape[0] == num_blocks:
        parts = [(name, tensor)]
    elif len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        parts = [(f"{name}#k", tensor[0]), (f"{name}#v", tensor[1])]
    else:
        raise ValueError(
            f"KV cache tensor of {name} has shape {shape}: expected [{num_blocks}, ...] or "
            f"[2, {num_blocks}, ...] (num_blocks first)"
        )
    entries = []
    for part_name, part in parts:
        if not part[0].is_contiguous():
            raise ValueError(f"{part_name}: a block's bytes are not contiguous ({part.stride()})")
        size = part.element_size()
        entries.append(
            CacheEntry(
                layer=layer,
                name=part_name,
                base_ptr=part.data_ptr(),
                block_bytes=part[0].numel() * size,
                block_stride=part.stride(0) * size,
                num_blocks=num_blocks,
            )
        )
    return entries


def build_layouts(
    keys: KeySpace,
    kv_caches: Mapping[str, Any],
    layer_index: Mapping[str, int],
    num_blocks: int,
) -> list[GroupLayout]:
    """One GroupLayout per plan group, entries from the real tensors of its layers."""
    layouts = []
    for group, plan in enumerate(keys.plan.groups):
        missing = [name for name in plan.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KV cache group {plan.vllm_group_id}: no tensors for {missing}")
        entries = [
            entry
            for name in plan.layer_names
            for entry in tensor_entries(layer_index[name], name, kv_caches[name], num_blocks)
        ]
        layouts.append(GroupLayout(group, entries))
    return layouts


class TransferStrategy(Protocol):
    """How one step's transfers are issued (whole blocks now, layer by layer later)."""

    def start_step(self, loads: Sequence[BlockTransfer]) -> TransferResult:
        """Before the forward: make the loads this forward needs land."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_layer(self, layer_name: str) -> None: ...

    def end_step(self, saves: Sequence[BlockTransfer], ready: Event) -> Ticket | None:
        """After the forward: start the saves once `ready` is reached."""


class WholeBlocks:
    """Each object in one piece: loads complete before the forward, saves start after it."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine

    def start_step(self, loads: Sequence[BlockTransfer]) -> TransferResult:
        return self.engine.load(loads).wait() if loads else TransferResult()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_layer(self, layer_name: str) -> None:
        return None

    def end_step(self, saves: Sequence[BlockTransfer], ready: Event) -> Ticket | None:
        return self.engine.save(saves, ready) if saves else None


class WorkerSide:
    """The worker role: renders this rank's keys, runs the strategy, reports outcomes."""

    def __init__(
        self,
        keys: KeySpace,
        engine: TransferEngine,
        strategy: TransferStrategy,
        tp_rank: int,
        make_event: Any,
    ) -> None:
        self.keys = keys
        self.engine = engine
        self.strategy = strategy
        self.tp_rank = tp_rank
        self._make_event = make_event
        self.counters = Counters()
        self._saves: list[Ticket] = []
        self._async_loads: dict[str, tuple[Ticket, list[BlockTransfer]]] = {}
        self._load_errors: set[int] = set()

    def _transfers(
        self, request_id: str, refs: Iterable[BlockRef], writing: bool
    ) -> list[BlockTransfer]:
        transfers = []
        for ref in refs:
            heads = self.keys.plan.groups[ref.group].heads
            if writing and not heads.writes(self.tp_rank):
                continue
            key = self.keys.keys(ref.group, [ref.block_hash], [heads.head_of(self.tp_rank)])[0]
            transfers.append(BlockTransfer(key, ref.group, ref.block_id, request_id, ref.index))
        return transfers

    def _record_load(self, result: TransferResult) -> None:
        failed = {block for blocks in result.failed_blocks.values() for block in blocks}
        if failed:
            logger.warning("hybridkv: %d blocks failed to load; vLLM recomputes them", len(failed))
        self._load_errors |= failed
        self.counters.add(
            loaded_bytes=result.bytes,
            load_seconds=result.seconds,
            failed_load_blocks=len(failed),
        )

    def barrier(self) -> None:
        """Wait for every save issued so far: their source blocks may be reused next."""
        tickets, self._saves = self._saves, []
        for ticket in tickets:
            try:
                result = ticket.wait()
            except Exception:
                logger.exception("hybridkv: a save failed; those blocks stay uncached")
                continue
            self.counters.add(saved_bytes=result.bytes, save_seconds=result.seconds)

    def start_load(self, meta: HybridKVMetadata) -> None:
        self.barrier()
        sync: list[BlockTransfer] = []
        for request in meta.requests:
            if not request.loads:
                continue
            transfers = self._transfers(request.request_id, request.loads, writing=False)
            self.counters.add(loaded_blocks=len(transfers))
            if request.load_async:
                self._async_loads[request.request_id] = (self.engine.load(transfers), transfers)
            else:
                sync.extend(transfers)
        if sync:
            try:
                result = self.strategy.start_step(sync)
            except Exception:
                logger.exception("hybridkv: loading %d blocks failed", len(sync))
                self._load_errors |= {transfer.local_block for transfer in sync}
                return
            self._record_load(result)

    def save(self, meta: HybridKVMetadata) -> None:
        saves = [
            transfer
            for request in meta.requests
            for transfer in self._transfers(request.request_id, request.saves, writing=True)
        ]
        if not saves:
            return
        self.counters.add(saved_blocks=len(saves))
        event = self._make_event()
        event.record()
        ticket = self.strategy.end_step(saves, event)
        if ticket is not None:
            self._saves.append(ticket)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads that completed (their failures already in the load errors)."""
        if finished_req_ids:
            self.engine.release(list(finished_req_ids))
        done = {rid for rid, (ticket, _) in self._async_loads.items() if ticket.done}
        for request_id in done:
            ticket, transfers = self._async_loads.pop(request_id)
            try:
                self._record_load(ticket.wait())
            except Exception:
                logger.exception("hybridkv: async load of %s failed", request_id)
                self._load_errors |= {transfer.local_block for transfer in transfers}
        return None, (done or None)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self.barrier()
        for ticket, _ in self._async_loads.values():
            try:
                ticket.wait()
            except Exception:
                logger.exception("hybridkv: async load failed during shutdown")
        self._async_loads.clear()
        self.engine.close()
