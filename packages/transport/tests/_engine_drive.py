"""Drive an engine the way a connector does, for the engine tests."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import pytest
from _engine_model import ALL_GROUPS, NUM_LAYERS, Caches

from hybridkv.transport.device_events import CpuEvent
from hybridkv.transport.engine import TransferEngine
from hybridkv.transport.outcome import TransferResult
from hybridkv.transport.ownership import BlockTransfer
from hybridkv.transport.pipeline import PipelineOptions
from hybridkv.transport.store import Store

# "whole": save()/load() (default, staged); "staged"/"layer"/"group": layerwise steps at
# that granularity.
MODES = ("whole", "staged", "layer", "group")
# Caches as per-layer tensors, or every group block-major (its objects moved in place).
PER_LAYER_OR_IN_PLACE = pytest.mark.parametrize(
    "block_major", [(), ALL_GROUPS], ids=["per-layer", "in-place"]
)


def unique_prefix() -> str:
    """Keys of one test, distinct from every other test sharing the session master."""
    return f"t{uuid.uuid4().hex[:12]}"


def engine_for(store: Store, caches: Caches, mode: str, **options: float) -> TransferEngine:
    granularity = "staged" if mode == "whole" else mode
    return TransferEngine(
        store, caches.layouts, PipelineOptions(granularity=granularity, **options)
    )


def save(engine: TransferEngine, saves: Sequence[BlockTransfer], mode: str) -> TransferResult:
    if mode == "whole":
        return engine.save(saves).wait(timeout=60)
    step = engine.begin_layerwise(saves=saves)
    for layer in range(NUM_LAYERS):
        step.save_layer(layer, CpuEvent())
        step.checkpoint()
    return step.finish()


class LayerCheck:
    """What a layerwise load must have delivered when `wait_layer_loaded` returns."""

    def __init__(self, source: Caches, target: Caches, remap: dict[tuple[int, int], int]) -> None:
        self.source, self.target, self.remap = source, target, remap

    def __call__(self, layer: int, failed: dict[int, set[int]]) -> None:
        assert_layer_loaded(self.target, self.source, self.remap, layer, failed)


def load(
    engine: TransferEngine,
    loads: Sequence[BlockTransfer],
    mode: str,
    check: LayerCheck | None = None,
) -> TransferResult:
    """Load; layerwise, optionally check each layer is complete when its wait returns."""
    if mode == "whole":
        return engine.load(loads).wait(timeout=60)
    step = engine.begin_layerwise(loads=loads)
    for layer in range(NUM_LAYERS):
        failed = step.wait_layer_loaded(layer)
        if check is not None:
            check(layer, failed)
    return step.finish()


def assert_layer_loaded(
    target: Caches,
    source: Caches,
    remap: dict[tuple[int, int], int],
    layer: int,
    failed: dict[int, set[int]],
) -> None:
    """Every (group, source block) -> target block not reported failed holds layer's bytes."""
    for (group, source_block), target_block in remap.items():
        if target_block in failed.get(group, set()):
            continue
        assert target.block_bytes(group, target_block, [layer]) == source.block_bytes(
            group, source_block, [layer]
        ), f"group {group} layer {layer} block {source_block}->{target_block}"


def read_object(store: Store, key: str, size: int) -> bytes:
    """The object exactly as stored, read whole into one flat buffer."""
    flat = np.zeros(size, dtype=np.uint8)
    [status] = store.batch_get_whole([key], [[flat.ctypes.data]], [[size]])
    assert status.ok, status
    return flat.tobytes()
