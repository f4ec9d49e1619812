"""Saves and loads have deadlines: a stalled store holds vLLM's blocks no longer.

A real Mooncake master and segment holder; the holder is stopped (SIGSTOP) while the
worker side saves or loads, with a deadline of 1 s and a store timeout of 5 s per call.

Saves: two steps' blocks are saved while the holder is stopped, then the barrier (before
vLLM may reuse those blocks) gives up at the deadline: the first step's put is stuck in
the stalled holder, the second one's queued behind it. Both count as failed and are not
announced. While the put given up still runs, a third step issues no save (it would only
queue behind it): its barrier waits for nothing. vLLM then reuses the blocks (here:
garbage written over them), and the holder runs again. Nothing the barrier gave up on
reads the caches afterwards, so whatever the pool holds of those blocks is the KV they
held when saved, whole, or nothing; once the put given up has ended, saves are stored
again.

Staged saves (host caches' default) copy into staging before the store call: the barrier
returns at the deadline, and the put given up still runs when the third step comes. In-place
saves ("group") read the caches during the store call itself: the barrier also waits for
the one call in flight (at most the store timeout), so that call may have ended by the
third step, which then saves again and is given up in turn (its deadline plus that call).
Layer by layer, each step's end gives its own saves up at the deadline, the same way.

Loads: a step's load (before the forward) and a background load (vLLM's async path) from
the stalled holder are given up at the deadline (in place: plus the one call in flight);
every block fails and its key goes to quarantine (asked again, it would wait on the same
stalled holder), vLLM recomputes into them (garbage here), and once the holder runs again
and the gets given up end, none of what they brought was written into the caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import attention, groups, require

from hybridkv.integration.cache_layouts import build_layouts
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.layerwise.compute_window import LayerwiseStrategy
from hybridkv.integration.layerwise.vllm_window import VllmLayerPlan, VllmLayerwise
from hybridkv.integration.metadata import BlockRef, HybridKVMetadata, RequestTransfers
from hybridkv.integration.transfer_strategy import TransferStrategy, WholeBlocks
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
LOADED = range(12, 16)  # where FIRST's objects are loaded


class Side:
    """A worker side over one attention group of two layers (each object two pieces:
    staged saves copy them), saving block b with hash b; one store call per block."""

    def __init__(
        self, specs: Any, store: MooncakeStore, granularity: Granularity, layerwise: bool = False
    ) -> None:
        spec = groups(specs, (["a", "b"], attention(specs)))
        plan = plan_groups(spec, [0], ModelShape(1, 2))
        self.keys = KeySpace(plan, f"deadlines-{granularity}")
        self.cache = torch.zeros(2, NUM_BLOCKS, 2, SIZE, 2, 64)  # (layer, block, ...)
        caches = {"a": self.cache[0], "b": self.cache[1]}
        layouts = build_layouts(self.keys, caches, {"a": 0, "b": 1}, NUM_BLOCKS)
        options = PipelineOptions(granularity=granularity, max_transfer_blocks=1)
        self.engine = TransferEngine(store, layouts, options)
        strategy: TransferStrategy = WholeBlocks(self.engine, CpuEvent, DEADLINE_S)
        if layerwise:  # no layer reports: the step's loads are waited for at its end
            steps = LayerwiseStrategy(
                self.engine,
                [0, 1],
                {},
                CpuEvent,
                load_deadline_s=DEADLINE_S,
                save_deadline_s=DEADLINE_S,
            )
            sizes = {group: layout.object_size for group, layout in self.engine.layouts.items()}
            layer_plan = VllmLayerPlan(frozenset(), frozenset(), frozenset())
            strategy = VllmLayerwise(steps, layer_plan, sizes)
        self.worker = WorkerSide(
            self.keys,
            self.engine,
            strategy,
            0,
            CpuEvent,
            save_deadline_s=DEADLINE_S,
            load_deadline_s=DEADLINE_S,
        )

    def key(self, block: int) -> str:
        return self.keys.keys(0, [bytes([block]) * 32], [0])[0]

    def save(self, request_id: str, blocks: range) -> None:
        """One step saving `blocks`, up to vLLM's `wait_for_save` (no barrier)."""
        values = torch.tensor([float(b) for b in blocks]).reshape(-1, 1, 1, 1, 1)
        self.cache[:, blocks.start : blocks.stop] = values
        refs = [BlockRef(0, b, b, bytes([b]) * 32) for b in blocks]
        request = RequestTransfers(request_id=request_id, saves=refs)
        self._step(request)

    def load(self, request_id: str, blocks: range, into: range, background: bool) -> None:
        """One step loading the objects of `blocks` into the local blocks `into`."""
        refs = [BlockRef(0, h, b, bytes([h]) * 32) for h, b in zip(blocks, into, strict=True)]
        request = RequestTransfers(request_id=request_id, loads=refs, load_async=background)
        self._step(request)

    def _step(self, request: RequestTransfers) -> None:
        self.worker.begin_step(HybridKVMetadata([request]))
        self.worker.start_async_loads()
        self.worker.end_step()

    def loads_ended(self) -> bool:
        """Whether the gets given up have ended (within 60 s)."""
        limit = time.monotonic() + 60
        while self.engine.outstanding("load") and time.monotonic() < limit:
            time.sleep(0.2)
        return not self.engine.outstanding("load")


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


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("granularity", ["staged", "group"])
def test_saves_are_given_up_at_their_deadline_and_the_pool_never_holds_reused_blocks(
    granularity: Granularity,
    layerwise: bool,
    pool: tuple[Any, MooncakeStore, MooncakeStore],
    vllm_specs: Any,
) -> None:
    holder, writer, reader = pool
    saver = Side(vllm_specs, writer, granularity, layerwise)
    try:
        saver.save("warm-up", range(0, 1))  # the handshake with the holder, before the stall
        saver.worker.barrier()
        assert saver.worker.totals.snapshot(reset=True)["saved_blocks"] == 1
        saver.worker.take_stored_events()
        with stalled(holder.pid):
            waits = [
                _timed(lambda: saver.save("first", FIRST)),
                _timed(lambda: saver.save("second", SECOND)),
                _timed(saver.worker.barrier),
            ]
            waited_third = _timed(lambda: (saver.save("third", THIRD), saver.worker.barrier()))
            saver.cache[:, 1:11] = GARBAGE  # vLLM reuses the blocks
        totals = saver.worker.totals.snapshot(reset=True)
        announced = saver.worker.take_stored_events()
        stored_again = _saves_resume(saver, reader)
    finally:
        saver.worker.close()  # the engine drains what it still runs
    # Whole blocks: the barrier gives both steps' saves up at once. Layer by layer: each
    # step's end gives its own up (in place, the second step's saves were issued once the
    # first's call in flight had ended, and stall in turn).
    bound = DEADLINE_S + (STORE_TIMEOUT_S if granularity == "group" else 0)
    assert max(waits) < bound + 2.0, waits  # not the store's timeout per call (10 s and more)
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
    # Whole and right, or not there: nothing was read from a block once it was given up.
    assert all(held[b] in (Status.NOT_FOUND, {float(b)}) for b in held), held
    if granularity == "staged":  # the second and third steps' saves never read a block
        assert all(held[b] is Status.NOT_FOUND for b in (*SECOND, *THIRD)), held


