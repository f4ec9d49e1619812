"""Transfer counters the connector reports through vLLM's KV connector stats.

Workers count bytes, blocks and seconds of their loads and saves; the scheduler counts hit
tokens. vLLM sums the snapshots of all ranks with `aggregate`, logs `reduce()` and hands
each step's sums to `HybridKVPromMetrics`, which adds them to Prometheus counters on the
server's `/metrics`. In layerwise mode the workers also report the exposed transfer tail
(`LAYERWISE_FIELDS`).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

FIELDS = (
    "hit_tokens",
    "tail_hit_tokens",
    "lookups",
    "failed_lookups",
    "lookup_seconds",
    "quarantined_keys",
    "loaded_blocks",
    "loaded_bytes",
    "load_seconds",
    "failed_load_blocks",
    "saved_blocks",
    "saved_bytes",
    "save_seconds",
    "failed_save_blocks",
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


# Help of each field's Prometheus counter (every field of FIELDS and LAYERWISE_FIELDS has
# one); its name is the field's, "_s" spelled "_seconds", and the exposition adds "_total".
PROMETHEUS_HELP = {
    "hit_tokens": "Prompt tokens the pool held when vLLM asked",
    "tail_hit_tokens": "Of the hit tokens, those past the aligned hit (prompt tails)",
    "lookups": "Pool lookups made for requests",
    "failed_lookups": "Pool lookups that got no answer (counted as misses)",
    "lookup_seconds": "Seconds the scheduler spent looking requests up (hashes, keys, query)",
    "quarantined_keys": "Pool objects whose read failed, kept from lookups for a while",
    "loaded_blocks": "Blocks whose load from the pool was issued (failed ones too)",
    "loaded_bytes": "Bytes loaded from the pool",
    "load_seconds": "Seconds spent loading whole blocks",
    "failed_load_blocks": "Blocks whose load failed (recomputed)",
    "saved_blocks": "Blocks whose save to the pool was issued (failed ones too)",
    "saved_bytes": "Bytes saved to the pool",
    "save_seconds": "Seconds spent saving whole blocks",
    "failed_save_blocks": "Blocks whose save failed or could not be issued (not in the pool)",
    "layerwise_steps": "Steps that moved KV layer by layer",
    "layers_saved": "Layers handed to layerwise saves",
    "load_wait_s": "Forward seconds waiting for layer loads",
    "backlog_wait_s": "Forward seconds bounding outstanding saves",
    "finish_wait_s": "Forward seconds waiting at step end",
    "exposed_tail_s": "Forward seconds blocked on transfers",
}


def prometheus_name(field: str) -> str:
    """`vllm:hybridkv_<field>`, a trailing "_s" spelled out as Prometheus wants units."""
    unit = field.removesuffix("_s") + "_seconds" if field.endswith("_s") else field
    return f"vllm:hybridkv_{unit}"


class HybridKVPromMetrics(KVConnectorPromMetrics):
    """The stats as `vllm:hybridkv_<name>_total` counters with vLLM's engine labels."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # made with the counter class vLLM passes (prometheus_client's Counter)
        self._counters: dict[str, Any] = {
            field: self._counter_cls(
                name=prometheus_name(field),
                documentation=PROMETHEUS_HELP[field],
                labelnames=labelnames,
            )
            for field in (*FIELDS, *LAYERWISE_FIELDS)
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for field, value in transfer_stats_data.items():
            counter = self._counters.get(field)
            if counter is not None and value > 0:
                counter.labels(*labels).inc(value)
