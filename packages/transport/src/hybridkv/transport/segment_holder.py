"""Start and stop a segment holder process (`python -m hybridkv.transport.holder`), and the
configuration it runs with."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridkv.transport.config import MooncakeConfig, read_json_object
from hybridkv.transport.master import LOOPBACK, ChildProcess, ServiceProcess

READY_LINE = "ready"  # what the holder prints once its segment is mounted
# A holder stages nothing of its own: a smaller client buffer than a vLLM worker's.
HOLDER_DEFAULTS: dict[str, Any] = {"local_buffer_size": 16 << 20, "local_hostname": LOOPBACK}


def holder_config(path: str | Path | None, overrides: Mapping[str, Any]) -> MooncakeConfig:
    """The holder's settings: `HOLDER_DEFAULTS`, then the Mooncake JSON file at `path` (the
    format `MOONCAKE_CONFIG_PATH` names for every other component), then `overrides` (its
    command-line flags, by Mooncake field name). A holder must lend memory."""
    values: dict[str, Any] = dict(HOLDER_DEFAULTS)
    if path is not None:
        values.update(read_json_object(path))
    values.update(overrides)
    where = f"{path}: " if path is not None else ""
    try:
        config = MooncakeConfig.from_mapping(values)
    except ValueError as exc:
        raise ValueError(f"{where}{exc}") from exc
    if config.global_segment_size == 0:
        raise ValueError(
            f"{where}global_segment_size must be positive: lending memory is all a holder does"
        )
    return config


class SegmentHolder(ServiceProcess):
    """A running holder process; `.stop()` ends it (SIGTERM), `.kill()` crashes it (its
    objects become unreadable)."""

    def __init__(self, child: ChildProcess, master_address: str, size: int) -> None:
        super().__init__(child)
        self.master_address = master_address
        self.size = size

    @classmethod
    def start(
        cls,
        master_address: str | None = None,
        size: int | str | None = None,
        *,
        hostname: str = LOOPBACK,
        log_path: Path | None = None,
        timeout_s: float = 60.0,
        populate: bool = True,
        config_path: Path | None = None,
        http_port: int | None = None,
    ) -> SegmentHolder:
        """Spawn a holder and return once its segment is mounted (and, with `populate`,
        every page of it mapped). `master_address` and `size` override the Mooncake JSON
        at `config_path`; `http_port` serves `/health` and `/metrics` on `hostname`."""
        overrides: dict[str, Any] = {"local_hostname": hostname}
        if master_address is not None:
            overrides["master_server_address"] = master_address
        if size is not None:
            overrides["global_segment_size"] = size
        config = holder_config(config_path, overrides)  # refused here, not in the child
        argv = [
            sys.executable, "-m", "hybridkv.transport.holder", "--hostname", hostname,
            "--master", config.master_server_address,
            "--segment-size", str(config.global_segment_size),
        ]  # fmt: skip
        if config_path is not None:
            argv += ["--config", str(config_path)]
        if http_port is not None:
            argv += ["--http-host", hostname, "--http-port", str(http_port)]
        if not populate:
            argv.append("--no-populate")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": hostname, "PYTHONUNBUFFERED": "1"}
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        child = ChildProcess("segment-holder", argv, env, log_path)
        child.wait_until(
            lambda: any(line.strip() == READY_LINE for line in child.log_text().splitlines()),
            "ready",
            timeout_s,
        )
        return cls(child, config.master_server_address, config.global_segment_size)
