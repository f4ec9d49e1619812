from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.integration.config import (
    ConnectorConfig,
    WriterTopology,
    mooncake_config_from_env,
    parse_extra_config,
)


def test_defaults() -> None:
    config = parse_extra_config(None)
    assert config == ConnectorConfig()
    assert (config.use_layerwise, config.layerwise_prefetch_layers) == (False, 2)
    assert (config.layerwise_max_transfer_blocks, config.layerwise_max_transfer_bytes) == (0, 0)
    assert (config.load_async, config.lookup_rpc_port, config.store) == (False, 0, "mooncake")
    assert config.pipeline_options("cpu").staging_bytes == 256 << 20


def test_every_key_is_accepted() -> None:
    config = parse_extra_config(
        {
            "use_layerwise": True,
            "layerwise_prefetch_layers": 3,
            "layerwise_max_transfer_blocks": 16,
            "layerwise_max_transfer_bytes": 1 << 20,
            "load_async": True,
            "lookup_rpc_port": 5555,
            "lookup_timeout_ms": 200,
            "discard_partial_chunks": True,
            "namespace": "tenant-a",
            "backend": "mooncake",
            "store": "memory",
            "staging_bytes": "64MB",
            "granularity": "group",
            "full_pool_pause_s": 0.5,
            "kv_cache_layout": "BLHNC",
        }
    )
    assert config.layerwise_prefetch_layers == 3
    assert config.namespace == "tenant-a"
    assert config.kv_cache_layout == "BLHNC"
    assert config.pipeline_options("cpu").staging_bytes == 64 << 20
    assert config.pipeline_options("cpu").full_pool_pause_s == 0.5
    assert parse_extra_config({"staging_bytes": 0}).pipeline_options("cpu").staging_bytes == 0


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"use_layerwise": True, "typo_key": 1}, "typo_key"),
        ({"lookup_rpc_port": 70000}, "lookup_rpc_port"),
        ({"lookup_timeout_ms": 0}, "lookup_timeout_ms"),
        ({"layerwise_prefetch_layers": -1}, "layerwise_prefetch_layers"),
        ({"_layerwise_backlog": -1}, "_layerwise_backlog"),
        ({"consumer_is_to_put": 1}, "consumer_is_to_put"),
        ({"save_decode_caches": True}, "save_decode_caches"),
        ({"prefill_pp_size": 0}, "prefill_pp_size"),
        ({"prefill_pp_size": 2, "prefill_pp_layer_partition": "3,5,1"}, "3 stages"),
        ({"prefill_pp_size": 2, "prefill_pp_layer_partition": "3,x"}, "positive layer counts"),
        ({"prefill_pp_size": 2, "prefill_pp_layer_partition": "0,8"}, "positive layer counts"),
        ({"store_tp_size": 2, "prefill_tp_sizes": [2]}, "not both"),
        ({"prefill_tp_sizes": [2, 4]}, "one writer topology"),
        ({"prefill_tp_sizes": []}, "must name a TP size"),
        ({"store_tp_size": 0}, "store_tp_size"),
        ({"lookup_rpc_port": 5555, "mooncake_rpc_port": 5556}, "mooncake_rpc_port"),
        ({"layerwise_max_transfer_bytes": -1}, "layerwise_max_transfer_bytes"),
        ({"load_async": "yes"}, "load_async"),
        ({"backend": "memcache"}, "backend"),
        ({"store": "redis"}, "store"),
        ({"discard_partial_chunks": False}, "discard_partial_chunks"),
        ({"namespace": "a@b"}, "namespace"),
        ({"namespace": "a/b"}, "namespace"),
        ({"namespace": "a\nb"}, "namespace"),
        ({"staging_bytes": -1}, "staging_bytes"),
        ({"staging_bytes": "lots"}, "staging_bytes"),
        ({"granularity": "bytes"}, "granularity"),
        ({"full_pool_pause_s": -1}, "full_pool_pause_s"),
        ({"failed_load_quarantine_s": 0}, "failed_load_quarantine_s"),
        # JSON's 1e999 reads as infinity: a quarantine that never ends, a pause for good.
        ({"failed_load_quarantine_s": float("inf")}, "failed_load_quarantine_s"),
        ({"full_pool_pause_s": float("inf")}, "full_pool_pause_s"),
        ({"lookup_timeout_ms": 2**31}, "lookup_timeout_ms"),  # past ZMQ's C int
        # Accepted, then failing at every save (its buffer is allocated at the first).
        ({"staging_bytes": 10**30}, r"staging_bytes must be at most this host's memory \("),
        ({"staging_bytes": "1000000TB"}, "staging_bytes must be at most"),
        # inf was refused, 1e300 (as long) was not.
        ({"full_pool_pause_s": 1e300}, "full_pool_pause_s must be at most 86400 seconds"),
        ({"failed_load_quarantine_s": 1e300}, "failed_load_quarantine_s must be at most 86400"),
        ({"full_pool_pause_s": float("nan")}, "full_pool_pause_s"),
        ({"lookup_probe_backoff_s": 0}, "lookup_probe_backoff_s"),
        ({"lookup_probe_max_backoff_s": 1e300}, "lookup_probe_max_backoff_s must be at most"),
        (
            {"lookup_probe_backoff_s": 5, "lookup_probe_max_backoff_s": 2},
            r"lookup_probe_backoff_s \(5.0\) must be at most lookup_probe_max_backoff_s \(2.0\)",
        ),
        # '~' separates the namespace from the model in keys (see keying.scoped_model).
        ({"namespace": "a~b"}, "namespace must be printable, without '@', '/' or '~'"),
        ({"namespace": "n" * 257}, "namespace must be at most 256 characters"),
        ({"mooncake_rpc_port": "six"}, "mooncake_rpc_port"),
        ({"kv_cache_layout": "LHBNC"}, "kv_cache_layout"),  # a block spread over heads
    ],
)
def test_bad_input_names_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_extra_config(extra)


