"""Transfer counters the connector reports through vLLM's KV connector stats.

Workers count bytes, blocks and seconds of their loads and saves; the scheduler counts hit
tokens. vLLM sums the snapshots of all ranks with `aggregate` and logs `reduce()`. In
layerwise mode the workers also report the exposed transfer tail (`LAYERWISE_FIELDS`).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

FIELDS = (
    "hit_tokens",
    "lookups",
    "loaded_blocks",
    "loaded_bytes",
    "load_seconds",
    "failed_load_blocks",
    "saved_blocks",
    "saved_bytes",
    "save_seconds",
)
# Layerwise mode only (`use_layerwise: true`): forward time blocked on transfers.
LAYERWISE_FIELDS = (
    "layerwise_steps",
    "layers_saved",
    "load_wait_s",
    "backlog_wait_s",
    "finish_wait_s",
    "exposed_tail_s",
)


class HybridKVStats(KVConnectorStats):
    """Counters since the last snapshot; every value is summed across ranks and steps."""

    def reset(self) -> None:
        self.data: dict[str, float] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {name: self.data.get(name, 0) for name in FIELDS}
        if "layerwise_steps" in self.data:
            reduced.update({name: self.data.get(name, 0) for name in LAYERWISE_FIELDS})
        seconds = reduced["load_seconds"]
        reduced["load_gb_per_s"] = reduced["loaded_bytes"] / seconds / 1e9 if seconds else 0.0
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Counters:
    """Thread-safe accumulation between snapshots (transfer threads add, vLLM takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}

    def add(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                self._data[name] = self._data.get(name, 0) + value

    def take(self) -> HybridKVStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return HybridKVStats(data=data) if any(data.values()) else None

    def snapshot(self, reset: bool = False) -> dict[str, Any]:
        with self._lock:
            data = dict(self._data)
            if reset:
                self._data = {}
        return data
