"""Where the scheduler and worker rank 0 meet for lookups, and who cleans it up.

A fixed loopback port (`lookup_rpc_port`), else a Unix socket in a private directory
named after the instance: worker rank 0 claims it before it listens, the scheduler
removes its path once connected (nobody else may connect, and no file outlives the
instance whose workers may be killed before they could remove it).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import socket
import stat
import tempfile
from pathlib import Path

LOOPBACK = "127.0.0.1"
_MAX_SOCKET_PATH = 107  # Linux's sun_path, less its terminating NUL


def socket_path(instance: str) -> Path:
    """Where worker rank 0 of `instance` listens for its scheduler (no fixed port set)."""
    digest = hashlib.sha256(instance.encode()).hexdigest()[:16]  # short: sun_path is small
    path = Path(tempfile.gettempdir()) / f"hybridkv-lookup-{digest}" / "sock"
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ValueError(
            f"the lookup socket {path} is longer than a Unix socket path may be "
            f"({_MAX_SOCKET_PATH} bytes): set TMPDIR shorter, or set lookup_rpc_port"
        )
    return path


def is_private(directory: Path) -> bool:
    """A directory of this user's that no other user may enter (not a link to one)."""
    try:
        status = directory.lstat()
    except FileNotFoundError:
        return False
    return (
        stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid() and not status.st_mode & 0o077
    )


def make_private(directory: Path) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    if not is_private(directory):
        raise PermissionError(
            f"{directory} must be a directory of this user's alone (mode 0700) to hold the "
            f"lookup socket: remove it, or set TMPDIR elsewhere, or set lookup_rpc_port"
        )


def claim_socket(path: Path, instance: str) -> None:
    """Ready the socket's private directory for `instance`'s worker to bind in.

    A socket some process still listens on belongs to a running instance of the same id
    (two instances on this host given one engine id): binding over it would hand that
    instance's scheduler our answers and our cache resets. A socket nobody listens on is a
    killed instance's, taken over.
    """
    make_private(path.parent)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return
    raise RuntimeError(
        f"hybridkv: another process listens for lookups at {path}, an instance with the id "
        f"{instance!r}: give each instance on this host its own kv_transfer_config "
        "engine_id, or set lookup_rpc_port"
    )


def remove_socket(path: Path) -> None:
    """The socket file and its directory, once the server is closed (ZMQ leaves both)."""
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: not ours to remove
        path.parent.rmdir()


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