def _timed(call: Callable[[], object]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def _saves_resume(saver: Side, reader: MooncakeStore) -> bool:
    """Whether a save is stored again once the put given up has ended (within 60 s)."""
    limit = time.monotonic() + 60
    while time.monotonic() < limit:
        saver.save("after", AFTER)
        saver.worker.barrier()
        if reader.batch_is_readable([saver.key(AFTER.start)]) == [True]:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.parametrize("load", ["step", "background", "layerwise"])
@pytest.mark.parametrize("granularity", ["staged", "group"])
def test_a_load_from_a_stalled_holder_is_given_up_at_its_deadline_and_writes_nothing_late(
    granularity: Granularity,
    load: str,
    pool: tuple[Any, MooncakeStore, MooncakeStore],
    vllm_specs: Any,
) -> None:
    holder, writer, _ = pool
    background = load == "background"
    side = Side(vllm_specs, writer, granularity, layerwise=load == "layerwise")
    try:
        side.save("source", FIRST)
        side.worker.barrier()
        assert side.worker.totals.snapshot(reset=True)["saved_blocks"] == len(FIRST)
        with stalled(holder.pid):
            started = time.monotonic()
            side.load("reader", FIRST, LOADED, background)
            if background:
                while "reader" not in side.worker.finished():
                    time.sleep(0.05)
                failed = side.worker.take_failed_requests()
            else:
                failed = side.worker.take_load_errors()
            waited = time.monotonic() - started
            side.cache[:, LOADED.start : LOADED.stop] = GARBAGE  # vLLM recomputes them
        quarantined = side.worker.take_failed_keys()
        ended = side.loads_ended()
        late = side.cache[:, LOADED.start : LOADED.stop].ne(GARBAGE).sum().item()
        totals = side.worker.totals.snapshot(reset=True)
    finally:
        side.worker.close()
    bound = DEADLINE_S + (STORE_TIMEOUT_S if granularity == "group" else 0)
    assert waited < bound + 2.0  # not the store's timeout per call (5 s each, four calls)
    assert failed == ({"reader"} if background else set(LOADED))
    assert totals["failed_load_blocks"] == len(FIRST)
    # Asked again, they would wait on the same stalled holder: quarantined.
    assert quarantined == {side.key(block) for block in FIRST}
    assert ended
    assert late == 0
