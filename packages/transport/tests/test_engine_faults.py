"""Failures at the engine level: only affected keys fail, nothing partial is readable,
no session, lease or counter leaks, and errors reach the caller."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from _engine_drive import (
    PER_LAYER_OR_IN_PLACE,
    LayerCheck,
    engine_for,
    load,
    read_object,
    save,
    unique_prefix,
)
from _engine_model import ALL_GROUPS, NUM_LAYERS, Caches, transfers
from _engine_stores import BrokenEvent, FailingCommitStore, FailingOpenStore, fail_at_call

from hybridkv.transport import BlockTransfer, TransferEngine, store_calls
from hybridkv.transport.device_events import CpuEvent
from hybridkv.transport.errors import Status, StoreClosed, StoreUnavailable
from hybridkv.transport.memory_store import MemoryStore
from hybridkv.transport.mooncake_store import MooncakeStore
from hybridkv.transport.outcome import Outcome
from hybridkv.transport.stale_put_sessions import StaleSessions
from hybridkv.transport.store import Pointers, Sizes
from hybridkv.transport.testing import StartHolder, StartMaster, mooncake_config, stalled

BLOCKS = {0: [0, 1], 1: [2, 3], 2: [4]}
STAGED_OR_IN_PLACE_OR_LAYER = pytest.mark.parametrize(
    ("mode", "block_major"),
    [("staged", ()), ("staged", ALL_GROUPS), ("layer", ())],
    ids=["staged", "staged-in-place", "layer"],
)


def assert_clean(store: MemoryStore, engine_outstanding: int) -> None:
    assert store.open_put_sessions() == set()
    assert store.open_get_sessions() == set()
    assert engine_outstanding == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("hybridkv-")]


def filled_caches_and_saves(seed: int) -> tuple[Caches, list[BlockTransfer]]:
    """Caches of random bytes and a save of every block of BLOCKS under fresh keys."""
    caches = Caches(num_blocks=8, seed=seed)
    caches.fill()
    return caches, transfers(BLOCKS, prefix=unique_prefix())


def save_every_layer_raising(
    engine: TransferEngine, saves: list[BlockTransfer], error: str
) -> None:
    """A layerwise save of every layer, whose step end raises `error`."""
    step = engine.begin_layerwise(saves=saves)
    for layer in range(NUM_LAYERS):
        step.save_layer(layer, CpuEvent())
    with pytest.raises(RuntimeError, match=error):
        step.finish()


def test_a_range_put_failing_mid_way_revokes_only_its_keys() -> None:
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=11)
    broken = saves[1]  # group 0, logical block 1, local block 1
    # Calls go layer by layer (0, 1, 2, 3): group 0's layer 0 lands, its layer 2 fails.
    fail_at_call(store, "put_ranges", 3, [broken.key], Status.TRANSFER_FAILED)
    with engine_for(store, caches, "layer") as engine:
        result = save(engine, saves, "layer")
        outstanding = engine.outstanding("save")
    assert result.failed_blocks == {0: {1}}
    assert result.failed_keys == [broken.key]
    readable = store.batch_is_readable([t.key for t in saves])
    assert readable == [t is not broken for t in saves]  # other group 0 block + groups 1, 2
    for transfer in saves:
        if transfer is not broken:
            size = caches.layouts[transfer.group].object_size
            assert read_object(store, transfer.key, size) == caches.block_bytes(
                transfer.group, transfer.local_block
            )
    assert_clean(store, outstanding)


def test_a_failed_commit_is_revoked_and_other_groups_still_commit() -> None:
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=12)
    store.fail_next("put_session_end", [saves[2].key], Status.RPC_FAILED)  # group 1 block 0
    with engine_for(store, caches, "layer") as engine:
        result = save(engine, saves, "layer")
        outstanding = engine.outstanding("save")
    assert result.failed_blocks == {1: {2}}
    assert store.batch_is_readable([t.key for t in saves]) == [True, True, False, True, True]
    assert_clean(store, outstanding)


def test_an_exception_while_preparing_revokes_everything_it_opened() -> None:
    store = FailingOpenStore()
    caches, saves = filled_caches_and_saves(seed=13)
    with engine_for(store, caches, "layer") as engine:
        save_every_layer_raising(engine, saves, "crashed after opening")
        assert engine.poll_finished()[0] == {"req"}  # counters released anyway
        outstanding = engine.outstanding("save")
    assert store.batch_is_readable([t.key for t in saves]) == [False] * len(saves)
    assert_clean(store, outstanding)


def test_a_commit_that_raises_revokes_its_sessions_and_the_keys_can_be_saved_again() -> None:
    """A group whose commit raised got all of its layers, so draining the step skips it:
    the commit itself revokes its sessions, else they stay open for good and the keys
    (taken as stored elsewhere by the next save) never become readable."""
    store = FailingCommitStore()
    caches, saves = filled_caches_and_saves(seed=15)
    with engine_for(store, caches, "layer") as engine:
        save_every_layer_raising(engine, saves, "crashed while committing")
        assert store.open_put_sessions() == set()
        assert save(engine, saves, "layer").failed_keys == []
        outstanding = engine.outstanding("save")
    assert store.batch_is_readable([t.key for t in saves]) == [True] * len(saves)
    assert_clean(store, outstanding)


@pytest.mark.parametrize("again", ["layer", "whole", None], ids=["layer", "whole", "closed"])
def test_a_session_whose_revoke_failed_is_revoked_before_its_key_is_reused(
    again: str | None,
) -> None:
    """A failed range put's revoke fails too, leaving the session open: the pool would let
    no one write the key, this client's every later start on it says INVALID and its whole
    put OK without writing. It is revoked again before the next save of the key, layer by
    layer or whole, or at the engine's close."""
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=16)
    broken = saves[1]
    fail_at_call(store, "put_ranges", 3, [broken.key], Status.TRANSFER_FAILED)
    store.fail_next("put_session_revoke", [broken.key], Status.RPC_FAILED)
    with engine_for(store, caches, "layer") as engine:
        assert save(engine, saves, "layer").failed_keys == [broken.key]
        assert store.open_put_sessions() == {broken.key}
        if again is not None:
            assert save(engine, saves, again).ok
            assert store.open_put_sessions() == set()
        outstanding = engine.outstanding("save")
    readable = [t is not broken or again is not None for t in saves]
    assert store.batch_is_readable([t.key for t in saves]) == readable
    assert_clean(store, outstanding)


