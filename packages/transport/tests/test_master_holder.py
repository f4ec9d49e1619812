"""MasterProcess and SegmentHolder: real processes that start, serve and stop cleanly,
and a holder keeps what a finished writer stored. A holder reads Mooncake's config file
(flags override it) and reports health and metrics over HTTP."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from _proc import resident_bytes

from hybridkv.transport import master as master_module
from hybridkv.transport.errors import Status, StoreUnavailable
from hybridkv.transport.holder import parse_args
from hybridkv.transport.holder_http import HolderState
from hybridkv.transport.master import (
    LOOPBACK,
    MasterProcess,
    free_port,
    is_listening,
    owns_listener,
)
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.segment_holder import SegmentHolder, holder_config
from hybridkv.transport.testing import (
    StartHolder,
    StartMaster,
    mooncake_config,
    require_mooncake,
)

# A writer process: stores one object whole and one through a ranged session, then exits.
WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from hybridkv.transport.mooncake_store import MooncakeStore
    from hybridkv.transport.testing import mooncake_config

    master, segment, whole_key, ranged_key = sys.argv[1], int(sys.argv[2]), *sys.argv[3:5]
    data = np.random.default_rng(42).integers(0, 256, 1 << 20, dtype=np.uint8)
    store = MooncakeStore.connect(mooncake_config(master, global_segment_size=segment))
    results = store.batch_put_whole([whole_key], [[data.ctypes.data]], [[data.nbytes]])
    half = data.nbytes // 2
    results += store.put_session_start([ranged_key], [data.nbytes])
    results += store.put_ranges(
        [ranged_key], [[data.ctypes.data + half, data.ctypes.data]], [[half, half]],
        [[half, 0]],
    )
    results += store.put_session_end([ranged_key])
    store.close()
    print("wrote", [status.name for status in results])
    """
)
EXPECTED = np.random.default_rng(42).integers(0, 256, 1 << 20, dtype=np.uint8)


