"""vLLM as users run it: the engine core, and the worker in a process of its own, over a
real Mooncake master and segment holder.

Proves what the in-process tests cannot: the plugin registers the connector by name in
every process vLLM starts, the scheduler finds worker rank 0's lookup server through the
published port across processes, and a hit read back from the real pool reproduces the
cold run exactly. Reuse across vLLM instances lives in tests-e2e.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import _require
from tinymodels import build, complete, new_llm

from hybridkv.transport import MasterProcess, SegmentHolder

pytest_plugins = ["hybridkv.transport.testing"]

HIT = 192


def test_scheduler_looks_up_a_worker_process_over_real_mooncake(
    mooncake_master: MasterProcess,
    segment_holder: SegmentHolder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require("vllm")
    _require("transformers")
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
    model = build("llama", tmp_path)
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