def test_vllm_mooncake_store_connector_config_carries_over() -> None:
    """The keys of vLLM's MooncakeStoreConnector that hybridkv shares keep their meaning."""
    config = parse_extra_config(
        {
            "load_async": True,
            "lookup_async": True,
            "enable_lookup": False,
            "save_decode_cache": True,
            "lookup_rpc_port": 6000,
        }
    )
    assert config.load_async
    assert config.save_decode_cache
    assert config.lookup_port() == 6000
    assert config.lookup_port(data_parallel_rank=3) == 6003  # DP engines on one host
    assert parse_extra_config({}).lookup_port(data_parallel_rank=3) == 0  # published
    last = parse_extra_config({"lookup_rpc_port": 65534})
    assert last.lookup_port(data_parallel_rank=1) == 65535
    with pytest.raises(ValueError, match="lookup_rpc_port 65534 plus data-parallel rank 2"):
        last.lookup_port(data_parallel_rank=2)
    assert not config.loads_for("kv_both")  # enable_lookup false: it only stores
    assert config.saves_for("kv_both")
    assert parse_extra_config({}).loads_for("kv_both")


def test_the_prefill_keys_name_one_writer_topology() -> None:
    """vLLM-Ascend's prefill stage keys and vLLM's prefill TP size keys, as they mean
    there; none set: no writer topology besides the reader's own."""
    assert parse_extra_config({}).writer_topology() is None
    # Set to 1, it names a one-stage writer (which a staged reader reads).
    assert parse_extra_config({"prefill_pp_size": 1}).writer_topology() == WriterTopology(None, 1)
    uneven = parse_extra_config({"prefill_pp_size": 2, "prefill_pp_layer_partition": "3,5"})
    assert uneven.writer_topology() == WriterTopology(None, 2, (3, 5))
    partition = parse_extra_config({"prefill_pp_layer_partition": "3,5"})
    assert partition.writer_topology() == WriterTopology(None, 2, (3, 5))
    # Unset keys are the reader's own: its stages here.
    assert parse_extra_config({"store_tp_size": 2}).writer_topology() == WriterTopology(2, None)
    both = parse_extra_config({"prefill_tp_sizes": [2, 2], "prefill_pp_size": 2})
    assert both.writer_topology() == WriterTopology(2, 2)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("enable_store_tp_lcm", True, "no LCM layout"),
        ("custom_mem_pool", "nvlink", "staging_bytes"),
        ("enable_cross_layers_blocks", True, "in place"),
        ("enable_group_semantics", True, "own object"),
        ("preferred_segment", "10.0.0.2:1234", "MOONCAKE_CONFIG_PATH"),
        ("cache_prefix", "tenant-a", "set namespace"),
    ],
)
def test_vllm_mooncake_layout_keys_are_refused_with_the_reason(
    key: str, value: object, reason: str
) -> None:
    complaint = rf"'{key}' is a key of vLLM's MooncakeStoreConnector.*{reason}"
    with pytest.raises(ValueError, match=complaint):
        parse_extra_config({"use_layerwise": True, key: value})