def _revoke_raises(keys: Sequence[str]) -> list[Status]:
    raise RuntimeError("client error in revoke")


def _start_then_raise(store: MemoryStore) -> Callable[[Sequence[str], Sequence[int]], list[Status]]:
    start = store.put_session_start

    def crash(keys: Sequence[str], sizes: Sequence[int]) -> list[Status]:
        start(keys, sizes)
        raise RuntimeError("client error in put_session_start")

    return crash


@pytest.mark.parametrize("fault", ["put_session_start", "put_ranges", "put_session_end"])
def test_a_revoke_whose_client_raises_leaves_its_keys_failed_remembered_and_reusable(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening the sessions raises after opening them, or a key's range put or put session
    end fails; then the revoke raises (not a store error): the step raises with every key
    that is not readable reported failed (failures are recorded before the revoke) and
    every session left open remembered; the keys' next save revokes them first."""
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=27)
    broken = saves[1]
    if fault == "put_session_start":
        monkeypatch.setattr(store, "put_session_start", _start_then_raise(store))
    elif fault == "put_ranges":
        fail_at_call(store, "put_ranges", 3, [broken.key], Status.TRANSFER_FAILED)
    else:
        store.fail_next("put_session_end", [broken.key], Status.TRANSFER_FAILED)
    monkeypatch.setattr(store, "put_session_revoke", _revoke_raises)
    keys = [t.key for t in saves]
    with engine_for(store, caches, "layer") as engine:
        step = engine.begin_layerwise(saves=saves)
        for layer in range(NUM_LAYERS):
            step.save_layer(layer, CpuEvent())
        with pytest.raises(RuntimeError, match="client error in"):
            step.finish()
        failed = step._save_outcome.result().failed_keys
        readable = store.batch_is_readable(keys)
        unreadable = {key for key, ok in zip(keys, readable, strict=True) if not ok}
        assert broken.key in failed
        assert sorted(failed) == sorted(unreadable)  # each once
        assert store.open_put_sessions() == engine._client.stale._keys
        assert broken.key in store.open_put_sessions()
        monkeypatch.undo()
        assert save(engine, saves, "layer").ok
        outstanding = engine.outstanding("save")
    assert store.batch_is_readable(keys) == [True] * len(saves)
    assert_clean(store, outstanding)


def test_a_session_start_left_unanswered_is_revoked_and_its_keys_save_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The master opens the sessions but its answer is lost (RPC_TIMEOUT: RPC_FAILED): the
    keys fail, no session stays open, and this client's next save stores them (an open
    session of its own would make its start report INVALID for as long as it lives)."""
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=29)
    start = store.put_session_start

    def answer_lost(keys: Sequence[str], sizes: Sequence[int]) -> list[Status]:
        start(keys, sizes)
        return [Status.RPC_FAILED] * len(keys)

    monkeypatch.setattr(store, "put_session_start", answer_lost)
    keys = [t.key for t in saves]
    with engine_for(store, caches, "layer") as engine:
        assert sorted(save(engine, saves, "layer").failed_keys) == sorted(keys)
        assert store.open_put_sessions() == set()
        monkeypatch.undo()
        assert save(engine, saves, "layer").ok
        outstanding = engine.outstanding("save")
    assert store.batch_is_readable(keys) == [True] * len(saves)
    assert_clean(store, outstanding)


def test_a_close_whose_teardown_raises_still_frees_staging_and_unregisters() -> None:
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=28)
    engine = engine_for(store, caches, "staged")
    assert save(engine, saves, "staged").ok
    unregistered: list[int] = []
    store.unregister_buffer = unregistered.append  # type: ignore[method-assign]
    engine._client.stale.revoke_all = functools.partial(_revoke_raises, [])  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="client error in revoke"):
        engine.close()
    assert engine.staging is not None
    assert engine.staging._array is None  # freed
    assert len(unregistered) >= 2  # the staging buffer and the caches
    assert not [t for t in threading.enumerate() if t.name.startswith("hybridkv-")]


def test_a_key_another_writer_held_stays_contended_when_the_check_gets_no_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check at the commit of a key whose session start said EXISTS gets no answer:
    the key stays the other writer's (contended); ours commit."""
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=17)
    theirs = saves[0]
    other = store.another_client()
    size = caches.layouts[theirs.group].object_size
    assert other.put_session_start([theirs.key], [size]) == [Status.OK]
    query, calls = store.batch_is_readable, itertools.count()

    def existence_query_only(keys: Sequence[str]) -> list[bool]:
        if next(calls):
            raise StoreUnavailable("master gone")
        return query(keys)

    monkeypatch.setattr(store, "batch_is_readable", existence_query_only)
    with engine_for(store, caches, "layer") as engine:
        result = save(engine, saves, "layer")
    monkeypatch.undo()
    assert result.ok
    assert result.contended_keys == [theirs.key]
    assert store.batch_is_readable([t.key for t in saves]) == [t is not theirs for t in saves]


