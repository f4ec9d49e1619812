"""A reader of one topology fills its caches from what a writer of another stored.

Real `TransferEngine`s over a real `MemoryStore`, caches in numpy arrays: each writer rank
(stage, TP rank) saves its objects as a writer does; the reader plans its reads
(`rank_reads`), loads through `WriterReads`' layouts, and must then hold exactly its own
share of the model's KV (its layers, its heads), byte for byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import attention, groups, request, scheduler_output
from hypothesis import given
from hypothesis import strategies as st
from scheduler_rig import TOKENS, Pool, put_blocks

from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import KVPlan, ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace, RequestHashes
from hybridkv.integration.metadata import BlockRef
from hybridkv.integration.scheduler import SchedulerSide
from hybridkv.integration.topologies import (
    WriterReads,
    one_group_per_type,
    rank_reads,
    refuse_unreadable,
    whole_model_layers,
)
from hybridkv.integration.vllm_facts import writer_stages
from hybridkv.transport import (
    BlockTransfer,
    CacheEntry,
    GroupLayout,
    MemoryStore,
    PipelineOptions,
    TransferEngine,
)

LAYERS = 4
HEADS = 4
HEAD_SIZE = 64
HEAD_BYTES = 2 * 32 * HEAD_SIZE * 4  # K and V of 32 tokens, float32
NUM_BLOCKS = 3
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
HASHES = [bytes([i + 1]) * 4 for i in range(NUM_BLOCKS)]


def _plan(specs: Any, tp: int, stages: list[tuple[int, int]]) -> KVPlan:
    import torch

    spec = specs.FullAttentionSpec(
        block_size=32, num_kv_heads=HEADS // tp, head_size=HEAD_SIZE, dtype=torch.float32
    )
    config = groups(specs, (NAMES, spec))
    return plan_groups(config, [0], ModelShape(tp, HEADS), "ns", stages, num_layers=LAYERS)


class Rank:
    """One rank's caches (its stage's layers, its heads) and layout."""

    def __init__(self, plan: KVPlan, stage: tuple[int, int], tp_rank: int) -> None:
        self.tp_rank = tp_rank
        heads = plan.groups[0].heads
        per_rank = HEADS // plan.tp_size
        self.head_start = heads.head_of(tp_rank) * per_rank
        self.page = HEAD_BYTES * per_rank
        self.caches = {
            layer: np.zeros((NUM_BLOCKS, self.page), dtype=np.uint8) for layer in range(*stage)
        }
        self.layout = GroupLayout(
            0,
            [
                CacheEntry(layer, NAMES[layer], cache.ctypes.data, self.page, self.page, NUM_BLOCKS)
                for layer, cache in self.caches.items()
            ],
        )

    def fill_from(self, truth: dict[int, np.ndarray]) -> None:
        """The model's KV of this rank's layers and heads (heads outermost in a page)."""
        for layer, cache in self.caches.items():
            start = self.head_start * HEAD_BYTES
            cache[:] = truth[layer][:, start : start + self.page]


def _truth() -> dict[int, np.ndarray]:
    rng = np.random.default_rng(7)
    shape = (NUM_BLOCKS, HEAD_BYTES * HEADS)
    return {layer: rng.integers(0, 256, shape, dtype=np.uint8) for layer in range(LAYERS)}


def _write(store: MemoryStore, plan: KVPlan, stages: list[tuple[int, int]]) -> None:
    truth = _truth()
    for stage, span in enumerate(stages or [(0, LAYERS)]):
        keys = KeySpace(plan, "m", "ns", stage)
        heads = plan.groups[0].heads
        for tp_rank in range(plan.tp_size):
            if tp_rank % heads.replicas:
                continue  # its head's objects are another rank's to write
            rank = Rank(plan, span, tp_rank)
            rank.fill_from(truth)
            engine = TransferEngine(store, [rank.layout], PipelineOptions(granularity="staged"))
            try:
                head = heads.head_of(tp_rank)
                saves = [
                    BlockTransfer(keys.keys(0, [h], [head])[0], 0, block, "w", block)
                    for block, h in enumerate(HASHES)
                ]
                result = engine.save(saves).wait()
                assert not result.failed_keys
            finally:
                engine.close()


@pytest.mark.parametrize(
    ("writer_tp", "writer_cut", "reader_tp", "reader_cut"),
    [
        (1, [(0, 2), (2, 4)], 1, []),  # two stages into one
        (1, [(0, 1), (1, 4)], 1, []),  # uneven stages into one
        (2, [], 1, []),  # two TP ranks' heads into one rank's page
        (2, [(0, 3), (3, 4)], 1, []),  # both at once
        (4, [], 2, []),  # four heads' objects, two per reader rank
        (1, [], 1, [(0, 2), (2, 4)]),  # each stage reads part of one object
        (1, [(0, 1), (1, 4)], 1, [(0, 2), (2, 4)]),  # uneven stages into even ones
        (1, [], 2, []),  # each rank reads its heads' part of one object
        (1, [(0, 3), (3, 4)], 2, [(0, 1), (1, 4)]),  # every cut differs
    ],
)
def test_a_reader_rank_holds_its_share_of_what_another_topology_wrote(
    vllm_specs: Any,
    writer_tp: int,
    writer_cut: list[tuple[int, int]],
    reader_tp: int,
    reader_cut: list[tuple[int, int]],
) -> None:
    store = MemoryStore()
    writer = _plan(vllm_specs, writer_tp, writer_cut)
    reader = _plan(vllm_specs, reader_tp, reader_cut)
    refuse_unreadable(reader, writer, "HNC")
    _write(store, writer, writer_cut)
    keys = [KeySpace(writer, "m", "ns", s) for s in range(writer.pp_size)]
    truth = _truth()
    for pp_rank, stage in enumerate(reader_cut or [(0, LAYERS)]):
        for tp_rank in range(reader_tp):
            rank = Rank(reader, stage, tp_rank)
            _load(rank, store, keys, reader, writer, writer_cut, stage, pp_rank)
            expected = Rank(reader, stage, tp_rank)
            expected.fill_from(truth)
            for layer in range(*stage):
                assert np.array_equal(rank.caches[layer], expected.caches[layer]), layer


def _load(
    rank: Rank,
    store: MemoryStore,
    keys: list[KeySpace],
    reader: KVPlan,
    writer: KVPlan,
    writer_cut: list[tuple[int, int]],
    stage: tuple[int, int],
    pp_rank: int,
) -> set[int]:
    """Load every block into `rank` through its planned reads; the blocks that failed."""
    names = {layer: NAMES[layer] for layer in range(*stage)}
    reads = rank_reads(
        reader, writer, writer_cut, stage, pp_rank, rank.tp_rank, [rank.layout], names, LAYERS
    )
    planned = WriterReads(keys, [rank.layout], reads)
    engine = TransferEngine(
        store, [rank.layout, *planned.layouts], PipelineOptions(granularity="staged")
    )
    try:
        loads = [
            transfer
            for block, h in enumerate(HASHES)
            for transfer in planned.transfers(BlockRef(0, block, block, h), "r", block)
        ]
        assert len(loads) == NUM_BLOCKS * len(reads)
        result = engine.load(loads).wait()
    finally:
        engine.close()
    assert set(result.failed_blocks) <= {0}  # reported as the plan group's blocks
    return {block for blocks in result.failed_blocks.values() for block in blocks}


def test_a_missing_writer_object_fails_the_block_it_feeds(vllm_specs: Any) -> None:
    """A block reads both stages' objects: one of them absent fails that block only."""
    store = MemoryStore()
    stages = [(0, 2), (2, 4)]
    writer = _plan(vllm_specs, 1, stages)
    reader = _plan(vllm_specs, 1, [])
    _write(store, writer, stages)
    keys = [KeySpace(writer, "m", "ns", s) for s in range(2)]
    store.batch_remove([keys[1].keys(0, [HASHES[1]], [0])[0]], force=True)
    rank = Rank(reader, (0, LAYERS), 0)
    assert _load(rank, store, keys, reader, writer, stages, (0, LAYERS), 0) == {1}


