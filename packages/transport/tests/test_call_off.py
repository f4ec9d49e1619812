"""A transfer its waiter gave up on (`Ticket.call_off`) touches the caches no more.

Saves: two staged saves queue behind a put that hangs (a stalled holder, here a gate the
test opens). Called off, neither waits for that put: the first had copied its blocks into
staging already, the second had read nothing. The caches are then overwritten (the owner
reuses the blocks) and the put goes on: the first save's objects are stored whole, as
they were when copied; the second's are never stored, and its keys count as failed.

Loads: two loads queue behind a get that hangs. A staged load's call-off returns at once
(the get writes its staging slab); an in-place one waits for the get in progress (it
writes the caches until it returns). Once the call-off returned, the owner reuses the
blocks, the gets go on, and nothing they bring is written into the caches: what was
not written before the call-off returned fails. A layer-by-layer step gives its loads up
at its deadline likewise, and its `finish()` does not wait for their calls; and its saves:
what was staged before the deadline may still be stored whole, nothing is read after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
from _engine_drive import engine_for, read_object
from _engine_model import NUM_LAYERS, Caches, transfers

from hybridkv.transport import TransferEngine
from hybridkv.transport.device_events import CpuEvent
from hybridkv.transport.errors import Status
from hybridkv.transport.memory_store import MemoryStore


def _gated(operation: str, method: str) -> Callable[..., list[Status]]:
    """The memory store's `method`, waiting at the gate when `operation` is gated."""

    def call(self: GatedStore, *args: Sequence[object]) -> list[Status]:
        self.pass_gate(operation)
        result: list[Status] = getattr(MemoryStore, method)(self, *args)
        return result

    return call


class GatedStore(MemoryStore):
    """Puts or gets (`gated`: whole and ranged ones) wait at a gate the test opens."""

    def __init__(self, gated: str) -> None:
        super().__init__()
        self.gated = gated
        self.gate = threading.Event()
        self.entered = threading.Event()

    def pass_gate(self, operation: str) -> None:
        if operation == self.gated:
            self.entered.set()
            if not self.gate.wait(timeout=30):
                raise AssertionError("the test never opened the gate")

    batch_put_whole = _gated("put", "batch_put_whole")
    put_ranges = _gated("put", "put_ranges")
    batch_get_whole = _gated("get", "batch_get_whole")
    get_ranges = _gated("get", "get_ranges")


def test_a_called_off_save_never_stores_what_it_had_not_read() -> None:
    store = GatedStore("put")
    caches = Caches(8)
    caches.fill()
    engine = engine_for(store, caches, "whole")
    first_saves = transfers({0: [0, 1]}, "first", "first")
    second_saves = transfers({0: [2, 3]}, "second", "second")
    expected = {t.key: caches.block_bytes(0, t.local_block) for t in first_saves}
    try:
        first, second = engine.save(first_saves), engine.save(second_saves)
        assert store.entered.wait(timeout=10)  # the first save's put hangs
        with pytest.raises(TimeoutError):
            first.wait(timeout=0.05)
        first.call_off()  # returns at once: the put reads staging, not the caches
        second.call_off()
        caches.fill()  # the blocks hold other KV now
        store.gate.set()
        first_result, second_result = first.wait(timeout=30), second.wait(timeout=30)
    finally:
        store.gate.set()
        engine.close()
    assert first_result.ok
    size = engine.layouts[0].object_size
    assert {key: read_object(store, key, size) for key in expected} == expected
    assert sorted(second_result.failed_keys) == sorted(t.key for t in second_saves)
    assert store.batch_is_readable([t.key for t in second_saves]) == [False, False]


REUSED = 7  # what vLLM writes into the blocks once the load was given up


def saved_behind_a_gate(
    granularity: str, names: Sequence[str] = ("k",), **options: float
) -> tuple[GatedStore, Caches, TransferEngine]:
    """An engine over a store whose gets wait at its gate, with blocks 0 and 1 of group 0
    saved under each of `names` (the request id and key prefix)."""
    store = GatedStore("get")
    caches = Caches(8)
    caches.fill()
    engine = engine_for(store, caches, granularity, **options)
    try:
        for name in names:
            assert engine.save(transfers({0: [0, 1]}, name, name)).wait(timeout=30).ok
    except BaseException:
        engine.close()
        raise
    return store, caches, engine


