"""Ownership keyed by (request, group, block index); resume across chunked-prefill steps."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import msgspec
import pytest
from _engine_drive import MODES, engine_for, load, read_object, save, unique_prefix
from _engine_model import NUM_LAYERS, Caches, transfers
from _engine_stores import GateEvent

from hybridkv.transport.device_events import CpuEvent
from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.errors import Status
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.outcome import TransferResult
from hybridkv.transport.ownership import BlockTransfer, Claim, OwnedBlock, RideOutcome
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.store import Store


@pytest.mark.parametrize("mode", MODES)
def test_block_zero_of_each_group_is_its_own_object(store: Store, mode: str) -> None:
    prefix = unique_prefix()
    caches = Caches(num_blocks=4, seed=5)
    caches.fill()
    saves = transfers({0: [1], 1: [2], 2: [3]}, prefix=prefix)  # block index 0 everywhere
    with engine_for(store, caches, mode) as engine:
        assert save(engine, saves, mode).ok
        owned = engine.owned_blocks("req")
        assert sorted(owned) == [(0, 0), (1, 0), (2, 0)]
        assert engine.poll_finished() == ({"req"}, set())
    for transfer in saves:
        layout = caches.layouts[transfer.group]
        assert read_object(store, transfer.key, layout.object_size) == caches.block_bytes(
            transfer.group, transfer.local_block
        )


class HeldReads(MemoryStore):
    """Whole reads wait until `go` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def batch_get_whole(self, *args: object) -> list[Status]:
        assert self.go.wait(10)
        return super().batch_get_whole(*args)  # type: ignore[arg-type]


def test_released_requests_are_not_kept_for_a_poll_that_never_comes() -> None:
    """vLLM's worker waits on tickets and never polls: released ids must not pile up, nor
    those released while their transfers run (vLLM frees a request aborted during its
    background load before the load ends)."""
    store = HeldReads()
    caches = Caches(num_blocks=4, seed=5)
    caches.fill()
    prefix = unique_prefix()
    with engine_for(store, caches, "staged") as engine:
        assert engine.save(transfers({0: [0]}, "a", prefix)).wait(timeout=10).ok
        loading = engine.load(transfers({0: [1]}, "b", prefix))
        engine.release(["a", "b"])
        store.go.set()
        assert loading.wait(timeout=10).ok
        assert engine.poll_finished() == (set(), set())
        again = engine.load(transfers({0: [2]}, "b", prefix))  # the same id, later
        assert again.wait(timeout=10).ok
        assert engine.poll_finished() == (set(), {"b"})


@pytest.mark.parametrize("mode", MODES)
def test_two_requests_sharing_a_key_write_it_once(mode: str) -> None:
    store = MemoryStore()
    prefix = unique_prefix()
    caches = Caches(num_blocks=4, seed=6)
    caches.fill()
    first = transfers({0: [0]}, "a", prefix)
    second = transfers({0: [1]}, "b", prefix)  # same key, other request, other local block
    with engine_for(store, caches, mode) as engine:
        result = save(engine, [*first, *second], mode)
        assert engine.poll_finished()[0] == {"a", "b"}
        assert engine.outstanding("save") == 0
    assert result.bytes == caches.layouts[0].object_size
    assert read_object(store, first[0].key, caches.layouts[0].object_size) == caches.block_bytes(
        0, 0
    )