def test_stale_sessions_remember_exactly_the_revokes_the_pool_did_not_confirm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key failing with a status other than INVALID or NOT_FOUND, or every key of a call
    that raised, stays remembered until a revoke of it is confirmed."""
    store = MemoryStore()
    assert store.put_session_start(["a", "b"], [8, 8]) == [Status.OK, Status.OK]
    stale = StaleSessions(store)
    store.fail_next("put_session_revoke", ["a"], Status.RPC_FAILED)
    stale.revoke(["a", "b", "never-opened"])
    assert len(stale) == 1
    assert store.open_put_sessions() == {"a"}
    revoke = store.put_session_revoke

    def unanswered(keys: Sequence[str]) -> list[Status]:
        raise StoreUnavailable("master gone")

    monkeypatch.setattr(store, "put_session_revoke", unanswered)
    stale.revoke_again(["a"])
    assert len(stale) == 1
    monkeypatch.setattr(store, "put_session_revoke", _revoke_raises)
    with pytest.raises(RuntimeError, match="client error"):
        stale.revoke(["b"])  # never opened: remembered all the same, as nothing confirmed it
    assert len(stale) == 2
    stale.revoke_all()  # at close: logged, not raised
    assert len(stale) == 2
    monkeypatch.setattr(store, "put_session_revoke", revoke)
    stale.revoke_all()
    assert len(stale) == 0
    assert store.open_put_sessions() == set()


@pytest.mark.parametrize("mode", ["layer", "staged"])
def test_an_unanswered_existence_query_fails_the_save_and_opens_nothing(mode: str) -> None:
    """The master gives no answer to the query that skips keys already stored: the store
    raises rather than report a miss, and every block of the save fails before any put."""
    store = MemoryStore()
    caches, saves = filled_caches_and_saves(seed=14)
    store.fail_next("batch_is_readable", lambda key: True, Status.RPC_FAILED)
    with engine_for(store, caches, mode) as engine:
        result = save(engine, saves, mode)
        outstanding = engine.outstanding("save")
    assert sorted(result.failed_keys) == sorted(t.key for t in saves)
    assert store.committed_objects() == {}
    assert_clean(store, outstanding)


def test_a_store_without_an_answer_raises_instead_of_reporting_a_miss() -> None:
    store = MemoryStore()
    store.fail_next("batch_is_readable", ["a"], Status.TRANSFER_FAILED)
    assert store.batch_is_readable(["a", "b"]) == [False, False]  # a failure on one key
    store.fail_next("batch_is_readable", ["a"], Status.RPC_FAILED)
    with pytest.raises(StoreUnavailable, match=r"batch_is_readable of 'a'.*RPC_FAILED"):
        store.batch_is_readable(["a", "b"])


@PER_LAYER_OR_IN_PLACE
@pytest.mark.parametrize("mode", ["layer", "group", "staged"])
def test_a_get_failing_mid_layer_names_the_blocks_before_they_are_used(
    mode: str, block_major: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Staged calls cut into one part per key: the broken key's part sits between good ones.
    monkeypatch.setattr(store_calls, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(store_calls, "OVERLAP_PARTS", 1000)
    store = MemoryStore()
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=14)
    target = Caches(num_blocks=8, seed=15, block_major=block_major)
    source.fill()
    with engine_for(store, source, "whole") as writer:
        assert save(writer, transfers(BLOCKS, prefix=prefix), "whole").ok
    loads = transfers({0: [5, 6], 1: [7, 0], 2: [1]}, "reader", prefix)
    broken = loads[3]  # group 1 (layers 1, 2, 3), local block 0
    if mode == "layer":  # layers 0 and 1 arrive, layer 2 of the broken key fails (retry too)
        fail_at_call(store, "get_ranges", 3, [broken.key], Status.TRANSFER_FAILED, times=2)
    else:
        store.fail_next("batch_get_whole", [broken.key], Status.TRANSFER_FAILED)
    remap = {(t.group, BLOCKS[t.group][t.block_index]): t.local_block for t in loads}
    check = LayerCheck(source, target, remap)
    with engine_for(store, target, mode) as reader:
        step = reader.begin_layerwise(loads=loads)
        seen = {}
        for layer in range(NUM_LAYERS):
            seen[layer] = step.wait_layer_loaded(layer)
            check(layer, seen[layer])
        result = step.finish()
        assert reader.poll_finished()[1] == {"reader"}
        outstanding = reader.outstanding("load")
    # Reported no later than the first layer that needs the missing bytes (prefetch may
    # report it earlier); every block not reported was checked complete at each layer.
    first_failed_layer = 2 if mode == "layer" else 1
    assert seen[first_failed_layer] == {1: {0}}
    assert result.failed_blocks == {1: {0}}
    assert_clean(store, outstanding)


@PER_LAYER_OR_IN_PLACE
def test_a_staged_put_failing_in_one_part_drops_only_its_key(
    block_major: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_calls, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(store_calls, "OVERLAP_PARTS", 1000)
    store = MemoryStore()
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=16, block_major=block_major)
    source.fill()
    saves = transfers(BLOCKS, prefix=prefix)
    broken = saves[2]  # group 1, between good keys of the same call
    store.fail_next("batch_put_whole", [broken.key], Status.TRANSFER_FAILED)
    reference = transfers(BLOCKS, prefix=unique_prefix())  # same bytes, one part, no fault
    with engine_for(store, source, "group") as plain:
        assert save(plain, reference, "group").ok
    with engine_for(store, source, "staged") as writer:
        result = save(writer, saves, "staged")
        outstanding = writer.outstanding("save")
    assert result.failed_keys == [broken.key]
    assert store.batch_is_readable([t.key for t in saves]) == [t != broken for t in saves]
    for transfer, expected in zip(saves, reference, strict=True):
        if transfer != broken:
            size = source.layouts[transfer.group].object_size
            assert read_object(store, transfer.key, size) == read_object(store, expected.key, size)
    assert_clean(store, outstanding)


def test_a_full_store_fails_the_keys_that_do_not_fit_and_commits_the_rest() -> None:
    caches, saves = filled_caches_and_saves(seed=16)
    sizes = {layout.group_id: layout.object_size for layout in caches.layouts}
    store = MemoryStore(capacity=2 * sizes[0] + sizes[1])
    with engine_for(store, caches, "layer") as engine:
        result = save(engine, saves, "layer")
        outstanding = engine.outstanding("save")
    assert result.failed_blocks == {1: {3}, 2: {4}}
    assert store.batch_is_readable([t.key for t in saves]) == [True, True, True, False, False]
    assert_clean(store, outstanding)


class CountingStore(MemoryStore):
    """Counts existence queries: every save that runs starts with one."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0

    def batch_is_readable(self, keys: Sequence[str]) -> list[bool]:
        self.queries += 1
        return super().batch_is_readable(keys)