@pytest.mark.parametrize(
    ("extra", "device", "rdma", "contiguous", "expected"),
    [
        # host caches: one piece per object through staging (or in place)
        ({}, "cpu", False, False, "staged"),
        ({"use_layerwise": True}, "cpu", True, True, "staged"),
        # device caches, layerwise: the layer overlap where pieces are cheap or many anyway
        ({"use_layerwise": True}, "cuda:0", True, False, "layer"),
        ({"use_layerwise": True}, "npu", False, False, "layer"),
        ({"use_layerwise": True}, "cuda:0", True, True, "layer"),
        # ... one piece per object over TCP when every object is one run of memory
        ({"use_layerwise": True}, "cuda:0", False, True, "group"),
        # device caches, whole blocks: nothing to overlap, fewest calls
        ({}, "cuda:0", True, False, "group"),
        ({}, "npu", False, True, "group"),
        # set explicitly: taken as is (layer and group also run on host caches)
        ({"granularity": "layer"}, "cpu", False, True, "layer"),
        ({"granularity": "group", "use_layerwise": True}, "cuda", True, False, "group"),
        ({"granularity": "staged"}, "cpu", False, False, "staged"),
    ],
)
def test_auto_granularity_follows_device_protocol_and_layout(
    extra: dict[str, object], device: str, rdma: bool, contiguous: bool, expected: str
) -> None:
    config = parse_extra_config(extra)
    assert config.pipeline_options(device, rdma, contiguous).granularity == expected


def test_staged_granularity_is_refused_for_device_caches() -> None:
    config = parse_extra_config({"granularity": "staged"})
    with pytest.raises(ValueError, match=r"granularity 'staged'.*'cuda:0'"):
        config.pipeline_options("cuda:0")


def test_ascend_store_connector_config_carries_over() -> None:
    """An AscendStoreConnector extra config, unchanged, with every key it documents."""
    config = parse_extra_config(
        {
            "backend": "mooncake",
            "mooncake_rpc_port": "6000",  # its docs give the port as a string
            "load_async": False,
            "use_layerwise": True,
            "layerwise_prefetch_layers": 1,
            "layerwise_max_transfer_blocks": 4,
            "layerwise_max_transfer_bytes": 0,
            "consumer_is_to_put": True,
            "consumer_is_to_load": False,
            "save_decode_cache": True,
            "discard_partial_chunks": True,
            "h2d_stagger_us": 50,
            "h2d_stagger_group_size": 4,  # read by newer releases
            "h2d_stagger_dynamic_addrs_per_us": 8,
            "h2d_stagger_max_us": 200,
            "layerwise_num_shared_buffers": 2,
            "layerwise_independent_layers": [0],  # physical layer indices
            "prefill_pp_size": 1,
        }
    )
    assert config.lookup_port() == 6000
    assert (config.saves_for("kv_consumer"), config.loads_for("kv_consumer")) == (True, False)
    assert (config.saves_for("kv_producer"), config.loads_for("kv_both")) == (True, True)
    options = config.pipeline_options("cpu")
    assert (options.prefetch_layers, options.max_transfer_blocks) == (1, 4)
    assert options.backlog == 8
    assert parse_extra_config({"_layerwise_backlog": 0}).pipeline_options("cpu").backlog == 0
    assert options.granularity == "staged"
    consumer = parse_extra_config({})
    assert not consumer.saves_for("kv_consumer")
    assert not consumer.loads_for("kv_consumer")


def test_mooncake_json(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "master_server_address": "127.0.0.1:50051",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": "64MB",
                "local_buffer_size": 1 << 20,
            }
        )
    )
    config = mooncake_config_from_env({"MOONCAKE_CONFIG_PATH": str(path)})
    assert config is not None
    assert config.global_segment_size == 64 << 20
    assert mooncake_config_from_env({}) is None
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:1", "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        mooncake_config_from_env({"MOONCAKE_CONFIG_PATH": str(path)})


def test_integrity_is_off_by_default_and_named_by_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ConnectorConfig().integrity_secret_env == ""
    monkeypatch.setenv("HKV_SECRET", "0123456789abcdef0123456789abcdef")
    config = parse_extra_config({"integrity_secret_env": "HKV_SECRET"})
    assert config.pipeline_options("cpu").granularity == "staged"
    with pytest.raises(ValueError, match=r"integrity_secret_env.*'cuda:0'"):
        config.pipeline_options("cuda:0")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"integrity_secret_env": "my secret value!"}, "never the secret itself"),
        ({"integrity_secret_env": "HKV_UNSET_SECRET"}, "HKV_UNSET_SECRET.*unset"),
        ({"integrity_secret_env": "HKV_SHORT"}, "HKV_SHORT.*at least 16 bytes"),
        ({"integrity_secret_env": "HKV_SECRET", "granularity": "layer"}, "granularity 'layer'"),
    ],
)
def test_integrity_settings_that_cannot_work_are_refused(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, object], message: str
) -> None:
    monkeypatch.delenv("HKV_UNSET_SECRET", raising=False)
    monkeypatch.setenv("HKV_SHORT", "short")
    monkeypatch.setenv("HKV_SECRET", "0123456789abcdef0123456789abcdef")
    with pytest.raises(ValueError, match=message):
        parse_extra_config(extra)
