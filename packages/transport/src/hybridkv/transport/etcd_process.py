"""Run a one-member etcd as a child process on free loopback ports (tests, demos).

Mooncake masters in high-availability mode elect their leader in etcd and clients read
there which one leads. A single member is enough to exercise that on one machine; a
deployment runs an etcd cluster of three or five.
"""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path

from hybridkv.transport.errors import StoreUnavailable
from hybridkv.transport.master import (
    LOOPBACK,
    ChildProcess,
    ServiceProcess,
    free_port,
    serves,
)


def find_etcd_binary() -> Path:
    on_path = shutil.which("etcd")
    if on_path is None:
        raise StoreUnavailable("etcd not found on PATH (Debian package etcd-server)")
    return Path(on_path)


class EtcdProcess(ServiceProcess):
    """A running etcd; `.endpoint` ("host:port") is what masters and clients are given."""

    def __init__(self, child: ChildProcess, host: str, client_port: int, data_dir: Path):
        super().__init__(child)
        self.host = host
        self.client_port = client_port
        self.data_dir = data_dir

    @classmethod
    def start(
        cls,
        *,
        data_dir: Path,
        host: str = LOOPBACK,
        log_path: Path | None = None,
        timeout_s: float = 30.0,
    ) -> EtcdProcess:
        """Start and wait until it accepts clients; its data goes to `data_dir`."""
        binary = find_etcd_binary()
        client_port, peer_port = free_port(host), free_port(host)
        clients, peers = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
        argv = [
            str(binary), "--name", "hybridkv", "--data-dir", str(data_dir),
            "--listen-client-urls", clients, "--advertise-client-urls", clients,
            "--listen-peer-urls", peers, "--initial-advertise-peer-urls", peers,
            "--initial-cluster", f"hybridkv={peers}",
        ]  # fmt: skip
        child = ChildProcess("etcd", argv, {**os.environ}, log_path)
        child.wait_until(partial(serves, child.pid, host, client_port), "listening", timeout_s)
        return cls(child, host, client_port, data_dir)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"