def test_a_rider_finishes_only_when_the_write_it_waits_for_settles() -> None:
    store = MemoryStore()
    caches = Caches(num_blocks=4, seed=7)
    caches.fill()
    prefix = unique_prefix()
    with engine_for(store, caches, "layer") as engine:
        step = engine.begin_layerwise(saves=transfers({0: [0]}, "a", prefix))
        ticket = engine.save(transfers({0: [2]}, "b", prefix))
        with pytest.raises(TimeoutError, match="riding"):
            ticket.wait(timeout=0.2)
        assert not ticket.done
        assert engine.poll_finished() == (set(), set())  # and b waits for a's commit
        for layer in range(NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
        assert step.finish().ok
        riding = ticket.wait(timeout=10)
        assert riding.ok
        assert riding.bytes == 0  # b wrote nothing: a owns the write
        assert engine.poll_finished()[0] == {"a", "b"}


@pytest.mark.parametrize("mode", MODES)
def test_a_rider_sees_the_failure_of_the_write_it_rode_on(mode: str) -> None:
    store = MemoryStore()
    caches = Caches(num_blocks=4, seed=7)
    caches.fill()
    prefix = unique_prefix()
    writer_saves = transfers({0: [0, 1]}, "a", prefix)
    failing = writer_saves[1].key
    store.fail_next(
        "put_ranges" if mode == "layer" else "batch_put_whole", [failing], Status.NO_SPACE
    )
    with engine_for(store, caches, mode) as engine:
        step = engine.begin_layerwise(saves=writer_saves)
        ticket = engine.save(transfers({0: [3, 2]}, "b", prefix))  # rides on both keys
        for layer in range(NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
        written = step.finish()
        riding = ticket.wait(timeout=10)
    assert written.failed_keys == [failing]
    assert riding.failed_keys == [failing]
    assert riding.failed_blocks == {0: {2}}  # b's own local block, not a's
    assert store.batch_is_readable([t.key for t in writer_saves]) == [True, False]


def test_a_rider_of_a_write_another_instance_contended_is_contended_too() -> None:
    """Another instance holds the key's put session: the write this save rides on stores
    nothing and fails nothing, and so does the rider."""
    store = MemoryStore()
    caches = Caches(num_blocks=4, seed=7)
    caches.fill()
    writer_saves = transfers({0: [0]}, "a", unique_prefix())
    contended = writer_saves[0].key
    other = store.another_client()
    assert other.put_session_start([contended], [caches.layouts[0].object_size]) == [Status.OK]
    with engine_for(store, caches, "layer") as engine:
        step = engine.begin_layerwise(saves=writer_saves)
        ticket = engine.save([msgspec.structs.replace(writer_saves[0], request_id="b")])
        for layer in range(NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
        written = step.finish()
        riding = ticket.wait(timeout=10)
    for result in (written, riding):
        assert result.ok
        assert result.contended_keys == [contended]
    assert store.batch_is_readable([contended]) == [False]


def test_a_rider_whose_write_settles_right_after_its_claim_waits_for_its_own_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write a save rides on may settle as soon as the claim registered the rider: the
    rider's count must be begun by then, or it ends below zero, the request is reported
    finished while its own write still waits, and a count stays outstanding forever."""
    caches = Caches(num_blocks=4, seed=7)
    caches.fill()
    prefix = unique_prefix()
    writer_ready, own_ready = GateEvent(), GateEvent()
    with engine_for(MemoryStore(), caches, "whole") as engine:
        writer = engine.save(transfers({0: [0]}, "a", prefix), ready=writer_ready)
        claim = engine._ownership.claim

        def claim_then_settle_the_ridden_write(
            saves: Sequence[BlockTransfer],
            outcome: RideOutcome,
            accepted: Callable[[], None] | None = None,
        ) -> Claim:
            claimed = claim(saves, outcome, accepted)
            writer_ready.fire()
            assert writer.wait(timeout=10).ok
            return claimed

        monkeypatch.setattr(engine._ownership, "claim", claim_then_settle_the_ridden_write)
        # b rides on a's key of group 0 and writes its own key of group 1 after own_ready.
        rider = engine.save(transfers({0: [2], 1: [3]}, "b", prefix), ready=own_ready)
        try:
            assert engine.poll_finished() == ({"a"}, set())
        finally:
            own_ready.fire()
        assert rider.wait(timeout=10).ok
        assert engine.poll_finished() == ({"b"}, set())
        assert engine.outstanding("save") == 0


def test_a_failed_save_of_a_key_another_request_committed_keeps_that_owner() -> None:
    """A new owner's write of a stored key may fail (here its existence query): only that
    owner is forgotten, to try again later; the request that committed the key still owns
    it, or a chunked prefill would save its blocks again."""
    store = MemoryStore()
    caches = Caches(num_blocks=4, seed=7)
    caches.fill()
    prefix = unique_prefix()
    key = f"{prefix}@group:0@0"
    with engine_for(store, caches, "whole") as engine:
        assert engine.save(transfers({0: [1]}, "a", prefix)).wait(timeout=10).ok
        store.fail_next("batch_is_readable", [key], Status.RPC_FAILED)
        failed = engine.save(transfers({0: [2]}, "b", prefix)).wait(timeout=10)
        assert failed.failed_keys == [key]
        assert engine.owned_blocks("a") == {(0, 0): OwnedBlock(key, 1, committed=True)}
        assert engine.owned_blocks("b") == {}


def test_an_owner_cannot_change_its_key_until_every_owner_is_released() -> None:
    caches = Caches(num_blocks=4)
    with engine_for(MemoryStore(), caches, "whole") as engine:
        engine.save([BlockTransfer("x", 0, 0, "r", 0)]).wait(timeout=10)
        with pytest.raises(ValueError, match="already owns key 'x'"):
            engine.save([BlockTransfer("y", 0, 1, "r", 0)])
        engine.release_all()  # after a cache reset every block hashes anew
        assert engine.save([BlockTransfer("y", 0, 1, "r", 0)]).wait(timeout=10).ok
        assert engine.owned_blocks("r")[(0, 0)].key == "y"


def test_a_batch_refused_for_a_changed_key_claims_none_of_its_keys() -> None:
    store = MemoryStore()
    caches = Caches(num_blocks=8)
    caches.fill()
    with engine_for(store, caches, "whole") as engine:
        assert engine.save([BlockTransfer("x", 0, 0, "r", 0)]).wait(timeout=10).ok
        refused = [BlockTransfer("c", 0, 1, "r", 1), BlockTransfer("y", 0, 2, "r", 0)]
        with pytest.raises(ValueError, match="already owns key 'x'"):
            engine.save(refused)
        assert engine.outstanding("save") == 0
        # "c" was not left marked as being written: a later save of it writes it.
        assert engine.save([BlockTransfer("c", 0, 3, "other", 0)]).wait(timeout=10).ok
        assert sorted(engine.owned_blocks("r")) == [(0, 0)]
    assert "c" in store.committed_objects()


def test_one_owner_with_two_keys_in_one_batch_is_refused_before_either_is_claimed() -> None:
    caches = Caches(num_blocks=8)
    with engine_for(MemoryStore(), caches, "whole") as engine:
        with pytest.raises(ValueError, match="already owns key 'a'"):
            engine.save([BlockTransfer("a", 0, 0, "r", 0), BlockTransfer("b", 0, 1, "r", 0)])
        assert engine.owned_blocks("r") == {}
        assert engine.save([BlockTransfer("b", 0, 1, "r", 0)]).wait(timeout=10).ok


def test_a_rider_finished_before_its_writer_step_ends_that_step_and_carries_its_fate() -> None:
    store = MemoryStore()
    caches = Caches(num_blocks=4)
    caches.fill()
    engine = TransferEngine(store, caches.layouts, PipelineOptions(granularity="layer"))
    writer = engine.begin_layerwise(saves=[BlockTransfer("K", 0, 0, "A", 0)])
    writer.save_layer(0, CpuEvent())  # group 0 also needs layer 2: it never comes
    rider = engine.begin_layerwise(saves=[BlockTransfer("K", 0, 1, "B", 0)])
    results: list[TransferResult] = []
    finisher = threading.Thread(target=lambda: results.append(rider.finish()), daemon=True)
    finisher.start()
    finisher.join(timeout=10)
    assert not finisher.is_alive(), "the rider's finish() waits for a step nobody ends"
    assert results[0].failed_keys == ["K"]
    assert results[0].failed_blocks == {0: {1}}  # the rider's own local block
    with pytest.raises(RuntimeError, match="ended"):
        writer.save_layer(2, CpuEvent())
    assert writer.finish().failed_keys == ["K"]  # the unsaved group was dropped
    engine.close()
    assert engine.poll_finished()[0] == {"A", "B"}
    assert engine.outstanding("save") == 0
    assert store.open_put_sessions() == set()
    assert store.batch_is_readable(["K"]) == [False]


@pytest.mark.parametrize("mode", ["layer", "group"])
def test_committed_keys_resume_with_current_local_ids_across_chunked_steps(
    store: Store, mode: str
) -> None:
    prefix = unique_prefix()
    caches = Caches(num_blocks=8, seed=8)
    caches.fill()
    with engine_for(store, caches, mode) as engine:
        first = save(engine, transfers({0: [1, 2], 1: [3]}, "r", prefix), mode)
        assert not first.skipped_keys
        expected = {
            (0, 0): caches.block_bytes(0, 1),
            (0, 1): caches.block_bytes(0, 2),
            (1, 0): caches.block_bytes(1, 3),
        }
        # Next chunk: no load spec, vLLM's block ids moved, one new block per group.
        second_step = transfers({0: [5, 6, 7], 1: [4, 0]}, "r", prefix)
        caches.fill()
        second = save(engine, second_step, mode)
        assert sorted(second.skipped_keys) == sorted(
            t.key for t in second_step if (t.group, t.block_index) in expected
        )
        owned = engine.owned_blocks("r")
        assert {place: block.local_block for place, block in owned.items()} == {
            (0, 0): 5,
            (0, 1): 6,
            (0, 2): 7,
            (1, 0): 4,
            (1, 1): 0,
        }
        assert all(block.committed for block in owned.values())
        expected[(0, 2)] = caches.block_bytes(0, 7)
        expected[(1, 1)] = caches.block_bytes(1, 0)
        target = Caches(num_blocks=8, seed=9)
        places = sorted(expected)
        loads = [
            BlockTransfer(f"{prefix}@group:{group}@{index}", group, slot, "reader", index)
            for slot, (group, index) in enumerate(places)
        ]
    with engine_for(store, target, mode) as reader:
        assert load(reader, loads, mode).ok
    for slot, place in enumerate(places):
        assert target.block_bytes(place[0], slot) == expected[place]


def test_a_step_ending_its_pins_leaves_another_step_reading_the_same_key_pinned(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two overlapping "layer" steps load one key (the pool keeps one get session per
    client and key): the first to finish must not end the pin the other still reads
    under, or that one's next read fails and pays a re-pin."""
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=8)
    source.fill()
    [saved] = transfers({1: [2]}, "writer", prefix)
    with engine_for(store, source, "group") as engine:
        assert save(engine, [saved], "group").ok
    statuses: list[Status] = []
    get_ranges = store.get_ranges

    def recorded(*args: Sequence[object]) -> list[Status]:
        answer = get_ranges(*args)  # type: ignore[arg-type]
        statuses.extend(answer)
        return answer

    monkeypatch.setattr(store, "get_ranges", recorded)
    target = Caches(num_blocks=8)
    with engine_for(store, target, "layer", prefetch_layers=0) as engine:
        first = engine.begin_layerwise(loads=[BlockTransfer(saved.key, 1, 3, "a")])
        second = engine.begin_layerwise(loads=[BlockTransfer(saved.key, 1, 5, "b")])
        second.wait_layer_loaded(1)
        for layer in range(NUM_LAYERS):
            first.wait_layer_loaded(layer)
        assert first.finish().ok
        for layer in range(NUM_LAYERS):
            second.wait_layer_loaded(layer)
        assert second.finish().ok
        assert len(engine._client.pins) == 0
    assert statuses
    assert set(statuses) == {Status.OK}
    for local in (3, 5):
        assert target.block_bytes(1, local) == source.block_bytes(1, 2)
    if isinstance(store, MemoryStore):
        assert store.open_get_sessions() == set()
