"""MooncakeConfig: Mooncake's own JSON files load; bad values are named, never guessed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.transport.config import MooncakeConfig, parse_size
from hybridkv.transport.master_address import ElectedMaster, parse_master_address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MB", 512 << 20),
        ("512MiB", 512 << 20),
        ("3.125 GB", int(3.125 * (1 << 30))),
        ("1gb", 1 << 30),
        ("16m", 16 << 20),
        ("4096", 4096),
        ("100b", 100),
        ("2T", 2 << 40),
    ],
)
def test_sizes_read_like_mooncake(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@given(st.integers(0, 1 << 50))
def test_int_sizes_are_taken_as_bytes(size: int) -> None:
    assert parse_size(size) == size
    assert parse_size(str(size)) == size


@pytest.mark.parametrize("bad", ["", "MB", "12 parsecs", "-5MB", True, 1.5, -1])
def test_unreadable_sizes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)  # type: ignore[arg-type]


def test_mooncake_example_config_file_loads(tmp_path: Path) -> None:
    """The example from Mooncake's mooncake_config.py docstring, sizes as strings."""
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "localhost",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "3GB",
                "local_buffer_size": 1073741824,
                "protocol": "tcp",
                "device_name": None,
                "master_server_address": "localhost:8081",
                "enable_ssd_offload": False,
                "ssd_offload_path": "",
                "tenant_id": "default",
                "enable_client_http_server": False,
                "client_http_port": 9300,
            }
        )
    )
    config = MooncakeConfig.from_json_file(path)
    assert config.global_segment_size == 3 << 30
    assert config.local_buffer_size == 1 << 30
    assert config.device_name == ""
    assert config.master_server_address == "localhost:8081"


def test_the_files_of_vllm_and_vllm_ascend_load_unchanged(tmp_path: Path) -> None:
    """vLLM's MooncakeStoreConnector reads `mode` and `enable_offload`; vllm-ascend's
    AscendStoreConnector `preferred_segment` (true: its own) and `prefer_alloc_in_same_node`.
    Switching connectors keeps the file."""
    vllm = {
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": "512MB",
        "enable_offload": True,
    }
    ascend = {
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "ascend",
        "device_name": "",
        "master_server_address": "127.0.0.1:50088",
        "global_segment_size": "1GB",
        "local_buffer_size": "64MB",
        "preferred_segment": True,
        "prefer_alloc_in_same_node": True,
    }
    for name, values in (("vllm", vllm), ("ascend", ascend)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(values))
        config = MooncakeConfig.from_json_file(path)
        assert config.master_server_address == values["master_server_address"]
    assert MooncakeConfig.from_mapping(vllm).mode == "standalone-store"
    placed = MooncakeConfig.from_mapping(ascend)
    assert placed.preferred_segment is True
    assert placed.prefer_alloc_in_same_node is True
    named = MooncakeConfig.from_mapping({**ascend, "preferred_segment": "10.0.0.2:12345"})
    assert named.preferred_segment == "10.0.0.2:12345"
    # A tenant reads as vLLM reads it (stripped; null or blank: the default one), so both
    # connectors join the same tenant; anything else not a string fails.
    for tenant in (None, "", "  "):
        assert MooncakeConfig.from_mapping({**vllm, "tenant_id": tenant}).tenant_id == "default"
    assert MooncakeConfig.from_mapping({**vllm, "tenant_id": " team "}).tenant_id == "team"
    for tenant in (7, 0, False):
        with pytest.raises(ValueError, match="tenant_id"):
            MooncakeConfig.from_mapping({**vllm, "tenant_id": tenant})


def test_defaults_need_only_the_master() -> None:
    config = MooncakeConfig.from_mapping({"master_server_address": "127.0.0.1:5"})
    assert config.metadata_server == "P2PHANDSHAKE"
    assert config.protocol == "tcp"
    assert config.local_hostname == "127.0.0.1"


def test_elected_masters_are_found_through_their_etcd_endpoints() -> None:
    """Mooncake's high-availability form: the client asks etcd which master leads."""
    address = "etcd://10.0.0.2:2379;10.0.0.3:2379"
    config = MooncakeConfig.from_mapping({"master_server_address": address})
    assert config.master_server_address == address  # handed to Mooncake unchanged
    master = parse_master_address(address)
    assert isinstance(master, ElectedMaster)
    assert master.endpoints == [("10.0.0.2", 2379), ("10.0.0.3", 2379)]
    assert "etcd 10.0.0.2:2379;10.0.0.3:2379" in master.describe()


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"master_server_address": "h:1", "mastr": 1, "zz_top": 2}))
    with pytest.raises(ValueError, match=r"c\.json: unknown Mooncake config keys: mastr, zz_top"):
        MooncakeConfig.from_json_file(path)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({}, "needs master_server_address"),
        ({"master_server_address": "nohost"}, "host:port"),
        ({"master_server_address": "h:99999"}, "host:port"),
        ({"master_server_address": "etcd://"}, "names no etcd endpoint"),
        ({"master_server_address": "etcd://h:1;nohost"}, "host:port"),
        ({"master_server_address": "h:1", "global_segment_size": "1MB"}, "16 MiB"),
        ({"master_server_address": "h:1", "local_buffer_size": 0}, "local_buffer_size"),
        ({"master_server_address": "h:1", "protocol": "RDMA"}, "case-sensitively"),
        ({"master_server_address": "h:1", "local_hostname": " "}, "local_hostname"),
        ({"master_server_address": "h:1", "global_segment_size": "lots"}, "global_segment_size"),
        ({"master_server_address": "h:1", "client_http_port": "80"}, "int"),
        ({"master_server_address": "h:1", "enable_ssd_offload": True}, "ssd_offload_path"),
        (
            {"master_server_address": "h:1", "mode": "embedded", "global_segment_size": 0},
            "positive",
        ),
        ({"master_server_address": "h:1", "mode": "standalone-store"}, "must be 0"),
        ({"master_server_address": "h:1", "mode": "shared"}, "mode"),
        (
            {"master_server_address": "h:1", "preferred_segment": True, "global_segment_size": 0},
            "lends none",
        ),
        ({"master_server_address": "h:1", "store_timeout_s": 0}, "store_timeout_s"),
        ({"master_server_address": "h:1", "store_timeout_s": 86401}, "store_timeout_s"),
        ({"master_server_address": "h:1", "store_timeout_s": 2.5}, "int"),
    ],
)
def test_bad_values_are_named(values: dict[str, object], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        MooncakeConfig.from_mapping(values)


def test_a_file_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        MooncakeConfig.from_json_file(path)
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        MooncakeConfig.from_json_file(path)
