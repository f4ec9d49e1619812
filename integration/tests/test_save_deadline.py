"""The save barrier has a deadline as a whole: a stalled store holds vLLM's blocks no longer.

A real Mooncake master and segment holder; the worker side saves two steps' blocks while
the holder is stopped (SIGSTOP), then its barrier (before vLLM may reuse those blocks)
runs with `save_deadline_s` 1 s and a store timeout of 5 s per call. The barrier gives up
at the deadline: the first step's put is stuck in the stalled holder, the second one's
queued behind it. Both count as failed and are not announced. While the put given up
still runs, a third step issues no save (it would only queue behind it): its barrier
waits for nothing. vLLM then reuses the blocks (here: garbage written over them), and
the holder runs again. Nothing the barrier gave up on reads the caches afterwards, so
whatever the pool holds of those blocks is the KV they held when saved, whole, or
nothing; once the put given up has ended, saves are stored again.

Staged saves (host caches' default) copy into staging before the store call: the barrier
returns at the deadline, and the put given up still runs when the third step comes. In-place
saves ("group") read the caches during the store call itself: the barrier also waits for
the one call in flight (at most the store timeout), so that call may have ended by the
third step, which then saves again and is given up in turn (its deadline plus that call).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import attention, groups, require

from hybridkv.integration.cache_layouts import build_layouts
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.metadata import BlockRef, HybridKVMetadata, RequestTransfers
from hybridkv.integration.transfer_strategy import WholeBlocks
from hybridkv.integration.worker import WorkerSide
from hybridkv.transport import CpuEvent, Granularity, PipelineOptions, Status, TransferEngine
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.testing import StartHolder, StartMaster, mooncake_config, stalled

pytest_plugins = ["hybridkv.transport.testing"]

torch = require("torch")
SIZE = 32
NUM_BLOCKS = 16
DEADLINE_S = 1.0
STORE_TIMEOUT_S = 5
GARBAGE = -7.0
FIRST, SECOND, THIRD = range(1, 5), range(5, 9), range(9, 11)  # the stalled steps' blocks
AFTER = range(11, 12)


class Saver:
    """A worker side over one attention group of two layers (each object two pieces:
    staged saves copy them), saving block b with hash b."""

    def __init__(self, specs: Any, store: MooncakeStore, granularity: Granularity) -> None:
        spec = groups(specs, (["a", "b"], attention(specs)))
        plan = plan_groups(spec, [0], ModelShape(1, 2))
        self.keys = KeySpace(plan, f"save-deadline-{granularity}")
        self.cache = torch.zeros(2, NUM_BLOCKS, 2, SIZE, 2, 64)  # (layer, block, ...)
        caches = {"a": self.cache[0], "b": self.cache[1]}
        layouts = build_layouts(self.keys, caches, {"a": 0, "b": 1}, NUM_BLOCKS)
        options = PipelineOptions(granularity=granularity)
        self.engine = TransferEngine(store, layouts, options)
        self.worker = WorkerSide(
            self.keys,
            self.engine,
            WholeBlocks(self.engine, CpuEvent),
            0,
            CpuEvent,
            save_deadline_s=DEADLINE_S,
        )

    def key(self, block: int) -> str:
        return self.keys.keys(0, [bytes([block]) * 32], [0])[0]

    def save(self, request_id: str, blocks: range) -> None:
        """One step saving `blocks`, up to vLLM's `wait_for_save` (no barrier)."""
        values = torch.tensor([float(b) for b in blocks]).reshape(-1, 1, 1, 1, 1)
        self.cache[:, blocks.start : blocks.stop] = values
        refs = [BlockRef(0, b, b, bytes([b]) * 32) for b in blocks]
        request = RequestTransfers(request_id=request_id, saves=refs)
        self.worker.begin_step(HybridKVMetadata([request]))
        self.worker.start_async_loads()
        self.worker.end_step()


@pytest.fixture
def pool(
    start_mooncake_master: StartMaster, start_segment_holder: StartHolder
) -> Iterator[tuple[Any, MooncakeStore, MooncakeStore]]:
    master = start_mooncake_master()
    holder = start_segment_holder(master.address)
    config = mooncake_config(master.address, global_segment_size=0, store_timeout_s=STORE_TIMEOUT_S)
    writer, reader = MooncakeStore.connect(config), MooncakeStore.connect(config)
    yield holder, writer, reader
    reader.close()
    writer.close()


@pytest.mark.parametrize("granularity", ["staged", "group"])
def test_the_save_barrier_gives_up_at_its_deadline_and_the_pool_never_holds_reused_blocks(
    granularity: Granularity, pool: tuple[Any, MooncakeStore, MooncakeStore], vllm_specs: Any
) -> None:
    holder, writer, reader = pool
    saver = Saver(vllm_specs, writer, granularity)
    try:
        saver.save("warm-up", range(0, 1))  # the handshake with the holder, before the stall
        saver.worker.barrier()
        assert saver.worker.totals.snapshot(reset=True)["saved_blocks"] == 1
        saver.worker.take_stored_events()
        with stalled(holder.pid):
            saver.save("first", FIRST)
            saver.save("second", SECOND)
            started = time.monotonic()
            saver.worker.barrier()
            waited = time.monotonic() - started
            saver.save("third", THIRD)
            started = time.monotonic()
            saver.worker.barrier()
            waited_third = time.monotonic() - started
            saver.cache[:, 1:11] = GARBAGE  # vLLM reuses the blocks
        totals = saver.worker.totals.snapshot(reset=True)
        announced = saver.worker.take_stored_events()
        stored_again = _saves_resume(saver, reader)
    finally:
        saver.worker.close()  # the engine drains what it still runs
    bound = DEADLINE_S + (STORE_TIMEOUT_S if granularity == "group" else 0)
    assert waited < bound + 2.0  # not the store's timeout per call (10 s and more)
    if granularity == "staged":
        assert waited_third < DEADLINE_S  # nothing issued, nothing to wait for
    else:
        assert waited_third < bound + 2.0
    assert totals["failed_save_blocks"] == len(FIRST) + len(SECOND) + len(THIRD)
    assert announced == []
    assert stored_again
    held = {}
    for block in (*FIRST, *SECOND, *THIRD):
        out = np.zeros(2 * saver.cache[0, 0].numel(), dtype=np.float32)
        (status,) = reader.batch_get_whole([saver.key(block)], [[out.ctypes.data]], [[out.nbytes]])
        held[block] = status if status is not Status.OK else set(out.tolist())
    # Whole and right, or not there; the second step's saves never read a block.
    assert all(held[b] in (Status.NOT_FOUND, {float(b)}) for b in FIRST), held
    assert all(held[b] is Status.NOT_FOUND for b in (*SECOND, *THIRD)), held


def _saves_resume(saver: Saver, reader: MooncakeStore) -> bool:
    """Whether a save is stored again once the put given up has ended (within 60 s)."""
    limit = time.monotonic() + 60
    while time.monotonic() < limit:
        saver.save("after", AFTER)
        saver.worker.barrier()
        if reader.batch_is_readable([saver.key(AFTER.start)]) == [True]:
            return True
        time.sleep(0.5)
    return False
