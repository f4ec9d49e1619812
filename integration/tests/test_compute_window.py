"""The layerwise window policy against the real TransferEngine over MemoryStore."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from layerwise_rig import ATTENTION, MIXER, NUM_BLOCKS, GatedStore, Rig, wait_until

from hybridkv.transport import PipelineOptions, Status, StoreUnavailable

BLOCKS = [1, 3]


def run_forward(rig: Rig, blocks: list[int], value: int) -> None:
    """Layers 0-2 through attention windows, layer 3 through the post-compute hook."""
    for layer, name in enumerate(ATTENTION):
        rig.fill(layer, blocks, value + layer)  # cache update before attention entry
        with rig.strategy.window(name):
            pass  # the attention kernel reads the cache here
    rig.fill(3, blocks, value + 3)  # the mixer kernel updates its state in place
    rig.strategy.post_compute_save(MIXER)


def saved_then_cleared(rig: Rig) -> dict[tuple[int, int], np.ndarray]:
    """End the saving step (every put stored), then clear the caches: what they held."""
    result = rig.strategy.wait_for_save()
    assert result is not None
    assert result.ok
    expected = {key: cache.copy() for key, cache in rig.caches.items()}
    for cache in rig.caches.values():
        cache[:] = 0
    return expected


@pytest.fixture
def rig() -> Rig:
    made = Rig()
    yield made
    made.close()


def test_saved_bytes_round_trip_through_layerwise_loads(rig: Rig) -> None:
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
    run_forward(rig, BLOCKS, value=10)
    expected = saved_then_cleared(rig)
    loads = [t for t in rig.transfers(BLOCKS)]
    rig.strategy.begin_step(loads=loads, saves=[])
    for name in ATTENTION:
        with rig.strategy.window(name):
            pass
    rig.strategy.post_compute_save(MIXER)
    assert rig.strategy.wait_for_save() is not None
    for key, cache in rig.caches.items():
        np.testing.assert_array_equal(cache[BLOCKS], expected[key][BLOCKS])
        assert not cache[[0, 2]].any()  # blocks not loaded stay untouched


def test_each_group_commits_after_its_own_last_layer(rig: Rig) -> None:
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
    for layer, name in enumerate(ATTENTION[:2]):
        rig.fill(layer, BLOCKS, 5)
        with rig.strategy.window(name):
            pass
    assert not any(rig.readable(group, BLOCKS) for group in (0, 1, 2))
    rig.fill(2, BLOCKS, 5)
    with rig.strategy.window(ATTENTION[2]):
        pass
    # Group 0 (layers 0, 2) is complete and commits without waiting for layer 3.
    assert wait_until(lambda: rig.readable(0, BLOCKS))
    assert not rig.readable(1, BLOCKS)  # compressed KV: layers 1, 2, 3
    assert not rig.readable(2, BLOCKS)  # window / state: layers 0, 3
    rig.fill(3, BLOCKS, 5)
    rig.strategy.post_compute_save(MIXER)
    rig.strategy.wait_for_save()
    assert all(rig.readable(group, BLOCKS) for group in (0, 1, 2))


def test_state_layer_is_saved_from_the_post_compute_hook_after_its_kernel(rig: Rig) -> None:
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
    for layer, name in enumerate(ATTENTION):
        rig.fill(layer, BLOCKS, 1)
        with rig.strategy.window(name):
            pass
    assert rig.strategy.stats.layers_saved == 3  # layer 3 not yet: its kernel has not run
    rig.fill(3, BLOCKS, 77)  # the state update happens inside the kernel
    rig.strategy.post_compute_save(MIXER)
    rig.strategy.wait_for_save()
    for cache in rig.caches.values():
        cache[:] = 0
    rig.engine.load(rig.transfers(BLOCKS)).wait()
    assert (rig.caches[1, 3][BLOCKS] == 77).all()
    assert (rig.caches[2, 3][BLOCKS] == 77).all()


def test_a_hook_that_never_fired_is_caught_up_in_layer_order(rig: Rig) -> None:
    """Under torch.compile the Mamba hook traces to nothing: wait_for_save still saves it."""
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
    for layer, name in enumerate(ATTENTION):
        rig.fill(layer, BLOCKS, 9)
        with rig.strategy.window(name):
            pass
    rig.fill(3, BLOCKS, 9)
    result = rig.strategy.wait_for_save()
    assert result is not None
    assert result.ok
    assert all(rig.readable(group, BLOCKS) for group in (0, 1, 2))


def test_a_draft_layer_numbered_like_an_early_layer_is_saved_after_it_ran() -> None:
    """Qwen3-Next's MTP layer `mtp.layers.0` is numbered 0 beside the target's layer 0
    (here its GDN state) but runs after the whole target forward: later target layers
    do not carry layer 0 before the draft layer has written its cache."""
    draft = "mtp.layers.0.self_attn.attn"
    reporters = {
        "model.layers.0.linear_attn": 0,  # the target's GDN: group 2's layer 0
        "model.layers.1.self_attn.attn": 1,
        "model.layers.2.self_attn.attn": 2,
        MIXER: 3,
        draft: 0,  # the draft's attention: group 0's layer 0
    }
    windows = [name for name in reporters if name.endswith("attn")]
    rig = Rig(reporters=reporters, always_report=windows)
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
        rig.caches[2, 0][BLOCKS] = 1
        rig.strategy.post_compute_save("model.layers.0.linear_attn")
        for layer in (1, 2):
            rig.fill(layer, BLOCKS, 10 + layer)
            with rig.strategy.window(f"model.layers.{layer}.self_attn.attn"):
                pass
        rig.fill(3, BLOCKS, 13)
        rig.strategy.post_compute_save(MIXER)
        assert wait_until(lambda: rig.readable(1, BLOCKS))  # layers 1, 2, 3
        assert not rig.readable(0, BLOCKS)  # its layer 0 waits for the draft
        rig.caches[0, 0][BLOCKS] = 99  # the draft forward writes its cache
        with rig.strategy.window(draft):
            pass
        expected = saved_then_cleared(rig)
        rig.engine.load(rig.transfers(BLOCKS)).wait()
        for key, cache in rig.caches.items():
            np.testing.assert_array_equal(cache[BLOCKS], expected[key][BLOCKS], err_msg=str(key))
        assert (rig.caches[0, 0][BLOCKS] == 99).all()
    finally:
        rig.close()


def test_step_end_waits_for_every_put_when_the_last_layer_has_nothing_to_save() -> None:
    rig = Rig(store=GatedStore())
    try:
        store = rig.store
        assert isinstance(store, GatedStore)
        store.put_gate.clear()
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS, groups=[0]))
        run_forward(rig, BLOCKS, value=3)  # layer 3 holds no group-0 cache
        threading.Timer(0.05, store.put_gate.set).start()
        rig.strategy.wait_for_save()
        assert rig.readable(0, BLOCKS)  # no poll: wait_for_save returned after the commit
    finally:
        rig.close()


def test_backlog_zero_leaves_no_put_outstanding_past_a_checkpoint() -> None:
    """`_layerwise_backlog: 0`: each layer's checkpoint waits for its put."""
    store = GatedStore()
    store.put_gate.clear()
    rig = Rig(store=store, options=PipelineOptions(backlog=0, granularity="layer"))
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
        threading.Timer(0.05, store.put_gate.set).start()
        for layer, name in enumerate(ATTENTION):
            rig.fill(layer, BLOCKS, layer)
            with rig.strategy.window(name):
                pass
            assert store.put_gate.is_set()  # the first checkpoint waited for the held put
            assert rig.engine.backlog.outstanding == 0
        result = rig.strategy.wait_for_save()
        assert result is not None
        assert result.ok
        assert all(rig.readable(group, BLOCKS) for group in (0, 1, 2))
    finally:
        rig.close()


