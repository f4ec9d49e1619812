"""What the scheduler tells the workers each step: per request, blocks to load and to save.

Block hashes travel instead of keys: each worker renders the keys of its own storing head,
so one metadata object serves every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class BlockRef(msgspec.Struct, frozen=True, array_like=True):
    """Block `index` of plan group `group`, held locally in vLLM block `block_id`.

    `stored`: for a save with KV events enabled, the event announcing it once stored.
    `tail`: for a prompt tail's partial object, the tokens of the prefix it ends (block
    `index` holds them up to there); 0 for a whole block.
    """

    group: int
    index: int
    block_id: int
    block_hash: bytes
    stored: BlockStored | None = None
    tail: int = 0


class RequestTransfers(msgspec.Struct, kw_only=True):
    request_id: str
    loads: list[BlockRef] = msgspec.field(default_factory=list)
    saves: list[BlockRef] = msgspec.field(default_factory=list)
    # Load in the background and report through get_transfer_results (vLLM's async load
    # path).
    load_async: bool = False
    # Whose objects the loads read: 0 this instance's topology, 1 the configured writer
    # topology's (its keys, its objects' pieces).
    topology: int = 0


class HybridKVMetadata(KVConnectorMetadata):
    """The step's transfers; empty on steps with nothing to move.

    `generation`: how many cache resets the scheduler has made; a worker that sees it
    change forgets which keys its requests own (their blocks hash anew from then on).
    `idle`: the step computes no token (its requests wait for their KV): rather than let
    vLLM spin through empty steps, the worker may wait a little for a background load.
    `hold_saves`: the step saves a recurrent state that vLLM moves into its block only
    after sampling (a decode step whose draft tokens cross the block's end): no put may
    go out before `wait_for_save`.
    `finished`: the requests vLLM finished since the last step: what they own is released
    before this step claims anything, as vLLM may schedule a new request under a finished
    one's id in this very step.
    """

    def __init__(
        self,
        requests: list[RequestTransfers] | None = None,
        generation: int = 0,
        idle: bool = False,
        hold_saves: bool = False,
        finished: frozenset[str] = frozenset(),
    ) -> None:
        self.requests: list[RequestTransfers] = requests or []
        self.generation = generation
        self.idle = idle
        self.hold_saves = hold_saves
        self.finished = finished

    def __repr__(self) -> str:
        loads = sum(len(r.loads) for r in self.requests)
        saves = sum(len(r.saves) for r in self.requests)
        return f"HybridKVMetadata(requests={len(self.requests)}, loads={loads}, saves={saves})"


@dataclass(frozen=True)
class FailedLoads(KVConnectorWorkerMetadata):
    """Worker to scheduler, on any TP rank (vLLM aggregates the ranks'): the keys whose
    reads failed in a step, for the scheduler to quarantine, and the blocks to save again,
    as (request id, plan group, block index): saves left out because they computed over
    such a read, and the blocks whose own read failed (vLLM recomputes them)."""

    keys: frozenset[str] = frozenset()
    unsaved: frozenset[tuple[str, int, int]] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> FailedLoads:
        if not isinstance(other, FailedLoads):
            raise TypeError(f"cannot aggregate FailedLoads with {type(other).__name__}")
        return FailedLoads(self.keys | other.keys, self.unsaved | other.unsaved)