@pytest.mark.parametrize("mode", ["whole", "staged", "layer", "group"])
def test_a_full_pool_pauses_saves_before_any_copy_or_store_call(mode: str) -> None:
    caches, saves = filled_caches_and_saves(seed=18)
    store = CountingStore()
    refused = "put_session_start" if mode == "layer" else "batch_put_whole"
    store.fail_next(refused, [saves[0].key], Status.NO_SPACE)
    with engine_for(store, caches, mode, full_pool_pause_s=60) as engine:
        assert save(engine, saves, mode).failed_keys == [saves[0].key]
        queries = store.queries
        later = transfers(BLOCKS, "later", prefix=unique_prefix())
        paused = save(engine, later, mode)
        outstanding = engine.outstanding("save")
        assert engine.staging is None or engine.staging.in_use == 0
    assert sorted(paused.failed_keys) == sorted(t.key for t in later)
    assert paused.bytes == 0
    assert store.queries == queries  # not even the existence query
    assert store.batch_is_readable([t.key for t in saves[1:] + later]) == [True] * 4 + [False] * 5
    assert_clean(store, outstanding)


def test_saves_resume_after_the_pause_and_a_zero_pause_never_pauses() -> None:
    caches, saves = filled_caches_and_saves(seed=19)
    store = MemoryStore()
    store.fail_next("batch_put_whole", [saves[0].key], Status.NO_SPACE, calls=2)
    with engine_for(store, caches, "whole", full_pool_pause_s=0) as engine:
        assert save(engine, saves, "whole").failed_keys == [saves[0].key]
        assert save(engine, saves, "whole").failed_keys == [saves[0].key]  # tried again
    caches, saves = filled_caches_and_saves(seed=20)
    store.fail_next("batch_put_whole", [saves[0].key], Status.NO_SPACE)
    with engine_for(store, caches, "whole", full_pool_pause_s=0.2) as engine:
        assert save(engine, saves, "whole").failed_keys == [saves[0].key]
        assert len(save(engine, saves, "whole").failed_keys) == 1  # paused: the rest stored
        time.sleep(0.3)
        assert save(engine, saves, "whole").ok  # the pause is over: the pool took it
    assert all(store.batch_is_readable([t.key for t in saves]))


def test_a_save_that_moves_nothing_leaves_the_full_pool_episode_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caches, saves = filled_caches_and_saves(seed=21)
    store = MemoryStore()
    store.fail_next("batch_put_whole", [saves[0].key], Status.NO_SPACE)
    with (
        caplog.at_level(logging.INFO, logger="hybridkv.transport.pipeline"),
        engine_for(store, caches, "whole", full_pool_pause_s=0.2) as engine,
    ):
        assert save(engine, saves, "whole").failed_keys == [saves[0].key]
        time.sleep(0.3)
        stored = save(engine, saves[1:], "whole")  # every key already in the pool
        assert stored.ok
        assert stored.bytes == 0
        assert "saves resume" not in caplog.text
        assert save(engine, saves, "whole").ok  # the refused key fits now
    assert caplog.text.count("the pool is full") == 1
    assert "saves resume" in caplog.text


def test_a_device_error_reaches_the_caller_and_revokes_the_step() -> None:
    store = MemoryStore()
    caches = Caches(num_blocks=8, seed=17)
    saves = transfers(BLOCKS, prefix=unique_prefix())
    with engine_for(store, caches, "layer") as engine:
        step = engine.begin_layerwise(saves=saves)
        step.save_layer(0, CpuEvent())
        step.save_layer(1, BrokenEvent())
        for layer in (2, 3):
            step.save_layer(layer, CpuEvent())
        with pytest.raises(RuntimeError, match="device lost"):
            step.finish()
        assert engine.backlog.outstanding == 0
        outstanding = engine.outstanding("save")
        with pytest.raises(RuntimeError, match="device lost"):
            engine.save(saves, ready=BrokenEvent()).wait(timeout=10)
        assert engine.outstanding("save") == 0
    # Layer 1 was never written: group 1 (layers 1-3) must not be readable. Group 0 and 2
    # objects were complete and committed.
    assert store.batch_is_readable([t.key for t in saves]) == [True, True, False, False, True]
    assert_clean(store, outstanding)


def test_finish_again_after_an_error_raises_the_same_error() -> None:
    caches = Caches(num_blocks=8, seed=17)
    with engine_for(MemoryStore(), caches, "layer") as engine:
        step = engine.begin_layerwise(saves=transfers(BLOCKS, prefix=unique_prefix()))
        step.save_layer(0, BrokenEvent())
        with pytest.raises(RuntimeError, match="device lost") as first:
            step.finish()
        with pytest.raises(RuntimeError, match="device lost") as again:
            step.finish()
        assert again.value is first.value