def test_backlog_never_exceeds_eight_outstanding_sends() -> None:
    layers = tuple(range(20))
    store = GatedStore()
    store.put_gate.clear()
    rig = Rig(
        store=store,
        groups={0: (16, layers)},
        reporters={f"model.layers.{n}.self_attn.attn": n for n in layers},
    )
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
        backlog = rig.engine.backlog
        release = threading.Thread(
            target=lambda: (wait_until(lambda: backlog.outstanding == 8), store.put_gate.set())
        )
        release.start()
        for layer in layers:
            rig.fill(layer, BLOCKS, layer)
            with rig.strategy.window(f"model.layers.{layer}.self_attn.attn"):
                pass
            assert backlog.outstanding <= 8
        release.join()
        rig.strategy.wait_for_save()
        assert backlog.peak == 8  # the bound was reached, and never passed
        assert rig.readable(0, BLOCKS)
    finally:
        rig.close()


def test_checkpoint_leaves_future_layer_gets_queued() -> None:
    store = GatedStore()
    rig = Rig(store=store, options=PipelineOptions(prefetch_layers=2, granularity="layer"))
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
        run_forward(rig, BLOCKS, value=20)
        rig.strategy.wait_for_save()
        store.get_gate.clear()
        store.get_gate_from_offset = 1  # every get past a group's first layer waits
        rig.strategy.begin_step(loads=rig.transfers(BLOCKS), saves=[])
        with rig.strategy.window(ATTENTION[0]):  # layer 0 needs only offset-0 ranges
            pass
        # The checkpoint returned although a prefetched get of a later layer is stuck.
        assert wait_until(lambda: store.gets_waiting == 1)
        store.get_gate.set()
        for name in ATTENTION[1:]:
            with rig.strategy.window(name):
                pass
        rig.strategy.post_compute_save(MIXER)
        result = rig.strategy.wait_for_save()
        assert result is not None
        assert result.ok
        assert (rig.caches[1, 3][BLOCKS] == 23).all()
    finally:
        rig.close()


