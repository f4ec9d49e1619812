"""Run a real `mooncake_master` as a child process on free loopback ports.

Used by tests, the demo and the vLLM connector's embedded default. The child's output goes
to a log file (a pipe nobody drains would fill and freeze it); it is stopped by PID, and
any child still running when the interpreter exits is stopped then, so none is orphaned.
A parent killed outright (SIGKILL, the OOM killer) runs no exit handler: children started
from the main thread are asked by the kernel to receive SIGTERM when it dies (Linux's
parent-death signal, which follows the thread that started them, hence the main thread).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from hybridkv.transport.errors import StoreUnavailable

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on right now (callers retry if another process races them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_listening(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def owns_listener(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a TCP socket listening on `port`; None where /proc
    cannot tell (not Linux). A port probed free may be taken before the child binds it:
    then the child exits, and the listener answering there is somebody else's."""
    listening: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                listening.add(f"socket:[{fields[9]}]")
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for descriptor in descriptors:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{descriptor}") in listening:
                return True
    return False


def serves(pid: int, host: str, port: int) -> bool:
    """`pid` accepts connections on host:port (not merely: someone does)."""
    return is_listening(host, port) and owns_listener(pid, port) is not False


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port', got {address!r}")
    return host, int(port)


def find_master_binary() -> Path:
    """`mooncake_master` shipped inside the mooncake wheel, else the one on PATH."""
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "mooncake_master"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    on_path = shutil.which("mooncake_master")
    if on_path is not None:
        return Path(on_path)
    raise StoreUnavailable(
        "mooncake_master not found next to the mooncake package nor on PATH; "
        "install hybridkv-transport[mooncake]"
    )


# Run by the child's own interpreter before it execs the program: arming the signal in
# the forked child (`preexec_fn`) would run Python between fork and exec, which can
# deadlock where the parent has other threads (the vLLM process that embeds a master).
# The signal survives exec; a parent dead before it was armed is caught by its pid.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dying_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv`, run so that the child gets SIGTERM when this process dies; as it is off
    Linux or off the main thread (the signal would follow a thread that exits)."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [sys.executable, "-I", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


_live: set[ChildProcess] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live)
    for child in leftovers:
        child.stop()