def test_a_staged_step_whose_start_raises_never_scatters_its_unfetched_slabs() -> None:
    """Group 0 moves in place: the start waits for the caches to be writable, and that
    wait fails after the other groups' slabs were handed out but before any fetch."""
    target = Caches(num_blocks=8, seed=24, block_major=(0,))
    target.fill()
    before = {place: array.copy() for place, array in target.arrays.items()}
    loads = transfers(BLOCKS, prefix=unique_prefix())
    with engine_for(MemoryStore(), target, "staged", prefetch_layers=0) as reader:
        step = reader.begin_layerwise(loads=loads, ready=BrokenEvent())
        with pytest.raises(RuntimeError, match="device lost"):
            step.wait_layer_loaded(0)
        # The caches are writable now: the later layers' scatters would run.
        with pytest.raises(RuntimeError, match="device lost"):
            step.wait_layer_loaded(NUM_LAYERS - 1, ready=CpuEvent())
        with pytest.raises(RuntimeError, match="device lost"):
            step.finish()
        assert step._load_outcome.failed_blocks() == {
            group: set(blocks) for group, blocks in BLOCKS.items()
        }
        assert reader.staging is not None
        assert reader.staging.in_use == 0
    for place, array in target.arrays.items():
        assert np.array_equal(array, before[place]), place


class CrashingGetStore(MemoryStore):
    """Whole-object gets write half of the first object, then raise (not a store error)."""

    def batch_get_whole(
        self, keys: Sequence[str], ptrs: Sequence[Pointers], sizes: Sequence[Sizes]
    ) -> list[Status]:
        super().batch_get_whole(keys[:1], ptrs[:1], sizes[:1])
        raise RuntimeError("client crashed mid-get")


class CrashingSessionStore(MemoryStore):
    """Get sessions pin every key, then raise (not a store error): which keys stayed
    pinned is unknown to the caller."""

    def get_session_start(self, keys: Sequence[str]) -> list[Status]:
        super().get_session_start(keys)
        raise RuntimeError("client crashed starting a get session")


class ReadRaises(MemoryStore):
    """Call `at` (0-based) of `operation` raises (not a store error) before moving anything."""

    def __init__(self, operation: str, at: int = 0) -> None:
        super().__init__()
        read = getattr(self, operation)
        calls = itertools.count()

        def raises_at(*args: object) -> object:
            if next(calls) == at:
                raise RuntimeError(f"client crashed in {operation}")
            return read(*args)

        setattr(self, operation, raises_at)


@pytest.mark.parametrize(
    ("crashing", "mode"),
    [
        (CrashingGetStore, "staged"),
        (CrashingSessionStore, "layer"),
        (functools.partial(ReadRaises, "get_ranges"), "layer"),
        (functools.partial(ReadRaises, "batch_get_whole"), "group"),
    ],
    ids=["staged-fetch", "get-session-start", "layer-read", "group-read"],
)
def test_a_load_whose_client_raises_fails_every_block_copies_nothing_and_leaks_nothing(
    crashing: Callable[[], MemoryStore], mode: str
) -> None:
    """The error reaches the caller even when it waits on the last layer only (a compiled
    model does) while the first one raised; every block is failed, none is copied, and no
    pin (a session start may have pinned any of its keys) or slab is left held. Every
    other wait raises it again: each covers the layer whose job failed."""
    store = crashing()
    source, saves = filled_caches_and_saves(seed=18)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    target = Caches(num_blocks=8, seed=19)
    every_block = {group: set(blocks) for group, blocks in BLOCKS.items()}
    with engine_for(store, target, mode, prefetch_layers=0) as reader:
        step = reader.begin_layerwise(loads=saves)
        with pytest.raises(RuntimeError, match="client crashed"):
            step.wait_layer_loaded(NUM_LAYERS - 1)
        assert step._load_outcome.failed_blocks() == every_block
        assert step.blamed_loads() == []  # no object is at fault
        for layer in range(NUM_LAYERS - 1):
            with pytest.raises(RuntimeError, match="client crashed"):
                step.wait_layer_loaded(layer)
        with pytest.raises(RuntimeError, match="client crashed"):
            step.finish()
        assert (reader.staging is not None) == (mode == "staged")
        assert reader.staging is None or reader.staging.in_use == 0
        outstanding = reader.outstanding("load")
    assert not any(array.any() for array in target.arrays.values())
    assert_clean(store, outstanding)


def test_a_step_whose_client_raises_blames_only_the_reads_the_store_failed() -> None:
    """A read the store failed (a status) before the client raised stays blamed, through
    the drain too; the blocks the client error failed are failed, not blamed."""
    store = ReadRaises("get_ranges", at=2)  # layer 0's read and its retry, then layer 1's
    source, saves = filled_caches_and_saves(seed=25)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    broken = saves[0]  # group 0: layers 0 and 2
    store.fail_next("get_ranges", [broken.key], Status.TRANSFER_FAILED, calls=2)
    target = Caches(num_blocks=8, seed=26)
    with engine_for(store, target, "layer", prefetch_layers=0) as reader:
        step = reader.begin_layerwise(loads=saves)
        assert step.wait_layer_loaded(0) == {0: {broken.local_block}}
        assert step.blamed_loads() == [broken.key]
        with pytest.raises(RuntimeError, match="client crashed"):
            step.wait_layer_loaded(1)
        with pytest.raises(RuntimeError, match="client crashed"):
            step.finish()
        assert step._load_outcome.failed_blocks() == {
            group: set(blocks) for group, blocks in BLOCKS.items()
        }
        assert step.blamed_loads() == [broken.key]
        outstanding = reader.outstanding("load")
    assert_clean(store, outstanding)