def test_store_failure_of_a_put_is_reported_not_fatal() -> None:
    store = GatedStore()
    store.put_error = StoreUnavailable("master unreachable (injected)")
    rig = Rig(store=store)
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
        run_forward(rig, BLOCKS, value=1)
        result = rig.strategy.wait_for_save()
        assert result is not None
        assert not result.ok
        assert result.failed_blocks == {0: set(BLOCKS), 1: set(BLOCKS), 2: set(BLOCKS)}
        assert store.open_put_sessions() == set()
        assert not any(rig.readable(group, BLOCKS) for group in (0, 1, 2))
    finally:
        rig.close()


def test_fatal_send_error_reaches_the_forward_and_the_step_is_drained() -> None:
    store = GatedStore()
    store.put_error = RuntimeError("send thread crashed (injected)")
    rig = Rig(store=store)
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))

        def forward_and_step_end() -> None:
            run_forward(rig, BLOCKS, value=1)
            rig.strategy.wait_for_save()

        with pytest.raises(RuntimeError, match="injected"):
            forward_and_step_end()
        assert not rig.strategy.active
        assert rig.engine.outstanding("save") == 0
        assert store.open_put_sessions() == set()  # revoked, nothing half-written
        assert not any(rig.readable(group, BLOCKS) for group in (0, 1, 2))
    finally:
        rig.close()


def _loading_with(get_error: Exception) -> tuple[Rig, GatedStore]:
    """A rig whose blocks were saved, now in a step loading them, every get failing."""
    store = GatedStore()
    rig = Rig(store=store)
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
    run_forward(rig, BLOCKS, value=1)
    rig.strategy.wait_for_save()
    store.get_error = get_error
    rig.strategy.begin_step(loads=rig.transfers(BLOCKS), saves=[])
    return rig, store


def test_fatal_receive_error_reaches_the_forward_at_the_layer_that_needs_it() -> None:
    rig, store = _loading_with(RuntimeError("receive thread crashed (injected)"))
    try:
        with pytest.raises(RuntimeError, match="injected"), rig.strategy.window(ATTENTION[0]):
            pytest.fail("the kernel must not run on KV that never arrived")
        assert not rig.strategy.active
        assert rig.engine.outstanding("load") == 0
        assert store.open_get_sessions() == set()
    finally:
        rig.close()


def test_failed_gets_are_reported_as_local_blocks_for_recompute() -> None:
    rig, _ = _loading_with(StoreUnavailable("segment gone (injected)"))
    try:
        with rig.strategy.window(ATTENTION[0]):
            failed = rig.strategy.wait_all_loads()  # groups 0 and 2 hold layer 0
            assert failed[0] == set(BLOCKS)
            assert failed[2] == set(BLOCKS)
        result = rig.strategy.wait_for_save()
        assert result is not None
        assert result.failed_blocks[0] == set(BLOCKS)
    finally:
        rig.close()


def test_layers_computed_after_a_failed_get_are_not_saved_those_before_are() -> None:
    """Group 0 (layer 0) is computed and committed before layer 1's get fails; layer 1,
    computed over the failed block, is not saved, so group 1 is dropped, not committed
    with wrong KV. (No prefetch: layer 1's get runs, and fails, only once it is due.)"""
    two_layers = {0: (16, (0,)), 1: (16, (1,))}
    rig = Rig(
        groups=two_layers,
        reporters=dict(zip(ATTENTION[:2], (0, 1), strict=True)),
        options=PipelineOptions(granularity="layer", prefetch_layers=0),
    )
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS, tag="old"))
        run_layers(rig, BLOCKS, value=1)
        assert rig.strategy.wait_for_save() is not None
        rig.engine.release(["req-1"])  # the writer finished; the reader is a new request
        failing = Status.TRANSFER_FAILED  # twice: a failed ranged read is retried once
        rig.store.fail_next("get_ranges", lambda key: "group:1" in key, failing, calls=2)
        rig.strategy.begin_step(
            loads=rig.transfers(BLOCKS, tag="old"), saves=rig.transfers([4, 5], tag="new")
        )
        run_layers(rig, [4, 5], value=7)
        result = rig.strategy.wait_for_save()
        assert result is not None
        assert result.failed_blocks == {1: {*BLOCKS, 4, 5}}  # the gets, and the dropped puts
        assert rig.readable(0, [4, 5], tag="new")
        assert not rig.readable(1, [4, 5], tag="new")
    finally:
        rig.close()


