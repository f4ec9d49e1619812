"""Mooncake masters with high availability: two masters elect a leader in etcd, clients
name etcd (`etcd://host:port`), the leader is killed outright and the standby takes over.

Measured here: the killed leader's etcd lease runs out ~4-5 s later, the standby then
warms up 5 s before it serves; the client follows it by itself."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hybridkv.transport.errors import StoreUnavailable
from hybridkv.transport.etcd_process import EtcdProcess, find_etcd_binary
from hybridkv.transport.master import MasterProcess
from hybridkv.transport.testing import (
    StartHolder,
    StartMaster,
    require_mooncake,
    require_real,
)

ELECTION_TIMEOUT_S = 60.0  # lease expiry + warmup, measured ~10 s; generous for busy CI

# A client in a process of its own: it stores objects, waits to be told the leader is dead,
# then puts until the new leader answers and reports what it reads. It exits without
# close(): closing a client of elected masters waits ~30 s on its etcd watch.
CLIENT = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    from hybridkv.transport.errors import Status
    from hybridkv.transport.mooncake_store import MooncakeStore
    from hybridkv.transport.testing import mooncake_config

    address, timeout_s = sys.argv[1], float(sys.argv[2])
    store = MooncakeStore.connect(mooncake_config(address, global_segment_size=0))
    data = {f"k{seed}": np.random.default_rng(seed).integers(0, 256, 1 << 18, dtype=np.uint8)
            for seed in range(5)}

    def put(key):
        return store.batch_put_whole([key], [[data[key].ctypes.data]], [[data[key].nbytes]])[0]

    def intact(key):
        out = np.zeros_like(data[key])
        got = store.batch_get_whole([key], [[out.ctypes.data]], [[out.nbytes]])[0]
        return got is Status.OK and bool(np.array_equal(out, data[key]))

    old, new = ["k0", "k1", "k2", "k3"], "k4"
    print(json.dumps({"stored": [put(key).name for key in old]}), flush=True)
    sys.stdin.readline()  # the leader is dead
    started = time.monotonic()
    while put(new) is not Status.OK and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
    print(json.dumps({
        "put_after_s": round(time.monotonic() - started, 1),
        "new_intact": intact(new),
        "old_readable": store.batch_is_readable(old),
        "old_intact": [intact(key) for key in old],
    }), flush=True)
    os._exit(0)
    """
)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float) -> float:
    """Seconds until `condition` held; TimeoutError past `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


def gauge(master: MasterProcess, name: str) -> int | None:
    """A value from the master's Prometheus page; None while the page lacks it (a standby
    shows its log's gauges once it follows the log)."""
    url = f"http://{master.host}:{master.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(f"{name} "):
                return int(float(line.split()[1]))
    return None


def wait_until_replicated(standby: MasterProcess, quiet_s: float = 2.5) -> None:
    """Until the standby has applied the leader's operation log as far as it goes: its
    count of applied entries positive and unchanged over `quiet_s` (it polls etcd once a
    second; the leader's own sequence gauge stays 0 in this release's batch mode)."""
    applied, since = -1, time.monotonic()
    deadline = since + 30
    while time.monotonic() < deadline:
        now = gauge(standby, "ha_oplog_applied_entries_total") or 0
        if now != applied:
            applied, since = now, time.monotonic()
        elif applied > 0 and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the standby's applied log still moving or empty ({applied}) after 30 s")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    require_mooncake()
    try:
        find_etcd_binary()
    except StoreUnavailable as exc:
        require_real(str(exc))
    with EtcdProcess.start(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log") as etcd:
        yield etcd


@pytest.mark.parametrize("oplog", [True, False], ids=["oplog", "no-oplog"])
def test_a_standby_master_takes_over_from_a_killed_leader_and_clients_carry_on(
    oplog: bool,
    etcd: EtcdProcess,
    start_mooncake_master: StartMaster,
    start_segment_holder: StartHolder,
) -> None:
    """New puts and gets work once the standby leads. Objects stored before survive the
    failover with the leader's operation log in etcd (`--enable_oplog`), and are lost
    without it: the new leader starts with empty metadata."""
    leader = start_mooncake_master(etcd_endpoints=etcd.endpoint, oplog=oplog)
    wait_for(leader.serving, "the first master leads", ELECTION_TIMEOUT_S)
    standby = start_mooncake_master(etcd_endpoints=etcd.endpoint, oplog=oplog)
    address = f"etcd://{etcd.endpoint}"
    holder = start_segment_holder(address, "32MB")
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, address, str(ELECTION_TIMEOUT_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert client.stdin is not None
    assert client.stdout is not None
    try:
        assert json.loads(client.stdout.readline()) == {"stored": ["OK"] * 4}
        assert not standby.serving()
        if oplog:
            # The log is shipped in batches, about once a second: what the leader had not
            # written out when it died is lost with it. Let it catch up first.
            wait_until_replicated(standby)

        leader.kill()
        took_over = wait_for(standby.serving, "the standby leads", ELECTION_TIMEOUT_S)
        client.stdin.write("leader killed\n")
        client.stdin.flush()
        after = json.loads(client.stdout.readline())
        print(f"standby led after {took_over:.1f} s; then {after}")
        assert after["new_intact"]
        assert after["old_readable"] == [oplog] * 4
        assert after["old_intact"] == [oplog] * 4
        assert client.wait(timeout=30) == 0
    finally:
        client.kill()
        client.wait()
        holder.kill()  # its close() too would wait ~30 s on etcd