@pytest.mark.parametrize("granularity", ["staged", "group"])
def test_a_called_off_load_never_writes_the_caches_after_its_call_off_returned(
    granularity: str,
) -> None:
    # One call per block.
    store, caches, engine = saved_behind_a_gate(
        granularity, ("first", "second"), max_transfer_blocks=1
    )
    targets = [4, 5, 6, 7]
    try:
        first = engine.load(transfers({0: targets[:2]}, "first", "first"))
        second = engine.load(transfers({0: targets[2:]}, "second", "second"))
        assert store.entered.wait(timeout=10)  # the first load's get hangs
        with pytest.raises(TimeoutError):
            first.wait(timeout=0.05)
        calling_off = [threading.Thread(target=load.call_off) for load in (first, second)]
        for thread in calling_off:
            thread.start()
        calling_off[0].join(timeout=0.5)
        # In place, the get in progress writes the caches until it returns: waited for.
        assert calling_off[0].is_alive() is (granularity == "group")
        store.gate.set()
        for thread in calling_off:
            thread.join(timeout=10)
            assert not thread.is_alive()
        group_arrays = [array for (group, _, _), array in caches.arrays.items() if group == 0]
        for array in group_arrays:
            array[targets] = REUSED
        first_result, second_result = first.wait(timeout=30), second.wait(timeout=30)
    finally:
        store.gate.set()
        engine.close()
    assert all((array[targets] == REUSED).all() for array in group_arrays)
    failed = set().union(*(r.failed_blocks.get(0, set()) for r in (first_result, second_result)))
    if granularity == "staged":  # their gets wrote staging only, never scattered
        assert failed == set(targets)
    else:  # the calls in progress wrote before the call-off returned; the rest failed
        assert {5, 7} <= failed


@pytest.mark.parametrize("granularity", ["staged", "layer"])
def test_a_layerwise_step_gives_its_loads_up_at_the_deadline_and_writes_nothing_after(
    granularity: str,
) -> None:
    store, caches, engine = saved_behind_a_gate(granularity)
    targets = [4, 5]
    # In place ("layer"), the get in progress is waited for: the gate opens after 1 s.
    opener = threading.Timer(1.0, store.gate.set)
    try:
        step = engine.begin_layerwise(loads=transfers({0: targets}, "r", "k"), load_deadline_s=0.3)
        assert store.entered.wait(timeout=10)
        if granularity == "layer":
            opener.start()
        started = time.monotonic()
        failed = step.wait_layer_loaded(0)
        waited = time.monotonic() - started
        group_arrays = [array for (group, _, _), array in caches.arrays.items() if group == 0]
        for array in group_arrays:
            array[targets] = REUSED
        later = [step.wait_layer_loaded(layer) for layer in range(1, NUM_LAYERS)]
        result = step.finish()  # the calls given up still run (staged: still at the gate)
        store.gate.set()
        limit = time.monotonic() + 10
        while engine.outstanding("load") and time.monotonic() < limit:
            time.sleep(0.05)
        assert engine.outstanding("load") == 0
    finally:
        opener.cancel()
        store.gate.set()
        engine.close()
    assert failed == {0: set(targets)}
    assert all(layer_failed == failed for layer_failed in later)
    assert result.failed_blocks == failed
    # Read again, they would wait on the same stalled holder: to blame (quarantined).
    assert sorted(step.blamed_loads()) == sorted(result.failed_keys)
    assert result.unblamed_keys == []
    assert all((array[targets] == REUSED).all() for array in group_arrays)
    if granularity == "staged":  # nothing was writing the caches: let go at the deadline
        assert waited < 0.9
    else:
        assert waited >= 0.5


def test_a_layerwise_step_finished_without_waiting_for_a_layer_still_gives_its_loads_up() -> None:
    store, _, engine = saved_behind_a_gate("staged")
    try:
        step = engine.begin_layerwise(loads=transfers({0: [4, 5]}, "r", "k"), load_deadline_s=0.3)
        assert store.entered.wait(timeout=10)
        started = time.monotonic()
        result = step.finish()  # a step drained after an error: no layer was waited for
        waited = time.monotonic() - started
    finally:
        store.gate.set()
        engine.close()
    assert waited < 0.9
    assert result.failed_blocks == {0: {4, 5}}