class ChildProcess:
    """A child whose output goes to a log file and which is stopped by its PID."""

    def __init__(
        self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path | None
    ) -> None:
        self.name = name
        self._own_log = log_path is None
        if log_path is None:
            fd, raw_path = tempfile.mkstemp(prefix=f"hybridkv-{name}-", suffix=".log")
            os.close(fd)
            log_path = Path(raw_path)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.log_start = log.tell()  # a reused log: what this child writes comes after
            self._popen = subprocess.Popen(
                _dying_with_parent(argv), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        with _live_lock:
            _live.add(self)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def running(self) -> bool:
        return self._popen.poll() is None

    def log_text(self) -> str:
        """What this child wrote to its log (a reused log's earlier lines left out)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll `condition`; stop the child and raise if it exits or time runs out first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if not self.running():
                failure = f"{self.name} exited with {self._popen.returncode} before {what}"
                self.stop(keep_log=True)
                raise StoreUnavailable(f"{failure}; log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop(keep_log=True)
                raise StoreUnavailable(
                    f"{self.name} not {what} after {timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL now, as a crash would (fault tests); a log of our own goes with it."""
        with contextlib.suppress(ProcessLookupError):
            self._popen.send_signal(signal.SIGKILL)
        self._popen.wait()
        self._forget()
        self._drop_log(keep=False)

    def stop(self, timeout_s: float = 10.0, keep_log: bool = False) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; idempotent. A log
        of our own is removed unless the process failed."""
        if self.running():
            self._popen.send_signal(signal.SIGTERM)
            try:
                self._popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
        self._forget()
        self._drop_log(keep_log or self._popen.returncode not in (0, -signal.SIGTERM))

    def _drop_log(self, keep: bool) -> None:
        if self._own_log and not keep:
            self.log_path.unlink(missing_ok=True)

    def _forget(self) -> None:
        with _live_lock:
            _live.discard(self)


_Service = TypeVar("_Service", bound="ServiceProcess")


class ServiceProcess:
    """A started child handed to callers: its PID and log, `.stop()` (SIGTERM) and
    `.kill()` (SIGKILL, as a crash would, for fault tests); a context manager that stops it."""

    def __init__(self, child: ChildProcess) -> None:
        self._child = child

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def log_path(self) -> Path:
        return self._child.log_path

    def running(self) -> bool:
        return self._child.running()

    def kill(self) -> None:
        self._child.kill()

    def stop(self) -> None:
        self._child.stop()

    def __enter__(self: _Service) -> _Service:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class MasterProcess(ServiceProcess):
    """A `mooncake_master` listening on loopback; `.address` is what clients connect to."""

    def __init__(self, child: ChildProcess, host: str, rpc_port: int, metrics_port: int):
        super().__init__(child)
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port

    @classmethod
    def start(
        cls,
        *,
        host: str = LOOPBACK,
        rpc_port: int = 0,
        lease_ttl_ms: int = 5000,
        client_ttl_s: int | None = None,
        eviction_high_watermark_ratio: float = 0.9,
        eviction_ratio: float = 0.1,
        extra_args: Sequence[str] = (),
        etcd_endpoints: str | None = None,
        oplog: bool = True,
        binary: Path | None = None,
        log_path: Path | None = None,
        timeout_s: float = 30.0,
        attempts: int = 3,
    ) -> MasterProcess:
        """Start and wait until it accepts connections (rpc_port 0: pick free ports).

        With `etcd_endpoints` ("host:port;..."), one of several masters that elect a leader
        there (`--enable_ha`): it is returned once its metrics port answers, since a standby
        opens its RPC port only when it leads (`serving()` says when). `oplog` has the
        leader log every metadata change to etcd, so that a successor knows the objects
        stored before it took over; without it they are lost with the leader.
        """
        executable = binary or find_master_binary()
        if rpc_port and is_listening(host, rpc_port):
            # It would fail to bind, and the port's listener would pass for it.
            raise StoreUnavailable(
                f"mooncake_master: {host}:{rpc_port} already accepts connections: another "
                "process listens there"
            )
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": host}
        for attempt in range(1, attempts + 1):
            port = rpc_port or free_port(host)
            metrics_port = free_port(host)
            argv = [
                str(executable),
                f"--rpc_address={host}",
                f"--rpc_port={port}",
                f"--metrics_host={host}",
                f"--metrics_port={metrics_port}",
                f"--eviction_high_watermark_ratio={eviction_high_watermark_ratio}",
                f"--eviction_ratio={eviction_ratio}",
                f"--default_kv_lease_ttl={lease_ttl_ms}",
                "--logtostderr=true",
                *([f"--client_ttl={client_ttl_s}"] if client_ttl_s is not None else []),
                *(_elected(etcd_endpoints, oplog) if etcd_endpoints is not None else []),
                *extra_args,
            ]
            child = ChildProcess("mooncake_master", argv, env, log_path)
            ready_port = port if etcd_endpoints is None else metrics_port
            try:
                child.wait_until(
                    partial(serves, child.pid, host, ready_port), "listening", timeout_s
                )
            except StoreUnavailable:
                if rpc_port or attempt == attempts:
                    raise
                continue  # most likely a port taken between probing and binding
            return cls(child, host, port, metrics_port)
        raise AssertionError("unreachable")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def serving(self) -> bool:
        """Whether it accepts clients now (an elected master: whether it leads)."""
        return self.running() and serves(self.pid, self.host, self.rpc_port)


def _elected(etcd_endpoints: str, oplog: bool) -> list[str]:
    """The flags of a master that is one of several electing a leader in etcd."""
    return [
        "--enable_ha=true",
        f"--etcd_endpoints={etcd_endpoints}",
        *(["--enable_oplog=true"] if oplog else []),
    ]
