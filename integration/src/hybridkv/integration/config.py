"""Connector settings, validated once at start-up so that a typo never runs silently.

Two sources: vLLM's `kv_connector_extra_config` (this connector's own keys) and the Mooncake
JSON file named by `MOONCAKE_CONFIG_PATH` (Mooncake's own field names, so an existing file
works unchanged). Anything unknown or out of range stops start-up with an error naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from hybridkv.transport.config import MooncakeConfig

MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys of `kv_connector_extra_config`, with their defaults."""

    use_layerwise: bool = False
    layerwise_prefetch_layers: Positive = 2
    layerwise_max_transfer_blocks: NonNegative = 0
    layerwise_max_transfer_bytes: NonNegative = 0
    # Loads run in the background while the request waits (vLLM's async load path).
    load_async: bool = False
    # 0: worker rank 0 picks a free loopback port and publishes it to the scheduler.
    lookup_rpc_port: Port = 0
    lookup_timeout_ms: Positive = 5000
    # Objects are whole blocks addressed by content, so a partial block is never stored;
    # the key exists so AscendStoreConnector configs carry over.
    discard_partial_chunks: bool = True
    # Keeps deployments that share one pool apart (also folded into every block hash).
    namespace: str = ""
    # AscendStoreConnector's backend selector; only Mooncake is offered.
    backend: Literal["mooncake"] = "mooncake"
    # "memory" is an in-process store for tests: it cannot share KV between processes.
    store: Literal["mooncake", "memory"] = "mooncake"

    def __post_init__(self) -> None:
        if not self.discard_partial_chunks:
            raise ValueError(
                "discard_partial_chunks=false is not supported: "
                "hybridkv stores whole blocks only (a partial block has no content key)"
            )
        if "@" in self.namespace:
            raise ValueError(f"namespace must not contain '@': {self.namespace!r}")


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Validate `kv_connector_extra_config`; errors name the offending key."""
    try:
        return msgspec.convert(dict(extra or {}), ConnectorConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_connector_extra_config: {exc}") from exc


def mooncake_config_from_env(environ: Mapping[str, str] = os.environ) -> MooncakeConfig | None:
    """The Mooncake settings at `MOONCAKE_CONFIG_PATH`; None means "start an embedded master"."""
    path = environ.get(MOONCAKE_CONFIG_ENV)
    if not path:
        return None
    return MooncakeConfig.from_json_file(path)