@pytest.mark.parametrize("keep_saves", [True, False])
def test_held_saves_go_out_at_the_step_end_only_if_kept(keep_saves: bool) -> None:
    """At TP>1 a step that loads holds its puts until the ranks agreed no load failed."""
    rig = Rig()
    try:
        rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS), hold_saves=True)
        run_forward(rig, BLOCKS, value=2)
        # Unheld, group 0 (layers 0 and 2) would commit during the forward.
        assert not wait_until(lambda: rig.readable(0, BLOCKS), timeout=0.3)
        result = rig.strategy.wait_for_save(keep_saves)
        assert result is not None
        assert all(rig.readable(group, BLOCKS) == keep_saves for group in (0, 1, 2))
    finally:
        rig.close()


def run_layers(rig: Rig, blocks: list[int], value: int) -> None:
    """Layers 0-1 through attention windows (a two-layer rig)."""
    for layer, name in enumerate(ATTENTION[:2]):
        rig.fill(layer, blocks, value + layer)
        with rig.strategy.window(name):
            pass


def test_kernel_error_tears_the_step_down_and_propagates(rig: Rig) -> None:
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
    rig.fill(0, BLOCKS, 4)
    with pytest.raises(RuntimeError, match="kernel failed"), rig.strategy.window(ATTENTION[0]):
        raise RuntimeError("kernel failed")
    assert not rig.strategy.active
    assert rig.engine.outstanding("save") == 0
    assert rig.store.open_put_sessions() == set()
    assert not any(rig.readable(group, BLOCKS) for group in (0, 1, 2))


def test_a_step_abandoned_mid_forward_is_drained_by_the_next(rig: Rig) -> None:
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS, tag="a"))
    rig.fill(0, BLOCKS, 4)
    with rig.strategy.window(ATTENTION[0]):
        pass  # then the forward dies outside any window: no wait_for_save
    rig.strategy.begin_step(loads=[], saves=rig.transfers([0, 2], tag="b"))
    assert rig.store.open_put_sessions() <= {
        rig.key(group, block, "b") for group in (0, 1, 2) for block in (0, 2)
    }
    run_forward(rig, [0, 2], value=8)
    rig.strategy.wait_for_save()
    assert all(rig.readable(group, [0, 2], "b") for group in (0, 1, 2))
    assert not any(rig.readable(group, BLOCKS, "a") for group in (0, 1, 2))


def test_hooks_outside_a_step_are_refused_with_the_reason(rig: Rig) -> None:
    with pytest.raises(RuntimeError, match="begin_step"), rig.strategy.window(ATTENTION[0]):
        pass
    rig.strategy.begin_step([], [])
    with pytest.raises(KeyError, match="not a layer that reports"):
        rig.strategy.post_compute_save("model.layers.9.mlp")


def test_stats_account_every_wait_of_the_step(rig: Rig) -> None:
    rig.strategy.begin_step(loads=[], saves=rig.transfers(BLOCKS))
    run_forward(rig, BLOCKS, value=2)
    rig.strategy.wait_for_save()
    stats = rig.strategy.reset_stats()
    assert stats.steps == 1
    assert stats.layers_saved == 4
    assert stats.exposed_tail_s == pytest.approx(
        stats.load_wait_s + stats.backlog_wait_s + stats.finish_wait_s
    )
    assert stats.as_dict()["exposed_tail_s"] == stats.exposed_tail_s
    assert rig.strategy.stats.steps == 0


def test_a_step_that_moves_nothing_submits_and_counts_nothing(rig: Rig) -> None:
    """A decode step without loads or saves: no layer handed to the transport, and the
    stats (Prometheus: steps that moved KV, layers handed to saves) stay at zero."""
    rig.strategy.begin_step(loads=[], saves=[])
    run_forward(rig, BLOCKS, value=3)
    assert rig.strategy.wait_for_save() is not None
    stats = rig.strategy.reset_stats()
    assert (stats.steps, stats.layers_saved) == (0, 0)


def test_reporters_for_layers_without_caches_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"model\.layers\.7"):
        Rig(reporters={"model.layers.7.self_attn.attn": 7})


assert max(BLOCKS) < NUM_BLOCKS
