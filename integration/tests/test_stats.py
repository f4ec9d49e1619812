"""The stats' Prometheus counters: one per field, each named and documented."""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

from conftest import require

from hybridkv.integration.stats import (
    FIELDS,
    LAYERWISE_FIELDS,
    PROMETHEUS_HELP,
    HybridKVPromMetrics,
    prometheus_name,
)

prometheus_client = require("prometheus_client")


def test_every_field_has_a_counter_with_a_valid_name_and_help() -> None:
    assert set(PROMETHEUS_HELP) == {*FIELDS, *LAYERWISE_FIELDS}
    names = [prometheus_name(field) for field in (*FIELDS, *LAYERWISE_FIELDS)]
    assert len(set(names)) == len(names)
    for name in names:
        assert re.fullmatch(r"vllm:hybridkv_[a-z_]+", name), name
        assert not name.endswith("_s"), name  # seconds spelled out
    assert prometheus_name("tail_hit_tokens") == "vllm:hybridkv_tail_hit_tokens"
    assert prometheus_name("load_wait_s") == "vllm:hybridkv_load_wait_seconds"


def test_observed_stats_add_to_the_engine_s_counters() -> None:
    registry = prometheus_client.CollectorRegistry()
    # vLLM passes its metric classes by kind: its Counter, Gauge and Histogram
    kinds = {
        prometheus_client.Counter: functools.partial(prometheus_client.Counter, registry=registry),
        prometheus_client.Gauge: prometheus_client.Gauge,
        prometheus_client.Histogram: prometheus_client.Histogram,
    }
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = HybridKVPromMetrics(config, kinds, ["engine"], {0: ["0"]})
    metrics.observe({"hit_tokens": 176, "tail_hit_tokens": 16, "load_wait_s": 0.5})
    metrics.observe({"hit_tokens": 64, "tail_hit_tokens": 0})

    def value(name: str) -> float | None:
        return registry.get_sample_value(name + "_total", {"engine": "0"})

    assert value("vllm:hybridkv_hit_tokens") == 240
    assert value("vllm:hybridkv_tail_hit_tokens") == 16
    assert value("vllm:hybridkv_load_wait_seconds") == 0.5