@pytest.mark.parametrize(
    ("first", "retry", "blamed"),
    [
        (Status.RPC_FAILED, Status.RPC_FAILED, False),
        (Status.TRANSFER_FAILED, Status.TRANSFER_FAILED, True),
        (Status.RPC_FAILED, Status.TRANSFER_FAILED, True),
        (Status.TRANSFER_FAILED, Status.RPC_FAILED, False),
    ],
)
def test_a_read_is_blamed_on_its_object_by_the_store_s_last_word_on_it(
    first: Status, retry: Status, blamed: bool
) -> None:
    """A ranged read retries a failed key once. RPC_FAILED (the master did not answer)
    says nothing of the object, any other failure does; the retry's word stands."""
    store = MemoryStore()
    source, saves = filled_caches_and_saves(seed=29)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    broken = saves[0]  # group 0: layers 0 and 2
    store.fail_next("get_ranges", [broken.key], first)
    store.fail_next("get_ranges", [broken.key], retry)
    target = Caches(num_blocks=8, seed=30)  # held: the engine writes into its memory
    with engine_for(store, target, "layer") as reader:
        step = reader.begin_layerwise(loads=saves)
        assert step.wait_layer_loaded(0) == {0: {broken.local_block}}
        result = step.finish()
        assert step.blamed_loads() == ([broken.key] if blamed else [])
        outstanding = reader.outstanding("load")
    assert result.failed_keys == [broken.key]
    assert result.blamed_keys == step.blamed_loads()
    assert_clean(store, outstanding)


def test_a_status_failure_stays_blamed_when_its_retry_raises() -> None:
    """Layer 0's read fails a key (a status); the retry of it raises (the client): the
    store's word on the key stands."""
    store = ReadRaises("get_ranges", at=1)
    source, saves = filled_caches_and_saves(seed=33)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    broken = saves[0]
    store.fail_next("get_ranges", [broken.key], Status.TRANSFER_FAILED)
    target = Caches(num_blocks=8, seed=34)
    with engine_for(store, target, "layer", prefetch_layers=0) as reader:
        step = reader.begin_layerwise(loads=saves)
        with pytest.raises(RuntimeError, match="client crashed"):
            step.wait_layer_loaded(0)
        with pytest.raises(RuntimeError, match="client crashed"):
            step.finish()
        assert step.blamed_loads() == [broken.key]


def test_a_read_its_retry_recovered_is_not_blamed_for_a_later_client_error() -> None:
    """Layer 0's reads fail (an expired lease) and their retry reads them; layer 1's
    device event then raises, failing every block: no object is to blame."""
    store = MemoryStore()
    source, saves = filled_caches_and_saves(seed=38)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    store.fail_next("get_ranges", [t.key for t in saves], Status.TRANSFER_FAILED)
    target = Caches(num_blocks=8, seed=39)
    with engine_for(store, target, "layer", prefetch_layers=0) as reader:
        step = reader.begin_layerwise(loads=saves)
        assert step.wait_layer_loaded(0) == {}
        with pytest.raises(RuntimeError, match="device lost"):
            step.wait_layer_loaded(1, BrokenEvent())
        with pytest.raises(RuntimeError, match="device lost"):
            step.finish()
        assert step._load_outcome.failed_blocks() == {
            group: set(blocks) for group, blocks in BLOCKS.items()
        }
        assert step.blamed_loads() == []
        outstanding = reader.outstanding("load")
    assert_clean(store, outstanding)


