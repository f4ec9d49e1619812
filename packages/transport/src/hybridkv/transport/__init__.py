"""hybridkv.transport: KV blocks of hybrid-attention models to and from a Mooncake pool.

Store half: the `Store` protocol, its Mooncake and in-memory backends, and the processes
tests and deployments run (master, segment holder). Engine half: the object layout of a
group's block, device-readiness events, and the engine moving blocks whole or layerwise.
"""

from hybridkv.transport.config import MooncakeConfig, parse_size
from hybridkv.transport.device_events import CpuEvent, Event, make_event
from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.errors import (
    InvalidRequestError,
    NoSpaceError,
    NotFoundError,
    Status,
    StoreClosed,
    StoreError,
    StoreUnavailable,
    TransferError,
    UnsupportedClient,
)
from hybridkv.transport.layerwise_step import LayerwiseStep
from hybridkv.transport.layout import CacheEntry, GroupLayout
from hybridkv.transport.master import MasterProcess
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.outcome import TransferResult
from hybridkv.transport.ownership import BlockTransfer, OwnedBlock
from hybridkv.transport.pipeline import Granularity, PipelineOptions
from hybridkv.transport.segment_holder import SegmentHolder
from hybridkv.transport.store import Store
from hybridkv.transport.ticket import Ticket

__all__ = [
    "BlockTransfer",
    "CacheEntry",
    "CpuEvent",
    "Event",
    "Granularity",
    "GroupLayout",
    "InvalidRequestError",
    "LayerwiseStep",
    "MasterProcess",
    "MemoryStore",
    "MooncakeConfig",
    "MooncakeStore",
    "NoSpaceError",
    "NotFoundError",
    "OwnedBlock",
    "PipelineOptions",
    "SegmentHolder",
    "Status",
    "Store",
    "StoreClosed",
    "StoreError",
    "StoreUnavailable",
    "Ticket",
    "TransferEngine",
    "TransferError",
    "TransferResult",
    "UnsupportedClient",
    "make_event",
    "parse_size",
]