def test_another_tp_size_with_heads_inside_each_token_is_refused(vllm_specs: Any) -> None:
    with pytest.raises(ValueError, match=r"heads inside each token \(NHC\)"):
        refuse_unreadable(_plan(vllm_specs, 1, []), _plan(vllm_specs, 2, []), "NHC")
    refuse_unreadable(_plan(vllm_specs, 1, []), _plan(vllm_specs, 1, [(0, 2), (2, 4)]), "NHC")


@given(st.integers(1, 40), st.integers(1, 6))
def test_writer_stages_cut_as_vllm_does(layers: int, stages: int) -> None:
    """vLLM's get_pp_indices without VLLM_PP_LAYER_PARTITION is the oracle."""
    import vllm.envs as envs
    from vllm.distributed.utils import get_pp_indices

    if stages > layers:
        return
    assert envs.VLLM_PP_LAYER_PARTITION is None
    expected = [get_pp_indices(layers, rank, stages) for rank in range(stages)]
    got = writer_stages(layers, stages)
    assert got == ([] if stages == 1 else expected)


def test_writer_stages_follow_the_partition_and_refuse_a_wrong_sum() -> None:
    assert writer_stages(8, 2, (3, 5)) == [(0, 3), (3, 8)]
    with pytest.raises(ValueError, match="sums to 9 layers; the model has 8"):
        writer_stages(8, 2, (4, 5))


