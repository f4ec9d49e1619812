"""KV events for the blocks this connector put in the pool (vLLM's `BlockStored`).

With `kv_events_config.enable_kv_cache_events`, a router learns from vLLM's event stream
which prefixes the pool holds. The events carry vLLM's own block hashes (as its GPU-tier
`BlockStored` events do, rendered by `maybe_convert_block_hash`), not hybridkv's pool
keys, so a consumer matches pool blocks against what it already indexes.

The scheduler builds each event when it plans the save (it holds the request); the worker
that wrote the block's object reports it, tagged with its storing head, once the put
completed; the scheduler publishes a block once every storing head of its group reported
it, so a published block is loadable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

# Blocks some head reported but another never did (its put failed) are dropped past this.
_MAX_PENDING = 65536
# Blocks announced lately, not announced again (a repeated prompt's blocks are planned for
# saving again, and found in the pool): vLLM's incremental reports do not repeat either.
_MAX_ANNOUNCED = 65536


class HeadStored(KVCacheEvent):
    """`event`'s block, as stored by the worker writing storing head `head`.

    Internal to the connector: it travels from the workers to the scheduler in
    `KVConnectorOutput.kv_cache_events`, which vLLM merges across workers; only the
    unwrapped `BlockStored` is ever published.
    """

    head: int
    event: BlockStored
    # The scheduler's cache-reset generation the save was planned in.
    generation: int = 0


class StoredEvents(KVConnectorKVEvents):
    """The `HeadStored` reports of one step from one or more workers (vLLM merges them)."""

    def __init__(self, events: Iterable[HeadStored] = ()) -> None:
        self._events: list[KVCacheEvent] = list(events)
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> StoredEvents:
        return self  # completeness needs the group's storing heads: see `PoolAnnouncer`

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


class PoolAnnouncer:
    """Scheduler side: collects head reports, releases each block once all heads stored it,
    and not again while it is among the last `_MAX_ANNOUNCED` released since a reset.

    `storing_heads` maps vLLM's group id to the number of distinct objects a block of
    that group has (one per storing head).
    """

    def __init__(self, storing_heads: Mapping[int, int]) -> None:
        self._storing = dict(storing_heads)
        self._pending: OrderedDict[BlockStored, set[int]] = OrderedDict()
        self._ready: list[BlockStored | BlockRemoved] = []
        self._announced: OrderedDict[BlockStored, None] = OrderedDict()
        self._generation = 0

    def reset(self, generation: int) -> None:
        """A cache reset removed the pool's blocks: the blocks announced lately are
        announced removed (`BlockRemoved`), and reports of older saves, some still on
        their way from the workers, announce nothing any more."""
        self._generation = generation
        self._pending.clear()
        unpublished = set(self._ready)
        self._ready = [event for event in self._ready if isinstance(event, BlockRemoved)]
        self._ready += [
            BlockRemoved(
                block_hashes=event.block_hashes, medium=MEDIUM_CPU, group_idx=event.group_idx
            )
            for event in self._announced
            if event not in unpublished
        ]
        self._announced.clear()

    def add(self, reports: Iterable[KVCacheEvent]) -> None:
        for report in reports:
            if not isinstance(report, HeadStored) or report.generation < self._generation:
                continue
            if report.event in self._announced:
                self._announced.move_to_end(report.event)
                continue
            heads = self._pending.setdefault(report.event, set())
            heads.add(report.head)
            if len(heads) >= self._storing.get(report.event.group_idx or 0, 1):
                del self._pending[report.event]
                self._ready.append(report.event)
                self._announced[report.event] = None
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        while len(self._announced) > _MAX_ANNOUNCED:
            self._announced.popitem(last=False)

    def take(self) -> list[BlockStored | BlockRemoved]:
        ready, self._ready = self._ready, []
        return ready


class EventBuilder:
    """Builds the `BlockStored` of a block the scheduler plans to save.

    `hash_block_size`: the granularity of vLLM's request block hashes
    (`kv_cache_config.hash_block_size`); `specs`: vLLM group id -> its KV cache spec.
    """

    def __init__(self, hash_block_size: int, specs: Mapping[int, Any]) -> None:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        self._hash_block_size = hash_block_size
        self._spec = {
            group: (get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec))
            for group, spec in specs.items()
        }

    def __call__(
        self, request: Any, group_id: int, block_size: int, block: int
    ) -> BlockStored | None:
        """None when vLLM has not hashed that block yet (a decode block past its hashes)."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            resolve_block_hashes,
            to_event_extra_keys,
        )

        hashes = resolve_block_hashes(request.block_hashes, self._hash_block_size, block_size)
        if block >= len(hashes):
            return None
        start, end = block * block_size, (block + 1) * block_size
        extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
        lora = request.lora_request
        kind, window = self._spec[group_id]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[block])],
            parent_block_hash=maybe_convert_block_hash(hashes[block - 1]) if block else None,
            token_ids=list(request.all_token_ids[start:end]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys([extra]),
            group_idx=group_id,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            session_id=getattr(request, "session_id", None),
        )
