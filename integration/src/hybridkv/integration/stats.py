"""Transfer counters the connector reports through vLLM's KV connector stats.

Workers count bytes, blocks and seconds of their loads and saves, and record how long each
load and save took (`DURATION_FIELDS`, lists); the scheduler counts the tokens it asked the
pool for and those it hit. vLLM sums the snapshots of all ranks with `aggregate` (lists are
joined), logs `reduce()` and hands each step's data to `HybridKVPromMetrics`, which adds the
sums to Prometheus counters and the durations to histograms on the server's `/metrics`. In
layerwise mode the workers also report the exposed transfer tail (`LAYERWISE_FIELDS`).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

FIELDS = (
    "queried_tokens",
    "hit_tokens",
    "hit_requests",
    "tail_hit_tokens",
    "lookups",
    "failed_lookups",
    "skipped_lookups",
    "breaker_opened",
    "breaker_closed",
    "breaker_probes",
    "remembered_lookups",
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
# Seconds of each load (one step's loads, or one request's background load) and of each
# save (one step's saves), per rank: their histograms give latency quantiles.
DURATION_FIELDS = ("load_duration_s", "save_duration_s")
# vLLM's NIXL transfer-time buckets, reaching down to the sub-millisecond loads of a GPU.
DURATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0
)  # fmt: skip


class HybridKVStats(KVConnectorStats):
    """Counters since the last snapshot, summed across ranks and steps (durations joined)."""

    def reset(self) -> None:
        self.data: dict[str, float] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, [] if name in DURATION_FIELDS else 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {name: self.data.get(name, 0) for name in FIELDS}
        if "layerwise_steps" in self.data:
            reduced.update({name: self.data.get(name, 0) for name in LAYERWISE_FIELDS})
        seconds = reduced["load_seconds"]
        reduced["load_gb_per_s"] = reduced["loaded_bytes"] / seconds / 1e9 if seconds else 0.0
        queried = reduced["queried_tokens"]
        reduced["hit_rate"] = reduced["hit_tokens"] / queried if queried else 0.0
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

    def record(self, **durations: float) -> None:
        """One observation of each of `DURATION_FIELDS` named, for its histogram."""
        with self._lock:
            for name, seconds in durations.items():
                self._data.setdefault(name, []).append(seconds)

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


# Help of each field's Prometheus metric (every field of FIELDS, LAYERWISE_FIELDS and
# DURATION_FIELDS has one); its name is the field's, "_s" spelled "_seconds"; the exposition
# adds "_total" to counters and "_bucket", "_sum", "_count" to histograms.
PROMETHEUS_HELP = {
    "queried_tokens": "Prompt tokens past vLLM's own hit that the pool was asked for",
    "hit_requests": "Requests that loaded a hit from the pool",
    "hit_tokens": "Prompt tokens the pool held when vLLM asked",
    "tail_hit_tokens": "Of the hit tokens, those past the aligned hit (prompt tails)",
    "lookups": "Pool lookups made for requests",
    "failed_lookups": "Pool lookups that got no answer (counted as misses)",
    "skipped_lookups": "Lookups answered miss unsent while the pool counted as down",
    "breaker_opened": "Times the pool came to count as down (a lookup timed out)",
    "breaker_closed": "Times a probe found the pool answering again",
    "breaker_probes": "Probes sent while the pool counted as down",
    "remembered_lookups": "Asks about a waiting request answered again without a lookup",
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
    "load_duration_s": "Seconds of each load (a step's, or a request's in the background)",
    "save_duration_s": "Seconds of each step's saves to the pool",
}


def prometheus_name(field: str) -> str:
    """`vllm:hybridkv_<field>`, a trailing "_s" spelled out as Prometheus wants units."""
    unit = field.removesuffix("_s") + "_seconds" if field.endswith("_s") else field
    return f"vllm:hybridkv_{unit}"


def exposed_names() -> set[str]:
    """Every sample name the connector puts on `/metrics` (a dashboard may use these)."""
    counters = {prometheus_name(field) + "_total" for field in (*FIELDS, *LAYERWISE_FIELDS)}
    histograms = {
        prometheus_name(field) + suffix
        for field in DURATION_FIELDS
        for suffix in ("_bucket", "_sum", "_count")
    }
    return counters | histograms


class HybridKVPromMetrics(KVConnectorPromMetrics):
    """The stats as `vllm:hybridkv_<name>_total` counters and `vllm:hybridkv_<name>_seconds`
    histograms, with vLLM's engine labels. Each engine's series exist from start-up, at 0,
    as vLLM's own do: a dashboard's queries find every series before the first transfer."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # made with the metric classes vLLM passes (prometheus_client's)
        counters = {
            field: self._counter_cls(
                name=prometheus_name(field),
                documentation=PROMETHEUS_HELP[field],
                labelnames=labelnames,
            )
            for field in (*FIELDS, *LAYERWISE_FIELDS)
        }
        histograms = {
            field: self._histogram_cls(
                name=prometheus_name(field),
                documentation=PROMETHEUS_HELP[field],
                buckets=DURATION_BUCKETS,
                labelnames=labelnames,
            )
            for field in DURATION_FIELDS
        }
        self._counters: dict[int, dict[str, Any]] = {}
        self._histograms: dict[int, dict[str, Any]] = {}
        for engine, labels in per_engine_labelvalues.items():
            self._counters[engine] = {f: c.labels(*labels) for f, c in counters.items()}
            self._histograms[engine] = {f: h.labels(*labels) for f, h in histograms.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counters, histograms = self._counters[engine_idx], self._histograms[engine_idx]
        for field, value in transfer_stats_data.items():
            if field in histograms:
                for seconds in value:
                    histograms[field].observe(seconds)
            elif field in counters and value > 0:
                counters[field].inc(value)