def _sides(vllm_specs: Any) -> tuple[SchedulerSide, KeySpace, Pool]:
    """A one-stage reader of a two-stage writer of the same model, over one pool."""
    kinds = groups(vllm_specs, (["l.0", "l.1"], attention(vllm_specs)))
    shape = ModelShape(1, 2)
    own = plan_groups(kinds, [0], shape, num_layers=2)
    writer = plan_groups(kinds, [0], shape, pp_stages=[(0, 1), (1, 2)], num_layers=2)
    pool = Pool()
    writer_keys = KeySpace(writer, "tiny")
    side = SchedulerSide(
        KeySpace(own, "tiny"), ConnectorConfig(), pool.query, writer_keys=writer_keys
    )
    return side, writer_keys, pool


def _loaded_topology(side: SchedulerSide, expected_hit: int) -> int:
    req = request("r", TOKENS)
    assert side.num_new_matched_tokens(req, 0) == (expected_hit, False)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(req, table, expected_hit)
    meta = side.build_meta(scheduler_output(new=[("r", table, 0, 200)], tables={"r": table}))
    (transfers,) = [r for r in meta.requests if r.loads]
    assert len(transfers.loads) == expected_hit // 32
    return transfers.topology


def test_the_longer_hit_of_own_and_writer_topology_is_loaded(vllm_specs: Any) -> None:
    side, writer_keys, pool = _sides(vllm_specs)
    put_blocks(side, pool, TOKENS, [0], 64)  # own keys: two blocks
    put_blocks(side, pool, TOKENS, [0], 128, keys=writer_keys)  # both stages: four
    side.take_stats()
    assert _loaded_topology(side, 128) == 1
    assert side.take_stats()["lookups"] == 2  # its own keys' and the writer's


def test_a_writer_key_lookup_without_answer_counts_as_failed(vllm_specs: Any) -> None:
    side, _, pool = _sides(vllm_specs)
    put_blocks(side, pool, TOKENS, [0], 96)
    pool.down = True  # both lookups of the request get no answer
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (0, False)
    stats = side.take_stats()
    assert (stats["lookups"], stats["failed_lookups"]) == (2, 2)


def test_own_topology_wins_a_tie(vllm_specs: Any) -> None:
    side, writer_keys, pool = _sides(vllm_specs)
    put_blocks(side, pool, TOKENS, [0], 96)
    put_blocks(side, pool, TOKENS, [0], 96, keys=writer_keys)
    assert _loaded_topology(side, 96) == 0


def test_a_writer_block_needs_every_stage_s_object(vllm_specs: Any) -> None:
    side, writer_keys, pool = _sides(vllm_specs)
    put_blocks(side, pool, TOKENS, [0], 128, keys=writer_keys)
    hashes = RequestHashes(side.plan, "", None)
    hashes.cover(TOKENS, len(TOKENS))
    third = hashes.for_group(32)[2]
    pool.keys.discard(KeySpace(writer_keys.plan, "tiny", pp_rank=1).keys(0, [third], [0])[0])
    assert _loaded_topology(side, 64) == 1


GEMMA_TYPES = ["sliding", "full"] * 4  # a sliding window group and a full one


def test_a_stage_group_of_one_layer_type_holds_that_type_over_the_whole_model() -> None:
    """A second stage's sliding layers (5, 7 of 8): the group is every sliding layer."""
    stage = {5: "model.layers.5.attn", 7: "model.layers.7.attn"}
    whole = whole_model_layers(stage, (4, 8), 8, GEMMA_TYPES)
    assert whole == {i: f"model.layers.{i}.attn" for i in (1, 3, 5, 7)}


def test_a_stage_group_the_layer_types_cannot_tell_is_refused() -> None:
    stage = {4: "model.layers.4.attn", 6: "model.layers.6.attn"}
    with pytest.raises(ValueError, match="needs every layer's name"):
        whole_model_layers(stage, (4, 8), 8)  # no layer types
    with pytest.raises(ValueError, match="needs every layer's name"):
        whole_model_layers({4: "model.layers.4.attn"}, (4, 8), 8, GEMMA_TYPES)  # 6 elsewhere


def test_layer_types_count_only_where_each_type_is_one_group(vllm_specs: Any) -> None:
    kinds = groups(vllm_specs, (["l.0", "l.2"], attention(vllm_specs)))
    plan = plan_groups(kinds, [0], ModelShape(1, 2), num_layers=4)
    assert one_group_per_type(plan, ["a", "a", "a", "a"]) == ["a", "a", "a", "a"]
    assert one_group_per_type(plan, GEMMA_TYPES) is None  # two types, one group
    assert one_group_per_type(plan, None) is None