def test_a_key_whose_re_pin_is_unanswered_fails_unblamed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first read of a key fails (a lease may have expired); pinning it again gets
    no answer from the master: it fails without a retry, and no object is blamed."""
    store = MemoryStore()
    source, saves = filled_caches_and_saves(seed=35)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    broken = saves[0]
    store.fail_next("get_ranges", [broken.key], Status.TRANSFER_FAILED)
    fail_at_call(store, "get_session_start", 2, [broken.key], Status.RPC_FAILED)
    target = Caches(num_blocks=8, seed=36)
    with engine_for(store, target, "layer") as reader:
        step = reader.begin_layerwise(loads=saves)
        assert step.wait_layer_loaded(0) == {0: {broken.local_block}}
        result = step.finish()
        outstanding = reader.outstanding("load")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == ["get_session_start (re-pin): 1 of 1 keys failed: {'RPC_FAILED': 1}"]
    assert result.failed_keys == [broken.key]
    assert result.blamed_keys == []
    assert_clean(store, outstanding)


def test_a_whole_load_that_raises_still_knows_what_the_store_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One part of a whole load fails a key (a status), a later part raises: `wait()`
    raises, and the ticket still names the key the store failed."""
    monkeypatch.setattr(store_calls, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(store_calls, "OVERLAP_PARTS", 1000)
    store = ReadRaises("batch_get_whole", at=1)
    source, saves = filled_caches_and_saves(seed=37)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    store.fail_next("batch_get_whole", [saves[0].key], Status.TRANSFER_FAILED)
    target = Caches(num_blocks=8, seed=38)
    with engine_for(store, target, "group") as reader:
        ticket = reader.load(saves)
        with pytest.raises(RuntimeError, match="client crashed"):
            ticket.wait(timeout=60)
        assert ticket.blamed_keys() == [saves[0].key]


def test_an_outcome_s_result_is_a_snapshot() -> None:
    outcome = Outcome()
    outcome.failed(0, ["a"], [1])
    taken = outcome.result()
    outcome.failed(0, ["b"], [2], blamed=False)
    outcome.judged(["a"], [Status.RPC_FAILED])
    assert (taken.failed_keys, taken.failed_blocks, taken.blamed_keys) == (["a"], {0: {1}}, ["a"])
    assert outcome.result().blamed_keys == []


@pytest.mark.parametrize("mode", ["whole", "staged", "group"])
def test_a_load_the_master_does_not_answer_fails_every_key_and_blames_none(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore()
    source, saves = filled_caches_and_saves(seed=31)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok

    def unanswered(*args: object) -> list[Status]:
        raise StoreUnavailable("master gone")

    monkeypatch.setattr(store, "batch_get_whole", unanswered)
    target = Caches(num_blocks=8, seed=32)
    with engine_for(store, target, mode) as reader:
        result = load(reader, saves, mode)
    assert sorted(result.failed_keys) == sorted(t.key for t in saves)
    assert result.blamed_keys == []


def test_objects_of_a_dead_segment_owner_fail_the_load_not_the_reader(
    start_mooncake_master: StartMaster,
) -> None:
    master = start_mooncake_master()
    prefix = unique_prefix()
    source, target = Caches(num_blocks=8, seed=18), Caches(num_blocks=8, seed=19)
    source.fill()
    owner = MooncakeStore.connect(mooncake_config(master.address))
    with engine_for(owner, source, "whole") as writer:
        assert save(writer, transfers(BLOCKS, prefix=prefix), "whole").ok
    reader_store = MooncakeStore.connect(mooncake_config(master.address))
    try:
        owner.close()  # the process holding the bytes is gone
        loads = transfers({0: [5, 6], 1: [7, 0], 2: [1]}, "reader", prefix)
        for mode in ("layer", "group"):
            with engine_for(reader_store, target, mode) as reader:
                step = reader.begin_layerwise(loads=loads)
                failed = step.wait_layer_loaded(0)
                assert failed[0] == {5, 6}
                result = step.finish()
                assert reader.outstanding("load") == 0
            assert result.failed_blocks == {0: {5, 6}, 1: {7, 0}, 2: {1}}
            assert sorted(result.blamed_keys) == sorted(t.key for t in loads)  # the store said so
    finally:
        reader_store.close()


@STAGED_OR_IN_PLACE_OR_LAYER
def test_a_segment_holder_killed_mid_step_fails_blocks_and_leaves_nothing_partial(
    start_mooncake_master: StartMaster,
    start_segment_holder: StartHolder,
    mode: str,
    block_major: tuple[int, ...],
) -> None:
    """The process lending the pool's memory dies while a step saves and another loads."""
    master = start_mooncake_master()
    holder = start_segment_holder(master.address)
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=20, block_major=block_major)
    target = Caches(num_blocks=8, seed=21, block_major=block_major)
    source.fill()
    # Lend nothing: every object lives in the holder, as in a deployment.
    store = MooncakeStore.connect(mooncake_config(master.address, global_segment_size=0))
    try:
        stored = transfers(BLOCKS, "old", prefix)
        with engine_for(store, source, mode) as engine:
            assert save(engine, stored, mode).ok
            saving = transfers({0: [5, 6], 1: [7], 2: [0]}, "new", f"{prefix}-new")
            loads = transfers({0: [3, 4], 1: [5, 6], 2: [7]}, "reader", prefix)
            step = engine.begin_layerwise(saves=saving)
            step.save_layer(0, CpuEvent())
            step.save_layer(1, CpuEvent())
            step.checkpoint()
            holder.kill()
            for layer in range(2, NUM_LAYERS):
                step.save_layer(layer, CpuEvent())
            written = step.finish()
            with engine_for(store, target, mode) as reader:
                load_step = reader.begin_layerwise(loads=loads)
                failed = load_step.wait_layer_loaded(0)
                loaded = load_step.finish()
                assert reader.outstanding("load") == 0
            assert engine.outstanding("save") == 0
        assert sorted(written.failed_keys) == sorted(t.key for t in saving)
        assert written.failed_blocks == {0: {5, 6}, 1: {7}, 2: {0}}
        # Reported before layer 0 is used: group 0 has layer 0; every load failed.
        assert failed[0] == {3, 4}
        assert loaded.failed_blocks == {0: {3, 4}, 1: {5, 6}, 2: {7}}
        assert store.batch_is_readable([t.key for t in saving]) == [False] * len(saving)
        assert target.block_bytes(0, 3) == bytes(len(target.block_bytes(0, 3)))
    finally:
        store.close()


def test_a_ranged_load_outliving_the_masters_lease_still_reads_every_layer(
    start_mooncake_master: StartMaster, caplog: pytest.LogCaptureFixture
) -> None:
    """A get session lasts one lease (default_kv_lease_ttl): later reads must re-pin. The
    expired reads they recover from are no warning (a long ranged load meets them always)."""
    caplog.set_level(logging.INFO, logger="hybridkv.transport")
    master = start_mooncake_master(lease_ttl_ms=300)
    prefix = unique_prefix()
    source, target = Caches(num_blocks=8, seed=22), Caches(num_blocks=8, seed=23)
    source.fill()
    store = MooncakeStore.connect(mooncake_config(master.address))
    try:
        saves = transfers(BLOCKS, prefix=prefix)
        with engine_for(store, source, "whole") as writer:
            assert save(writer, saves, "whole").ok
        loads = transfers({0: [7, 6], 1: [5, 4], 2: [3]}, "reader", prefix)
        with engine_for(store, target, "layer", prefetch_layers=0) as reader:
            step = reader.begin_layerwise(loads=loads)
            for layer in range(NUM_LAYERS):
                time.sleep(0.5)  # the model computes: the lease runs out between layers
                assert step.wait_layer_loaded(layer) == {}
            result = step.finish()
        assert result.ok
        expired = [r for r in caplog.records if r.getMessage().startswith("get_ranges:")]
        assert expired, "the lease never ran out: the test tests nothing"
        assert {r.levelno for r in expired} == {logging.INFO}
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        remap = {(t.group, s.local_block): t.local_block for s, t in zip(saves, loads, strict=True)}
        for (group, source_block), target_block in remap.items():
            assert target.block_bytes(group, target_block) == source.block_bytes(
                group, source_block
            )
    finally:
        store.close()


@STAGED_OR_IN_PLACE_OR_LAYER
def test_a_master_killed_mid_step_fails_fast_then_the_engine_recovers_on_restart(
    start_mooncake_master: StartMaster, mode: str, block_major: tuple[int, ...]
) -> None:
    """The master dies while a step saves and another loads: both finish in bounded time
    with every key failed (nothing committed, no counter leaked); once a master is back on
    the same address, the same engine saves and loads again."""
    master = start_mooncake_master()
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=24, block_major=block_major)
    target = Caches(num_blocks=8, seed=25, block_major=block_major)
    source.fill()
    store = MooncakeStore.connect(mooncake_config(master.address))
    try:
        # backlog 0: the checkpoint returns once layer 0 is written, so the master dies
        # with the step's sessions open and half of its bytes moved.
        writer = engine_for(store, source, mode, backlog=0)
        with writer, engine_for(store, target, mode) as reader:
            assert save(writer, transfers(BLOCKS, "old", prefix), mode).ok
            saving = transfers({0: [5, 6], 1: [7], 2: [0]}, "new", f"{prefix}-new")
            loads = transfers({0: [3, 4], 1: [5, 6], 2: [7]}, "reader", prefix)
            step = writer.begin_layerwise(saves=saving)
            step.save_layer(0, CpuEvent())
            step.checkpoint()
            master.kill()
            started = time.monotonic()
            for layer in range(1, NUM_LAYERS):
                step.save_layer(layer, CpuEvent())
                step.checkpoint()
            written = step.finish()
            load_step = reader.begin_layerwise(loads=loads)
            failed = load_step.wait_layer_loaded(0)
            loaded = load_step.finish()
            elapsed = time.monotonic() - started
            assert sorted(written.failed_keys) == sorted(t.key for t in saving)
            assert failed[0] == {3, 4}  # reported before layer 0 is used
            assert loaded.failed_blocks == {0: {3, 4}, 1: {5, 6}, 2: {7}}
            assert target.block_bytes(0, 3) == bytes(len(target.block_bytes(0, 3)))
            assert writer.outstanding("save") == 0
            assert reader.outstanding("load") == 0
            print(f"save + load steps with the master down took {elapsed:.2f} s")
            assert elapsed < 30, f"steps with the master down took {elapsed:.1f} s"

            start_mooncake_master(rpc_port=master.rpc_port)  # a new, empty master
            again = transfers(BLOCKS, "again", f"{prefix}-again")
            restarted = time.monotonic()
            while not (result := save(writer, again, mode)).ok:
                assert time.monotonic() < restarted + 60, f"no save after the restart: {result}"
                time.sleep(0.5)
            print(f"saved again {time.monotonic() - restarted:.1f} s after the restart")
            remap = {0: [6, 7], 1: [0, 1], 2: [2]}
            reloaded = load(reader, transfers(remap, "reader2", f"{prefix}-again"), mode)
            assert reloaded.ok
            for group, blocks in BLOCKS.items():
                for source_block, target_block in zip(blocks, remap[group], strict=True):
                    assert target.block_bytes(group, target_block) == source.block_bytes(
                        group, source_block
                    )
            # The old master's objects died with it.
            assert store.batch_is_readable([t.key for t in saving]) == [False] * len(saving)
    finally:
        store.close()


