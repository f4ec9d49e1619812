"""What a peer that reaches a client's Mooncake ports can do to it (docs/security.md).

A credential-less process with `mooncake.engine.TransferEngine` writes to every listening
port of this test process: Mooncake accepts writes into registered memory only, and over
TCP hybridkv registers none of the memory it moves (caches, staging, tag headers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _engine_model import Caches

from hybridkv.transport import mooncake_store
from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.master import MasterProcess
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.testing import mooncake_config

ATTACKER = textwrap.dedent(
    """
    import sys
    from mooncake.engine import TransferEngine
    port, targets = sys.argv[1], [int(a) for a in sys.argv[2:]]
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buffer = engine.allocate_managed_buffer(4096)
    engine.write_bytes_to_buffer(buffer, bytes([7]) * 4096, 4096)
    for target in targets:
        engine.transfer_sync_write(f"127.0.0.1:{port}", buffer, target, 4096)
    """
)


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            found.append((_address(address, width), int(port, 16)))
    return found


def _address(hexed: str, width: int) -> str:
    if width == 8:
        return ".".join(str(b) for b in reversed(bytes.fromhex(hexed)))
    return "::" if int(hexed, 16) == 0 else hexed


def attack(ports: list[int], targets: list[int]) -> None:
    """Write to every target through every port, one attacker per port (a write Mooncake
    refused can leave the attacker's connection unusable for the next one)."""
    for port in ports:
        argv = [sys.executable, "-c", ATTACKER, str(port), *map(str, targets)]
        subprocess.run(argv, capture_output=True, timeout=60, check=True)


def test_a_peer_cannot_write_into_the_caches_a_tcp_client_moves(
    mooncake_master: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's caches stay untouched; memory registered as hybridkv registered its
    caches before (a client that registers over TCP) is written: the attack works."""
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    monkeypatch.setattr(mooncake_store, "UNREGISTERED_PROTOCOLS", frozenset())
    registering = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    caches = Caches(num_blocks=8, seed=3)
    caches.fill()
    before = {name: array.copy() for name, array in caches.arrays.items()}
    control = np.zeros(4096, dtype=np.uint8)
    try:
        with TransferEngine(store, caches.layouts, PipelineOptions(granularity="staged")):
            registering.register_buffer(control.ctypes.data, control.nbytes)
            ports = [port for _, port in listening(os.getpid())]
            targets = [array.ctypes.data for array in caches.arrays.values()]
            attack(ports, [control.ctypes.data, *targets])
            registering.unregister_buffer(control.ctypes.data)
    finally:
        registering.close()
        store.close()
    assert (control == 7).all()
    for name, array in caches.arrays.items():
        assert np.array_equal(array, before[name]), name


@pytest.mark.xfail(
    strict=True,
    reason="Mooncake 0.3.13 listens on every address (transfer: 0.0.0.0, handshake: ::) "
    "whatever local_hostname and MC_TCP_BIND_ADDRESS say: firewall the ports instead",
)
def test_a_client_listens_on_its_configured_address_only(mooncake_master: MasterProcess) -> None:
    earlier = set(listening(os.getpid()))
    store = MooncakeStore.connect(mooncake_config(mooncake_master.address))
    try:
        opened = set(listening(os.getpid())) - earlier
    finally:
        store.close()
    assert opened
    assert {address for address, _ in opened} == {"127.0.0.1"}
