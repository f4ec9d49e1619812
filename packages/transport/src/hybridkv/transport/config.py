"""Mooncake client settings, validated once at the edge.

The field names are Mooncake's own (its `mooncake_config.py` JSON files), so an existing
Mooncake config file works unchanged; sizes may be written as in Mooncake ("512MB", "4 GiB")
or as byte counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import msgspec

from hybridkv.transport.master_address import parse_master_address

MIN_SEGMENT_SIZE = 16 << 20  # smaller segments make Mooncake's setup fail with -600
MAX_STORE_TIMEOUT_S = 86400  # a day: longer is a typo, not a deadline

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(value: int | str, field: str = "size") -> int:
    """Bytes from an int or a Mooncake size string; "512MB" and "512MiB" are both 512 << 20."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{field} must be a byte count or a string like '512MB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_PATTERN.match(value)
        if match is None:
            raise ValueError(f"{field}: cannot read {value!r} as a size (e.g. 1048576, '512MB')")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size < 0:
        raise ValueError(f"{field} must not be negative, got {value!r}")
    return size


class MooncakeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one process joins a Mooncake pool.

    `global_segment_size` is the memory this process lends to the pool (0: store only into
    other processes' segments, so written objects outlive this process);
    `local_buffer_size` is the client's staging buffer. `preferred_segment` (a segment
    name, or true for this process's own) and `prefer_alloc_in_same_node` steer where new
    objects are placed. `store_timeout_s` bounds every call to the pool (see
    `mooncake_client.prepare_environment`). `mode` and `enable_offload` are the fields vLLM's
    MooncakeStoreConnector reads, so its files load unchanged: `mode` is checked against
    `global_segment_size` as vLLM checks it; `enable_offload` describes the SSD tier of a
    standalone store process, which this client does not drive.
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 512 << 20
    local_buffer_size: int = 128 << 20
    local_hostname: str = "127.0.0.1"
    tenant_id: str = "default"
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    enable_client_http_server: bool = False
    client_http_port: int = 9300
    preferred_segment: bool | str = False
    prefer_alloc_in_same_node: bool = False
    mode: Literal["embedded", "standalone-store"] | None = None
    enable_offload: bool = False
    store_timeout_s: int = 10

    def __post_init__(self) -> None:
        parse_master_address(self.master_server_address)  # a ValueError naming what is wrong
        for field in ("metadata_server", "local_hostname", "protocol", "tenant_id"):
            if not getattr(self, field).strip():
                raise ValueError(f"{field} must not be empty")
        if self.protocol != self.protocol.lower():
            raise ValueError(f"protocol is matched case-sensitively: use {self.protocol.lower()!r}")
        for field in ("global_segment_size", "local_buffer_size"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must not be negative, got {getattr(self, field)}")
        if 0 < self.global_segment_size < MIN_SEGMENT_SIZE:
            raise ValueError(
                f"global_segment_size must be 0 (lend nothing) or at least 16 MiB "
                f"(Mooncake's minimum), got {self.global_segment_size}"
            )
        if self.local_buffer_size == 0:
            raise ValueError("local_buffer_size must be positive: the client stages through it")
        if self.enable_ssd_offload and not self.ssd_offload_path:
            raise ValueError("enable_ssd_offload needs ssd_offload_path")
        timeout = self.store_timeout_s
        if isinstance(timeout, bool) or not 1 <= timeout <= MAX_STORE_TIMEOUT_S:
            raise ValueError(
                f"store_timeout_s must be a whole number of seconds from 1 to "
                f"{MAX_STORE_TIMEOUT_S}, got {timeout!r}"
            )
        if not 0 < self.client_http_port < 65536:
            raise ValueError(f"client_http_port out of range: {self.client_http_port}")
        if self.preferred_segment is True and self.global_segment_size == 0:
            raise ValueError(
                "preferred_segment true places objects in this process's own segment, but "
                "it lends none (global_segment_size 0): name a segment ('host:port') instead"
            )
        if self.mode == "embedded" and self.global_segment_size == 0:
            raise ValueError(
                "mode 'embedded' lends this process's memory: global_segment_size must be positive"
            )
        if self.mode == "standalone-store" and self.global_segment_size != 0:
            raise ValueError(
                "mode 'standalone-store' lends nothing (another process holds the pool): "
                f"global_segment_size must be 0, got {self.global_segment_size}"
            )

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> MooncakeConfig:
        """Build from Mooncake-style keys, naming every key it does not know."""
        known = set(cls.__struct_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown Mooncake config keys: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        if "master_server_address" not in values:
            raise ValueError(
                "Mooncake config needs master_server_address ('host:port' or 'etcd://host:port')"
            )
        fields = dict(values)
        if fields.get("device_name") is None:
            fields.pop("device_name", None)  # Mooncake writes null for "no RDMA device"
        tenant = fields.get("tenant_id")
        if isinstance(tenant, str):
            fields["tenant_id"] = tenant = tenant.strip()  # read as vLLM reads its files
        if tenant is None or tenant == "":
            fields.pop("tenant_id", None)  # null or blank: the default tenant, as in vLLM
        for field in ("global_segment_size", "local_buffer_size"):
            if field in fields:
                fields[field] = parse_size(fields[field], field)
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid Mooncake config: {exc}") from exc

    @classmethod
    def from_json_file(cls, path: str | Path) -> MooncakeConfig:
        """Read a Mooncake JSON config file (the format `MOONCAKE_CONFIG_PATH` points to)."""
        values = read_json_object(path)
        try:
            return cls.from_mapping(values)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in the file at `path`; ValueError naming the file otherwise."""
    try:
        values = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(values).__name__}")
    return values
