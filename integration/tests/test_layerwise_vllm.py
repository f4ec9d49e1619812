"""vLLM 0.32's connector calls mapped onto the window, with vLLM's real layer classes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from conftest import require
from layerwise_rig import ATTENTION, MIXER, ClientFailsReads, Rig, wait_until

from hybridkv.integration.layerwise.vllm_window import (
    VllmLayerwise,
    build_vllm_layerwise,
    plan_vllm_layers,
)
from hybridkv.transport import BlockTransfer, Status

torch = require("torch")
require("vllm")
from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
from vllm.model_executor.layers.mamba.abstract import MambaBase  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402

BLOCKS = [0, 5]
SAVED = [1, 2]  # blocks a loading step saves, for another request


class CacheInKernelBackend(CPUAttentionBackend):
    """A backend whose kernel writes the cache itself (vLLM's default for a backend)."""

    forward_includes_kv_cache_update = True


def bare(cls: type, **attributes: Any) -> Any:
    """An instance of a real vLLM layer class without building a model around it."""
    module = object.__new__(cls)
    module.__dict__.update(attributes)
    return module


class TinyMixer(torch.nn.Module, MambaBase):  # type: ignore[misc]
    """A Mamba-type layer: its forward updates the state cache in place, like a conv/SSM."""

    def __init__(self, rig: Rig) -> None:
        torch.nn.Module.__init__(self)
        self.rig = rig

    def forward(self, value: int) -> None:
        self.rig.fill(3, BLOCKS, value)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((1,),)

    def get_state_dtype(self) -> tuple[Any, ...]:
        return (torch.int8,)

    @property
    def mamba_type(self) -> Any:
        return None


def context(rig: Rig, backend: type = CPUAttentionBackend) -> dict[str, Any]:
    layers: dict[str, Any] = {
        ATTENTION[0]: bare(Attention, attn_backend=backend),
        ATTENTION[1]: bare(MLAAttention, attn_backend=backend),
        ATTENTION[2]: bare(Attention, attn_backend=backend),
        MIXER: TinyMixer(rig),
        "model.layers.2.self_attn.indexer.k_cache": object(),  # rides with layer 2
    }
    return layers


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.close()


def test_plan_follows_where_vllm_writes_each_cache(rig: Rig) -> None:
    names = set(context(rig))
    plan = plan_vllm_layers(context(rig), names)
    assert plan.windows == set(ATTENTION)
    assert plan.state == {MIXER}
    assert plan.after_kernel == set()
    in_kernel = plan_vllm_layers(context(rig, CacheInKernelBackend), names)
    assert in_kernel.windows == {ATTENTION[1]}  # MLA always writes before its op
    assert in_kernel.after_kernel == {ATTENTION[0], ATTENTION[2]}
    ascend = plan_vllm_layers(context(rig), names, connector_windows=False)
    assert ascend.windows == set()
    assert ascend.after_kernel == set(ATTENTION)
    assert plan.riders == ascend.riders == {"model.layers.2.self_attn.indexer.k_cache"}


def forward(layerwise: VllmLayerwise, rig: Rig, mixer: TinyMixer, value: int) -> None:
    """The calls vLLM 0.32 makes: cache update, wait_for_layer_load, kernel, save_kv_layer."""
    for layer, name in enumerate(ATTENTION):
        rig.fill(layer, BLOCKS, value + layer)
        layerwise.wait_for_layer_load(name)
        layerwise.save_layer(name)
    mixer(value + 3)  # nn.Module call: the forward hook is the post-compute save


def test_connector_calls_and_mamba_hook_save_every_layer(rig: Rig) -> None:
    ctx = context(rig)
    layerwise = VllmLayerwise(rig.strategy, plan_vllm_layers(ctx, set(ctx)))
    layerwise.install_state_hooks(ctx)
    layerwise.begin_step([], rig.transfers(BLOCKS))
    for layer, name in enumerate(ATTENTION):
        rig.fill(layer, BLOCKS, 60 + layer)
        layerwise.wait_for_layer_load(name)  # entry: this layer's put goes out here
        assert rig.strategy.stats.layers_saved == layer + 1
        layerwise.save_layer(name)
    assert wait_until(lambda: rig.readable(0, BLOCKS))
    assert not rig.readable(1, BLOCKS)
    ctx[MIXER](63)
    assert rig.strategy.stats.layers_saved == 4
    _end_step_saved_every_group(layerwise, rig)
    assert not ctx[MIXER]._forward_hooks  # hooks removed on shutdown


def _end_step_saved_every_group(layerwise: VllmLayerwise, rig: Rig) -> None:
    """The step ends with its loads fine and every group's blocks in the pool; close."""
    assert layerwise.finish_loads().ok
    saves = layerwise.end_step()
    assert saves is not None
    assert saves.wait().bytes > 0
    assert all(rig.readable(group, BLOCKS) for group in (0, 1, 2))
    layerwise.close()


def test_cache_written_in_kernel_is_saved_after_the_kernel(rig: Rig) -> None:
    ctx = context(rig, CacheInKernelBackend)
    layerwise = VllmLayerwise(rig.strategy, plan_vllm_layers(ctx, set(ctx)))
    layerwise.install_state_hooks(ctx)
    layerwise.begin_step([], rig.transfers(BLOCKS))
    rig.fill(0, BLOCKS, 1)
    layerwise.wait_for_layer_load(ATTENTION[0])
    assert rig.strategy.stats.layers_saved == 0  # the kernel has not written the cache yet
    layerwise.save_layer(ATTENTION[0])
    assert rig.strategy.stats.layers_saved == 1
    forward(layerwise, rig, ctx[MIXER], 10)
    assert layerwise.end_step() is not None
    layerwise.close()


def test_mamba_hook_outside_a_step_does_nothing(rig: Rig) -> None:
    ctx = context(rig)
    layerwise = VllmLayerwise(rig.strategy, plan_vllm_layers(ctx, set(ctx)))
    layerwise.install_state_hooks(ctx)
    ctx[MIXER](5)  # profiling / dummy run: no step bound
    assert rig.strategy.stats.layers_saved == 0
    layerwise.close()


def _loaded_step(
    rig: Rig,
    hooks_fire: bool,
    saves: Sequence[BlockTransfer] = (),
    failing: Callable[[str], bool] | None = None,
) -> tuple[VllmLayerwise, dict[str, Any]]:
    """Every layer stored (layer L holds 40 + L), caches cleared, a step loading it all
    (and saving `saves`); reads of the keys `failing` picks fail."""
    for layer in range(4):
        rig.fill(layer, BLOCKS, 40 + layer)
    assert rig.engine.save(rig.transfers(BLOCKS, tag="s")).wait(timeout=10).ok
    if failing is not None:
        rig.store.fail_next("get_ranges", failing, Status.TRANSFER_FAILED, calls=100)
    for cache in rig.caches.values():
        cache[:] = 0
    ctx = context(rig)
    layerwise = VllmLayerwise(rig.strategy, plan_vllm_layers(ctx, set(ctx)), hooks_fire=hooks_fire)
    layerwise.install_state_hooks(ctx)
    layerwise.begin_step(rig.transfers(BLOCKS, tag="s"), saves)
    return layerwise, ctx


def _first_byte(rig: Rig, layer: int) -> int:
    """The first byte of the first loaded block in a cache of `layer`."""
    cache = next(cache for (_, at), cache in rig.caches.items() if at == layer)
    return int(cache[BLOCKS[0], 0])


@pytest.mark.parametrize("riders_through", [None, 2])
def test_a_riders_layer_is_loaded_before_the_forward_starts(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, riders_through: int | None
) -> None:
    """vLLM's MLA layer runs its indexer, which reads the indexer cache, before the
    attention's `wait_for_layer_load`: a layer holding such a cache is loaded when the
    step begins, every layer before it too; the later ones still load behind the forward."""
    for layer in range(4):
        rig.fill(layer, BLOCKS, 40 + layer)
    assert rig.engine.save(rig.transfers(BLOCKS, tag="s")).wait(timeout=10).ok
    for cache in rig.caches.values():
        cache[:] = 0
    reads = rig.store.get_ranges

    def slow_reads(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return reads(*args, **kwargs)

    monkeypatch.setattr(rig.store, "get_ranges", slow_reads)
    ctx = context(rig)
    layerwise = VllmLayerwise(
        rig.strategy, plan_vllm_layers(ctx, set(ctx)), riders_through=riders_through
    )
    layerwise.begin_step(rig.transfers(BLOCKS, tag="s"), [])
    landed = [_first_byte(rig, layer) for layer in range(4)]
    if riders_through is None:
        assert landed[2] == 0  # what the indexer would have read: nothing loaded yet
    else:
        assert landed[:3] == [40, 41, 42]
        assert landed[3] == 0  # the mixer's layer loads behind the forward
    assert layerwise.finish_loads().ok
    assert [_first_byte(rig, layer) for layer in range(4)] == [40, 41, 42, 43]
    layerwise.end_step()
    layerwise.close()


def test_the_built_strategy_waits_through_the_last_riders_layer() -> None:
    """`build_vllm_layerwise` finds the riders among the engine's cache names."""
    rig = Rig()
    try:
        names = {entry.name: entry.layer for layout in rig.layouts for entry in layout.entries}
        ctx: dict[str, Any] = {
            name: object() if layer == 2 else bare(Attention, attn_backend=CPUAttentionBackend)
            for name, layer in names.items()
        }
        layerwise = build_vllm_layerwise(rig.engine, ctx, "cpu")
        assert layerwise._plan.riders == {name for name, layer in names.items() if layer == 2}
        assert layerwise._riders_through == 2
        layerwise.close()
    finally:
        rig.close()


def _other_saves(rig: Rig) -> list[BlockTransfer]:
    return [
        BlockTransfer(save.key, save.group, save.local_block, "req-2", save.block_index)
        for save in rig.transfers(SAVED, tag="n")
    ]


def _failed_every_load(layerwise: VllmLayerwise, rig: Rig, loads: dict[int, set[int]]) -> None:
    """The step ends with `loads` failed (vLLM recomputes them) and nothing saved; no
    object is blamed (quarantined): the client raised, not a read of them."""
    loaded = layerwise.finish_loads()
    assert loaded.failed_blocks == loads
    assert loaded.blamed_keys == []
    assert layerwise.end_step() is None
    assert layerwise.finish_loads() is loaded  # the same answer all step
    assert not any(rig.readable(group, SAVED, "n") for group in (0, 1, 2))


def test_a_load_raising_in_the_forward_fails_every_load_and_the_forward_goes_on() -> None:
    store = ClientFailsReads()
    rig = Rig(store)
    try:
        layerwise, ctx = _loaded_step(rig, True, _other_saves(rig))
        store.broken = True
        forward(layerwise, rig, ctx[MIXER], 0)  # the first layer's load raised: no hook raises
        _failed_every_load(layerwise, rig, {group: set(BLOCKS) for group in (0, 1, 2)})
        store.broken = False  # the next step is a step like any other
        rig.engine.release(["req-1"])  # whose loads were its first blocks
        layerwise.begin_step([], rig.transfers(BLOCKS))
        forward(layerwise, rig, ctx[MIXER], 70)
        _end_step_saved_every_group(layerwise, rig)
    finally:
        rig.close()


def test_a_load_raising_after_a_failed_read_blames_that_read_only() -> None:
    """The store failed a read (a status) before the client raised in a later layer's
    load: the strategy drained the step before the hook saw the error, yet that read is
    blamed, and none of the blocks the client error failed."""
    store = ClientFailsReads()
    rig = Rig(store)
    try:
        failed = rig.key(0, BLOCKS[0], "s")
        layerwise, ctx = _loaded_step(rig, True, failing=failed.__eq__)
        layerwise.wait_for_layer_load(ATTENTION[0])
        store.broken = True  # every read from here on raises: layer 3's at least
        forward(layerwise, rig, ctx[MIXER], 0)
        loaded = layerwise.finish_loads()
        assert loaded.failed_blocks == {group: set(BLOCKS) for group in (0, 1, 2)}
        assert loaded.blamed_keys == [failed]
        assert layerwise.end_step() is None
    finally:
        rig.close()


def test_a_step_whose_begin_raised_lets_its_forward_through(rig: Rig) -> None:
    ctx = context(rig)
    layerwise = VllmLayerwise(rig.strategy, plan_vllm_layers(ctx, set(ctx)))
    layerwise.install_state_hooks(ctx)
    unknown_group = BlockTransfer("rig@group:9@block:0", 9, 0, "req-1", 0)
    with pytest.raises(ValueError, match="9"):
        layerwise.begin_step([unknown_group], _other_saves(rig))
    forward(layerwise, rig, ctx[MIXER], 0)
    _failed_every_load(layerwise, rig, {9: {0}})
    layerwise.close()


def test_an_op_raising_in_a_window_fails_every_load_blaming_the_failed_read(rig: Rig) -> None:
    """vLLM-Ascend's windows wrap the attention op: when it raises, the step drains and
    the error propagates; every load counts as failed, the read that failed is blamed."""
    failed = rig.key(0, BLOCKS[0], "s")
    layerwise, _ = _loaded_step(rig, True, failing=failed.__eq__)
    with pytest.raises(RuntimeError, match="kernel"), layerwise.window(ATTENTION[0]):
        raise RuntimeError("the kernel failed")
    loaded = layerwise.finish_loads()
    assert loaded.failed_blocks == {group: set(BLOCKS) for group in (0, 1, 2)}
    assert loaded.blamed_keys == [failed]
    assert layerwise.end_step() is None
    layerwise.close()


def test_build_takes_layers_from_the_engine_layouts(rig: Rig) -> None:
    names = {entry.name for layout in rig.layouts for entry in layout.entries}
    ctx: dict[str, Any] = {
        name: bare(Attention, attn_backend=CPUAttentionBackend) for name in names
    }
    layerwise = build_vllm_layerwise(rig.engine, ctx, device="cpu")
    layerwise.begin_step([], rig.transfers(BLOCKS))
    for layer in range(4):
        rig.fill(layer, BLOCKS, 90 + layer)
        for name in sorted(n for n in names if n.endswith(f".l{layer}")):
            layerwise.wait_for_layer_load(name)
            layerwise.save_layer(name)
    _end_step_saved_every_group(layerwise, rig)