def run_writer(master_address: str, segment_size: int, keys: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", WRITER, master_address, str(segment_size), *keys],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def read_back(store: MooncakeStore, key: str) -> tuple[Status, np.ndarray]:
    out = np.zeros(EXPECTED.nbytes, dtype=np.uint8)
    status = store.batch_get_whole([key], [[out.ctypes.data]], [[out.nbytes]])[0]
    return status, out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_master_listens_on_loopback_and_stops_by_pid(start_mooncake_master: StartMaster) -> None:
    master = start_mooncake_master()
    host, port = master.address.split(":")
    assert host == "127.0.0.1"
    assert is_listening(host, int(port))
    master.stop()
    assert not pid_alive(master.pid) or not master.running()
    assert not is_listening(host, int(port))
    master.stop()  # idempotent


def test_two_masters_get_different_ports(start_mooncake_master: StartMaster) -> None:
    assert start_mooncake_master().address != start_mooncake_master().address


def test_a_master_is_not_started_on_a_port_another_process_listens_on(
    start_mooncake_master: StartMaster,
) -> None:
    """The new master could not bind it, and the other listener would pass for it."""
    taken = start_mooncake_master().rpc_port
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{taken} already accepts connections"):
        MasterProcess.start(rpc_port=taken, timeout_s=5)


def test_a_port_taken_between_probing_and_binding_is_not_mistaken_for_the_master(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Another process listening on the probed port passes a connect test; the master
    that could not bind it exits, and the start tries other ports."""
    with socket.create_server(("127.0.0.1", 0)) as thief:
        taken = thief.getsockname()[1]
        probes = iter([taken])
        monkeypatch.setattr(master_module, "free_port", lambda host: next(probes, free_port()))
        with MasterProcess.start(timeout_s=10, log_path=tmp_path / "m.log") as master:
            assert master.rpc_port != taken
            assert owns_listener(master.pid, master.rpc_port)
            assert not owns_listener(master.pid, taken)


def test_master_that_cannot_start_reports_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    busy = free_port()
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho 'cannot bind' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(StoreUnavailable, match=r"exited with 3 before listening(.|\n)*cannot bind"):
        MasterProcess.start(binary=fake, rpc_port=busy, timeout_s=5, log_path=tmp_path / "m.log")


def test_master_that_never_listens_is_stopped_after_the_timeout(tmp_path: Path) -> None:
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho $$ > " + str(tmp_path / "pid") + "\nexec sleep 60\n")
    fake.chmod(0o755)
    with pytest.raises(StoreUnavailable, match="not listening after 1 s"):
        MasterProcess.start(
            binary=fake, rpc_port=free_port(), timeout_s=1, log_path=tmp_path / "m.log"
        )
    assert not pid_alive(int((tmp_path / "pid").read_text()))


def test_holder_starts_ready_and_stops_cleanly(
    mooncake_master: MasterProcess, start_segment_holder: StartHolder
) -> None:
    holder = start_segment_holder(mooncake_master.address, "16MB")
    assert holder.running()
    assert holder.size == 16 << 20
    holder.stop()
    assert not holder.running()


def test_a_log_of_our_own_goes_with_a_holder_killed_or_stopped(
    mooncake_master: MasterProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder started without a log path logs to a temporary file: a deliberate kill (a
    fault test) leaves it behind no more than a clean stop does."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read once, then cached
    holders = [SegmentHolder.start(mooncake_master.address, "16MB") for _ in range(2)]
    logs = [holder.log_path for holder in holders]
    assert all(log.parent == tmp_path and log.exists() for log in logs)
    holders[0].kill()
    holders[1].stop()
    assert not any(log.exists() for log in logs)


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_a_holder_maps_its_whole_segment_at_start_unless_told_not_to(
    mooncake_master: MasterProcess, start_segment_holder: StartHolder
) -> None:
    """Pages mapped up front: first puts are not slowed, a host that cannot back the
    segment fails at start instead of losing every object to the OOM killer later."""
    size = 512 << 20
    populated = start_segment_holder(mooncake_master.address, size)
    lazy = start_segment_holder(mooncake_master.address, size, populate=False)
    assert resident_bytes(populated.pid) >= size
    assert resident_bytes(lazy.pid) < size // 2
    lines = populated.log_path.read_text().splitlines()
    assert any(line.startswith("populated ") and int(line.split()[1]) >= size for line in lines)


def test_holder_command_line_runs_without_warnings() -> None:
    # The package must not import the CLI module, or `-m` warns that it is already loaded.
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", "hybridkv.transport.holder", "--help"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--segment-size" in done.stdout
    assert done.stderr == ""


def test_holder_without_a_master_fails_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "holder.log"
    with pytest.raises(StoreUnavailable, match="does not accept connections"):
        SegmentHolder.start(f"127.0.0.1:{free_port()}", "16MB", log_path=log, timeout_s=30)


def test_a_ready_line_left_in_a_reused_log_does_not_start_a_failing_holder(
    tmp_path: Path,
) -> None:
    log = tmp_path / "holder.log"
    log.write_text("populated 0 B\nready\n")  # an earlier holder's output
    with pytest.raises(StoreUnavailable, match="does not accept connections") as failed:
        SegmentHolder.start(f"127.0.0.1:{free_port()}", "16MB", log_path=log, timeout_s=30).stop()
    assert "populated 0 B" not in str(failed.value)  # the error quotes this holder's lines
    assert log.read_text().startswith("populated 0 B\nready\n")  # appended, not replaced


def test_a_second_process_reads_what_a_finished_writer_stored(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder
) -> None:
    """The writer lends no memory, so its objects land in the holder and outlive it."""
    master = start_mooncake_master()
    start_segment_holder(master.address, "32MB")
    keys = ["persist-whole", "persist-ranged"]
    assert "wrote ['OK', 'OK', 'OK', 'OK']" in run_writer(master.address, 0, keys)

    reader = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=0))
    try:
        assert reader.batch_is_readable(keys) == [True, True]
        for key in keys:
            status, out = read_back(reader, key)
            assert status is Status.OK
            assert np.array_equal(out, EXPECTED)
    finally:
        reader.close()


def test_without_a_holder_objects_die_with_their_writer(
    start_mooncake_master: StartMaster,
) -> None:
    """Negative control: a writer that lends its own segment takes its objects with it."""
    master = start_mooncake_master()
    keys = ["mortal-whole", "mortal-ranged"]
    assert "wrote ['OK', 'OK', 'OK', 'OK']" in run_writer(master.address, 16 << 20, keys)
    reader = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=0))
    try:
        status, out = read_back(reader, keys[0])
        assert status in (Status.NOT_FOUND, Status.TRANSFER_FAILED)
        assert not np.array_equal(out, EXPECTED)
    finally:
        reader.close()


# A parent that starts a master and a holder from its main thread, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import time
    from hybridkv.transport.master import MasterProcess
    from hybridkv.transport.segment_holder import SegmentHolder

    master = MasterProcess.start()
    holder = SegmentHolder.start(master.address, "16MB")
    print(master.pid, holder.pid, flush=True)
    time.sleep(600)
    """
)


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (it runs no more either way)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_children_die_with_a_parent_killed_outright(tmp_path: Path) -> None:
    """SIGKILL (or the OOM killer) runs no exit handler: the kernel stops the children.
    (Their logs stay, as after any crash: in this test's folder.)"""
    require_mooncake()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert parent.stdout is not None
    children = [int(pid) for pid in parent.stdout.readline().split()]
    try:
        assert len(children) == 2
        assert not any(_exited(pid) for pid in children)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        while not all(_exited(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_exited(pid) for pid in children)
    finally:
        parent.kill()
        parent.wait()
        for pid in children:
            if not _exited(pid):
                os.kill(pid, 9)


def _mooncake_json(path: Path, **fields: object) -> Path:
    path.write_text(json.dumps(fields))
    return path


def test_the_holder_reads_mooncake_s_config_file_and_its_flags_override_it(
    tmp_path: Path,
) -> None:
    config = _mooncake_json(
        tmp_path / "mooncake.json",
        master_server_address="10.0.0.5:50051",
        metadata_server="http://10.0.0.5:8080/metadata",
        protocol="rdma",
        device_name="mlx5_0",
        local_hostname="10.0.0.9",
        global_segment_size="4GB",
    )
    args, overrides = parse_args(["--config", str(config), "--size", "1GB", "--device-name", "x"])
    assert overrides == {"global_segment_size": "1GB", "device_name": "x"}
    settings = holder_config(args.config, overrides)
    assert settings.master_server_address == "10.0.0.5:50051"
    assert settings.metadata_server == "http://10.0.0.5:8080/metadata"
    assert (settings.protocol, settings.device_name) == ("rdma", "x")
    assert settings.local_hostname == "10.0.0.9"
    assert settings.global_segment_size == 1 << 30
    assert settings.local_buffer_size == 16 << 20  # the holder's default, not the file's


def test_flags_alone_still_make_a_holder_on_loopback_over_tcp() -> None:
    args, overrides = parse_args(["--master", "127.0.0.1:5", "--segment-size", "16MB"])
    settings = holder_config(args.config, overrides)
    assert (settings.protocol, settings.metadata_server) == ("tcp", "P2PHANDSHAKE")
    assert settings.local_hostname == "127.0.0.1"


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"master_server_address": "h:1", "global_segment_size": 0}, "must be positive"),
        ({"master_server_address": "h:1", "protocl": "tcp"}, "unknown Mooncake config keys"),
        ({"global_segment_size": "1GB"}, "needs master_server_address"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, fields: dict[str, object], error: str
) -> None:
    config = _mooncake_json(tmp_path / "bad.json", **fields)
    with pytest.raises(ValueError, match=error) as refused:
        holder_config(config, {})
    assert str(config) in str(refused.value)


