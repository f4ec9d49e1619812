"""The raw Mooncake client: finding a release with the calls hybridkv needs, and what it
reads besides its setup arguments (placement of puts, environment defaults).

Mooncake is imported only when a client class is asked for, so importing
hybridkv.transport never needs it.
"""

from __future__ import annotations

import ipaddress
import os
from importlib import metadata
from typing import Any

from hybridkv.transport.config import MooncakeConfig
from hybridkv.transport.errors import UnsupportedClient

# The range/session API (Mooncake PR #2881) plus the whole-object calls hybridkv uses.
REQUIRED_METHODS = (
    "setup",
    "close",
    "register_buffer",
    "unregister_buffer",
    "batch_is_exist",
    "batch_put_from_multi_buffers",
    "batch_get_into_multi_buffers",
    "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
    "batch_remove",
    "remove_by_regex",
)


def mooncake_version() -> str:
    for distribution in (
        "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine",
        "mooncake-transfer-engine-npu",
    ):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown mooncake version"


def load_client_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise UnsupportedClient(
            f"cannot import mooncake.store ({exc}); install hybridkv-transport[mooncake] "
            "(and libibverbs1, which the wheel links even without RDMA)"
        ) from exc
    missing = [name for name in REQUIRED_METHODS if not hasattr(MooncakeDistributedStore, name)]
    if missing:
        raise UnsupportedClient(
            f"{mooncake_version()} lacks {', '.join(missing)}; hybridkv needs the "
            "range/session API (mooncake-transfer-engine >= 0.3.13)"
        )
    return MooncakeDistributedStore


def put_placement(client: Any, config: MooncakeConfig) -> Any:
    """Mooncake's ReplicateConfig for `preferred_segment` / `prefer_alloc_in_same_node`."""
    if not config.preferred_segment and not config.prefer_alloc_in_same_node:
        return None
    from mooncake.store import ReplicateConfig

    placement = ReplicateConfig()
    if config.preferred_segment is True:
        placement.preferred_segment = client.get_hostname()  # this process's own segment
    elif config.preferred_segment:
        placement.preferred_segment = config.preferred_segment
    placement.prefer_alloc_in_same_node = config.prefer_alloc_in_same_node
    return placement


# Mooncake's own deadlines, 30 s each by default, all set from `store_timeout_s`: a
# master's reply, and a holder's status frame or progress on a transfer (past it the
# transfer engine drops the connection, so a late reply never writes into the buffer).
STORE_TIMEOUT_VARIABLES = {
    "MC_RPC_TIMEOUT_MS": 1000,
    "MC_TCP_STATUS_TIMEOUT_SEC": 1,
    "MC_TCP_PROGRESS_TIMEOUT_SEC": 1,
}


def prepare_environment(config: MooncakeConfig) -> None:
    """What the client reads from the environment: its deadlines (from the config, read
    by each client at its setup), and defaults unless the user chose otherwise."""
    for variable, per_second in STORE_TIMEOUT_VARIABLES.items():
        os.environ[variable] = str(config.store_timeout_s * per_second)
    # One setup attempt: a dead master then fails in seconds, not after 20 x 4.4 s.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    # Without it the transfer engine advertises the first NIC's address, not the host asked
    # for, and loopback-only pools break.
    if _is_ipv4(config.local_hostname):
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True
