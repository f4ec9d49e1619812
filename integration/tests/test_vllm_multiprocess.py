"""vLLM as users run it: the engine core, and the worker in a process of its own, over a
real Mooncake master and segment holder.

Proves what the in-process tests cannot: the plugin registers the connector by name in
every process vLLM starts, the scheduler finds worker rank 0's lookup server in another
process (through a Unix socket only its user can reach), and a hit read back from the
real pool reproduces the cold run exactly, with a shared master and with the embedded one.
Reuse across vLLM instances lives in tests-e2e.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from conftest import require
from tinymodels import build_bare
from vllm_rig import complete, new_llm

from hybridkv.transport import MasterProcess, SegmentHolder

pytest_plugins = ["hybridkv.transport.testing"]

HIT = 192


def test_scheduler_looks_up_a_worker_process_over_real_mooncake(
    mooncake_master: MasterProcess,
    segment_holder: SegmentHolder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require("vllm")
    require("transformers")
    config = tmp_path / "mooncake.json"
    # objects land in the holder's segment (this engine lends none)
    config.write_text(
        json.dumps(
            {
                "master_server_address": mooncake_master.address,
                "global_segment_size": 0,
                "local_buffer_size": 64 << 20,
            }
        )
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_bare("llama", tmp_path)
    llm = new_llm(model, {"namespace": "multiprocess"}, distributed_executor_backend="mp")
    try:
        cold = complete(llm)
        assert llm.reset_prefix_cache()  # vLLM's own cache forgets; the pool does not
        warm = complete(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert cold[2] == 0
    assert warm[2] == HIT
    assert warm[:2] == cold[:2]


def _parent(pid: int) -> int:
    """`pid`'s parent (0 once it is gone): /proc/PID/stat's fourth field."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat_line.rsplit(")", 1)[1].split()[1])


def _masters_running() -> set[int]:
    """Pids of every mooncake_master process on this machine."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            if any(arg.endswith(b"mooncake_master") for arg in argv[:2]):
                found.add(int(entry.name))
    return found


def _masters_started_here() -> set[int]:
    """The masters this test process started, through any number of children (other
    suites on the machine may run masters of their own)."""
    mine = os.getpid()
    return {pid for pid in _masters_running() if _descends_from(pid, mine)}


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(64):  # bounded: a chain of processes is short
        pid = _parent(pid)
        if pid in (0, 1):
            return False
        if pid == ancestor:
            return True
    return False


def test_embedded_master_serves_the_instance_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MOONCAKE_CONFIG_PATH` unset: worker rank 0 starts a master of its own. Its KV is
    reused within the instance; worker rank 0's lookup socket sits alone in a directory of
    mode 0700, and after shutdown neither the master nor any file of ours is left (the
    temp directory of every process is this test's own)."""
    require("vllm")
    require("transformers")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_bare("llama", tmp_path)
    before = _masters_started_here()
    llm = new_llm(model, {"namespace": "embedded"}, distributed_executor_backend="mp")
    try:
        started = _masters_started_here() - before
        (lookup,) = temp.glob("hybridkv-lookup-*")  # (the master's logs are hybridkv-* too)
        lookup_mode = stat.S_IMODE(lookup.stat().st_mode)
        lookup_files = [p.name for p in lookup.iterdir()]
        cold = complete(llm)
        assert llm.reset_prefix_cache()
        warm = complete(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len(started) == 1  # the embedded one
    assert (lookup_mode, lookup_files) == (0o700, ["sock"])
    assert cold[2] == 0
    assert warm[2] == HIT
    assert warm[:2] == cold[:2]
    assert not started & _masters_running()
    assert [p.name for p in temp.rglob("hybridkv*")] == []
