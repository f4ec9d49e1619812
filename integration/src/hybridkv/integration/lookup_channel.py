"""Where the scheduler and worker rank 0 meet for lookups, and who cleans it up.

A fixed loopback port (`lookup_rpc_port`), else a Unix socket in a private directory
named after the instance: worker rank 0 claims it before it listens, the scheduler
removes its path once connected (nobody else may connect, and no file outlives the
instance whose workers may be killed before they could remove it).
"""

from __future__ import annotations

import atexit
from pathlib import Path

from hybridkv.integration.lookup import (
    LOOPBACK,
    claim_socket,
    is_private,
    remove_socket,
    socket_path,
)


class LookupChannel:
    """One instance's lookup endpoint; `port` 0: a Unix socket."""

    def __init__(self, instance: str, port: int) -> None:
        self.instance = instance
        self.socket_path: Path | None = None if port else socket_path(instance)
        self.endpoint = f"tcp://{LOOPBACK}:{port}" if port else f"ipc://{self.socket_path}"

    def address(self) -> str | None:
        """The endpoint once worker rank 0 listens there (None before).

        Not vLLM's connector handshake: under a MultiConnector only the first child's
        handshake metadata reaches the scheduler, so ours could shadow (or be shadowed
        by) NIXL's."""
        path = self.socket_path
        if path is None or (is_private(path.parent) and path.exists()):
            return self.endpoint
        return None

    def answered(self) -> None:
        """The scheduler is connected: the socket's path goes."""
        self.release()

    def claim(self) -> None:
        """Worker rank 0, before it listens: refuses another live instance's socket,
        takes over one a killed instance left."""
        if self.socket_path is not None:
            claim_socket(self.socket_path, self.instance)
            atexit.register(remove_socket, self.socket_path)  # if never shut down

    def release(self) -> None:
        if self.socket_path is not None:
            remove_socket(self.socket_path)
