"""Test hosts on one machine: each a network namespace with an address of its own.

Every host gets a veth whose other end joins a bridge that lives in a namespace of its
own too, so the machine's own namespace, interfaces and routes are never touched and no
packet can leave the machine. A process started on a host sees only that host's
interface: it reaches the others by address, never through a shared loopback. Needs root
and iproute2's `ip`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

SUBNET = "10.77.0"  # a /24 that exists only on the bridge below
FIRST_HOST = 2


def missing_capability() -> str | None:
    """Why this machine cannot make test hosts, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` is not installed (Debian package iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Host:
    """One test host: its namespace and address."""

    def __init__(self, namespace: str, address: str) -> None:
        self.namespace = namespace
        self.address = address

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def python(self, code: str, *args: str, timeout_s: float = 30.0) -> str:
        """Run Python `code` on this host; its standard output."""
        done = subprocess.run(
            self.argv([sys.executable, "-c", code, *args]),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"on {self.namespace}: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def listens(self, pid: int, port: int) -> bool:
        """Whether a TCP socket listens on `port` in the namespace of process `pid`."""
        try:
            rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
        except OSError:
            return False
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
        return False


class TestNetwork:
    """Hosts on one private bridge; the link between two of them can be cut."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, names: Sequence[str]) -> None:
        tag = f"hkv{os.getpid() % 100000}"
        self._lan = f"{tag}-lan"
        self._namespaces = [self._lan]
        self.hosts: dict[str, Host] = {}
        try:
            _ip("netns", "add", self._lan)
            _ip("-n", self._lan, "link", "set", "lo", "up")
            _ip("-n", self._lan, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._lan, "link", "set", "br0", "up")
            for index, name in enumerate(names, start=FIRST_HOST):
                self.hosts[name] = self._add_host(f"{tag}-{name}", index)
        except BaseException:
            self.close()
            raise

    def _add_host(self, namespace: str, index: int) -> Host:
        _ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        port = f"p{index}"
        # Both ends are born inside namespaces: the machine's own never sees them.
        _ip("-n", self._lan, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)  # fmt: skip
        _ip("-n", self._lan, "link", "set", port, "master", "br0", "up")
        address = f"{SUBNET}.{index}"
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return Host(namespace, address)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between hosts `a` and `b` (both ways), as a failed link."""
        for here, there in ((a, b), (b, a)):
            _ip("-n", self.hosts[here].namespace, "route", "add", "blackhole",
                f"{self.hosts[there].address}/32")  # fmt: skip

    def mend(self, a: str, b: str) -> None:
        for here, there in ((a, b), (b, a)):
            _ip("-n", self.hosts[here].namespace, "route", "del", "blackhole",
                f"{self.hosts[there].address}/32")  # fmt: skip

    def close(self) -> None:
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._namespaces.clear()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s} s")
        time.sleep(0.1)
