"""The stats' Prometheus metrics: one per field, each named and documented; durations
as histograms, hit rate from tokens asked and hit."""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

from conftest import require

from hybridkv.integration.stats import (
    DURATION_FIELDS,
    FIELDS,
    LAYERWISE_FIELDS,
    PROMETHEUS_HELP,
    Counters,
    HybridKVPromMetrics,
    HybridKVStats,
    prometheus_name,
)

prometheus_client = require("prometheus_client")


def test_every_field_has_a_counter_with_a_valid_name_and_help() -> None:
    assert set(PROMETHEUS_HELP) == {*FIELDS, *LAYERWISE_FIELDS, *DURATION_FIELDS}
    names = [prometheus_name(field) for field in PROMETHEUS_HELP]
    assert len(set(names)) == len(names)
    for name in names:
        assert re.fullmatch(r"vllm:hybridkv_[a-z_]+", name), name
        assert not name.endswith("_s"), name  # seconds spelled out
    assert prometheus_name("tail_hit_tokens") == "vllm:hybridkv_tail_hit_tokens"
    assert prometheus_name("load_wait_s") == "vllm:hybridkv_load_wait_seconds"


def registered_metrics() -> tuple[HybridKVPromMetrics, object]:
    """The connector's metrics in a registry of their own, as vLLM makes them."""
    registry = prometheus_client.CollectorRegistry()
    # vLLM passes its metric classes by kind: its Counter, Gauge and Histogram
    kinds = {
        kind: functools.partial(kind, registry=registry)
        for kind in (
            prometheus_client.Counter,
            prometheus_client.Gauge,
            prometheus_client.Histogram,
        )
    }
    config = SimpleNamespace(kv_transfer_config=None)
    return HybridKVPromMetrics(config, kinds, ["engine"], {0: ["0"]}), registry


def test_observed_stats_add_to_the_engine_s_counters() -> None:
    metrics, registry = registered_metrics()
    metrics.observe({"hit_tokens": 176, "tail_hit_tokens": 16, "load_wait_s": 0.5})
    metrics.observe({"hit_tokens": 64, "tail_hit_tokens": 0})

    def value(name: str) -> float | None:
        return registry.get_sample_value(name + "_total", {"engine": "0"})

    assert value("vllm:hybridkv_hit_tokens") == 240
    assert value("vllm:hybridkv_tail_hit_tokens") == 16
    assert value("vllm:hybridkv_load_wait_seconds") == 0.5


def test_each_duration_lands_in_its_histogram_bucket() -> None:
    metrics, registry = registered_metrics()
    metrics.observe({"load_duration_s": [0.0007, 0.003], "save_duration_s": [0.2]})
    metrics.observe({"load_duration_s": [0.004]})

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert sample("vllm:hybridkv_load_duration_seconds_count") == 3
    assert sample("vllm:hybridkv_load_duration_seconds_sum") == 0.0077
    assert sample("vllm:hybridkv_load_duration_seconds_bucket", le="0.001") == 1
    assert sample("vllm:hybridkv_load_duration_seconds_bucket", le="0.005") == 3
    assert sample("vllm:hybridkv_save_duration_seconds_bucket", le="0.1") == 0
    assert sample("vllm:hybridkv_save_duration_seconds_bucket", le="0.25") == 1


def test_ranks_durations_are_joined_and_counts_summed() -> None:
    ranks = [Counters(), Counters()]
    for rank, counters in enumerate(ranks):
        counters.add(loaded_bytes=100, load_seconds=0.5)
        counters.record(load_duration_s=0.25 + rank)
        counters.record(load_duration_s=0.25)
    first, second = (counters.take() for counters in ranks)
    assert first is not None
    assert second is not None
    joined = first.aggregate(second)
    assert joined.data == {
        "loaded_bytes": 200,
        "load_seconds": 1.0,
        "load_duration_s": [0.25, 0.25, 1.25, 0.25],
    }
    # vLLM starts its accumulator from an empty one too
    assert HybridKVStats(data={}).aggregate(joined).data["load_duration_s"] == [
        0.25,
        0.25,
        1.25,
        0.25,
    ]
    assert ranks[0].take() is None  # taken: nothing left


def test_the_logged_summary_gives_the_hit_rate_of_asked_tokens() -> None:
    reduced = HybridKVStats(
        data={"queried_tokens": 400, "hit_tokens": 300, "hit_requests": 2}
    ).reduce()
    assert reduced["hit_rate"] == 0.75
    assert reduced["hit_requests"] == 2
    assert HybridKVStats(data={"lookups": 1}).reduce()["hit_rate"] == 0.0


def test_every_series_is_exposed_at_zero_before_any_transfer() -> None:
    _, registry = registered_metrics()
    exposed = prometheus_client.generate_latest(registry).decode()
    for field in (*FIELDS, *LAYERWISE_FIELDS):
        assert f'{prometheus_name(field)}_total{{engine="0"}} 0.0' in exposed
    for field in DURATION_FIELDS:
        assert f'{prometheus_name(field)}_count{{engine="0"}} 0.0' in exposed