class UnpinRaises(MemoryStore):
    """Ending a get session raises a store error (the pins stay until their lease lapses)."""

    def get_session_end(self, keys: Sequence[str]) -> None:
        raise StoreClosed("MooncakeStore is closed")


def test_a_load_whose_session_end_raises_still_stands(caplog: pytest.LogCaptureFixture) -> None:
    """Every read is in before the get session ends: a store error ending it is a
    warning, not a failed load (vLLM would recompute bytes it already has)."""
    store = UnpinRaises()
    source, saves = filled_caches_and_saves(seed=38)
    with engine_for(store, source, "whole") as writer:
        assert save(writer, saves, "whole").ok
    target = Caches(num_blocks=8, seed=39)
    with engine_for(store, target, "layer") as reader:
        result = load(reader, saves, "layer")
    assert result.ok
    for transfer in saves:
        group, block = transfer.group, transfer.local_block
        assert target.block_bytes(group, block) == source.block_bytes(group, block)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"get_session_end of {len(saves)} keys failed (their pins lapse with the lease): "
        "MooncakeStore is closed"
    ]


@STAGED_OR_IN_PLACE_OR_LAYER
def test_a_load_from_a_stalled_holder_fails_within_the_store_timeout_and_writes_nothing_late(
    start_mooncake_master: StartMaster,
    start_segment_holder: StartHolder,
    mode: str,
    block_major: tuple[int, ...],
) -> None:
    """The holder stops answering (SIGSTOP) before a load: every block fails within the
    store's deadlines (Mooncake's 30 s each before `store_timeout_s`), the store's fault
    (quarantined), and once the holder runs again nothing of its late replies reaches the
    caches, whose blocks vLLM would have reused by then."""
    master = start_mooncake_master()
    holder = start_segment_holder(master.address)
    prefix = unique_prefix()
    source = Caches(num_blocks=8, seed=26, block_major=block_major)
    target = Caches(num_blocks=8, seed=27, block_major=block_major)
    source.fill()
    config = mooncake_config(master.address, global_segment_size=0, store_timeout_s=2)
    store = MooncakeStore.connect(config)
    try:
        with engine_for(store, source, mode) as writer:
            assert save(writer, transfers(BLOCKS, "old", prefix), mode).ok
        loads = transfers({0: [3, 4], 1: [5, 6], 2: [7]}, "reader", prefix)
        untouched = {(t.group, t.local_block): target.block_bytes(t.group, t.local_block)
                     for t in loads}  # fmt: skip
        with engine_for(store, target, mode) as reader:
            with stalled(holder.pid):
                started = time.monotonic()
                loaded = load(reader, loads, mode)
                elapsed = time.monotonic() - started
            assert reader.outstanding("load") == 0
            time.sleep(1)  # the holder runs again
        print(f"{mode} load from a stalled holder failed in {elapsed:.2f} s")
        assert loaded.failed_blocks == {0: {3, 4}, 1: {5, 6}, 2: {7}}
        assert sorted(loaded.blamed_keys) == sorted(t.key for t in loads)
        assert elapsed < 30
        for (group, block), before in untouched.items():
            assert target.block_bytes(group, block) == before
    finally:
        store.close()