@pytest.mark.parametrize("stalled", ["load", "save"])
def test_a_layerwise_step_never_waits_behind_a_stalled_transfer_of_the_other_kind(
    stalled: str,
) -> None:
    """A step without loads queues nothing behind a background load's stalled get, one
    without saves nothing behind a whole save's stalled put."""
    if stalled == "load":
        store, _, engine = saved_behind_a_gate("staged")
        saves = transfers({0: [2]}, "s", "saved")
    else:
        store, caches = GatedStore("put"), Caches(8)
        caches.fill()
        engine = engine_for(store, caches, "staged")
        saves = []
    try:
        if stalled == "load":
            stalled_transfer = engine.load(transfers({0: [4, 5]}, "r", "k"))
        else:
            stalled_transfer = engine.save(transfers({0: [0, 1]}, "w", "whole"))
        assert store.entered.wait(timeout=10)
        step = engine.begin_layerwise(saves=saves, save_deadline_s=5.0)
        for layer in range(NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
        started = time.monotonic()
        result = step.finish()
        waited = time.monotonic() - started
    finally:
        store.gate.set()
        engine.close()
    assert waited < 1.0  # not the stalled call
    assert result.ok
    assert stalled_transfer.wait(timeout=30).ok


def test_a_slow_forward_does_not_spend_a_layerwise_step_s_load_deadline() -> None:
    """The forward paces the reads (none prefetched here): only its waits count."""
    store = MemoryStore()
    caches = Caches(8)
    caches.fill()
    engine = engine_for(store, caches, "layer", prefetch_layers=0)
    try:
        assert engine.save(transfers({0: [0, 1]}, "k", "k")).wait(timeout=30).ok
        step = engine.begin_layerwise(loads=transfers({0: [4, 5]}, "r", "k"), load_deadline_s=0.2)
        failed = []
        for layer in range(NUM_LAYERS):
            time.sleep(0.1)  # the layers' compute, 0.4 s in all
            failed.append(step.wait_layer_loaded(layer))
        result = step.finish()
    finally:
        engine.close()
    assert failed == [{}] * NUM_LAYERS
    assert result.ok


@pytest.mark.parametrize("granularity", ["staged", "layer"])
def test_a_layerwise_step_gives_its_saves_up_at_the_deadline_and_stores_nothing_it_had_not_read(
    granularity: str,
) -> None:
    """Staged, every layer was copied before the deadline: the put given up stores them
    whole once it goes on. In place ("layer"), each layer's put reads the caches: the one
    at the gate was waited for (the gate opens after 1 s), none after it is made."""
    store = GatedStore("put")
    caches = Caches(8)
    caches.fill()
    engine = engine_for(store, caches, granularity)
    saves = transfers({0: [2, 3]}, "s", "saved")
    expected = {t.key: caches.block_bytes(0, t.local_block) for t in saves}
    opener = threading.Timer(1.0, store.gate.set)
    try:
        step = engine.begin_layerwise(saves=saves, save_deadline_s=0.3)
        for layer in range(NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
        assert store.entered.wait(timeout=10)
        if granularity == "layer":
            opener.start()
        started = time.monotonic()
        result = step.finish()
        waited = time.monotonic() - started
        running_after_finish = step.saves_running
        caches.fill()  # the blocks hold other KV now
        store.gate.set()
        limit = time.monotonic() + 10
        while step.saves_running and time.monotonic() < limit:
            time.sleep(0.05)
        ended = not step.saves_running
    finally:
        opener.cancel()
        store.gate.set()
        engine.close()
    assert sorted(result.failed_keys) == sorted(expected)
    assert ended
    size = engine.layouts[0].object_size
    held = {
        key: read_object(store, key, size) for key in expected if store.batch_is_readable([key])[0]
    }
    if granularity == "staged":
        assert waited < 0.9
        assert running_after_finish
        assert held == expected  # copied before the deadline: stored whole
    else:
        assert waited >= 0.5  # the put in progress read the caches: waited for
        assert all(held[key] == expected[key] for key in held)  # never the new KV