def test_the_holder_needs_a_config_or_both_master_and_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--master", "127.0.0.1:5"])
    assert "give --config, or --master and --segment-size" in capsys.readouterr().err


def _get(address: str, path: str) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", path)
        reply = connection.getresponse()
        return reply.status, reply.read().decode()
    finally:
        connection.close()


def _gauges(text: str) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in (line.split() for line in text.splitlines() if not line.startswith("#"))
    }


def test_a_holder_from_a_config_file_reports_health_and_metrics_until_its_master_goes(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder, tmp_path: Path
) -> None:
    master = start_mooncake_master()
    config = _mooncake_json(
        tmp_path / "mooncake.json",
        master_server_address=master.address,
        protocol="tcp",
        metadata_server="P2PHANDSHAKE",
        global_segment_size="16MB",
    )
    port = free_port()
    holder = start_segment_holder(None, None, config_path=config, http_port=port)
    assert (holder.master_address, holder.size) == (master.address, 16 << 20)
    address = f"127.0.0.1:{port}"
    assert _get(address, "/health") == (200, "ok\n")
    status, text = _get(address, "/metrics")
    assert status == 200
    gauges = _gauges(text)
    assert gauges["hybridkv_holder_segment_bytes"] == 16 << 20
    assert gauges["hybridkv_holder_mounted"] == 1
    assert gauges["hybridkv_holder_master_reachable"] == 1
    assert 0 < gauges["hybridkv_holder_uptime_seconds"] < 600
    assert "# TYPE hybridkv_holder_uptime_seconds gauge" in text
    assert _get(address, "/nothing")[0] == 404

    master.stop()
    status, why = _get(address, "/health")
    assert status == 503
    assert why == f"master {master.address} unreachable\n"
    assert _gauges(_get(address, "/metrics")[1])["hybridkv_holder_master_reachable"] == 0


def test_a_holder_is_unhealthy_until_its_segment_is_mounted() -> None:
    listener = socket.create_server((LOOPBACK, 0))  # a master that accepts connections
    try:
        state = HolderState(16 << 20, f"{LOOPBACK}:{listener.getsockname()[1]}")
        assert state.health() == (False, "segment not mounted yet")
        assert "hybridkv_holder_mounted 0\n" in state.metrics()
        state.mounted = True
        assert state.health() == (True, "ok")
    finally:
        listener.close()


def test_a_holder_of_elected_masters_asks_etcd_whether_they_are_reachable() -> None:
    listener = socket.create_server((LOOPBACK, 0))  # an etcd that accepts connections
    port = listener.getsockname()[1]
    try:
        state = HolderState(16 << 20, f"etcd://{LOOPBACK}:{port}", mounted=True)
        assert state.health() == (True, "ok")
    finally:
        listener.close()
    assert not state.master_reachable()
