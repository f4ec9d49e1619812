from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import attention, groups, mamba, model_config
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.coordinator import FullAttention, RecurrentState, SlidingWindow
from hybridkv.integration.groups import HeadPlan, ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace

SHAPE = ModelShape(tp_size=1, total_kv_heads=2)


def test_translates_each_spec_kind(vllm_specs: Any) -> None:
    config = groups(
        vllm_specs,
        (["l.0", "l.2"], attention(vllm_specs, window=64)),
        (["l.3", "l.1"], attention(vllm_specs)),
        (["m.4"], mamba(vllm_specs)),
    )
    plan = plan_groups(config, [0, 1, 2], SHAPE)
    assert [g.kind for g in plan.groups] == [
        SlidingWindow(32, 64),
        FullAttention(32),
        RecurrentState(32),
    ]
    assert plan.groups[1].layer_names == ("l.1", "l.3")
    assert plan.hybrid
    assert plan.hash_block_size == 32
    assert plan.alignment == 32


def test_only_prefix_cacheable_groups_are_planned(vllm_specs: Any) -> None:
    config = groups(vllm_specs, (["a"], attention(vllm_specs)), (["b"], attention(vllm_specs)))
    plan = plan_groups(config, [1], SHAPE)
    assert [g.vllm_group_id for g in plan.groups] == [1]
    assert not plan.hybrid


def test_hits_align_to_groups_that_are_not_stored_too(vllm_specs: Any) -> None:
    """vLLM's own hits land on the LCM of every group's block size (its scheduler block
    size), those it does not let a store hold (e.g. a replayed window) included."""
    config = groups(
        vllm_specs, (["a"], attention(vllm_specs)), (["b"], attention(vllm_specs, block_size=48))
    )
    plan = plan_groups(config, [0], SHAPE)
    assert [g.block_size for g in plan.groups] == [32]
    assert plan.alignment == 96
    assert plan.coordinator().alignment == 96


def test_mamba_needs_align_mode(vllm_specs: Any) -> None:
    config = groups(vllm_specs, (["m"], mamba(vllm_specs, mode="none")))
    with pytest.raises(ValueError, match=r"group 0.*mamba_cache_mode='align'"):
        plan_groups(config, [0], SHAPE)


def test_unknown_spec_is_refused(vllm_specs: Any) -> None:
    class Strange:
        block_size = 16

    config = groups(vllm_specs, (["x"], attention(vllm_specs)))
    config[0].kv_cache_spec = Strange()
    with pytest.raises(ValueError, match="Strange"):
        plan_groups(config, [0], SHAPE)


def test_a_full_attention_subclass_with_other_semantics_is_refused_by_name(
    vllm_specs: Any,
) -> None:
    """R-SWA derives from full attention, but its generated tokens see a window only."""
    base = attention(vllm_specs)
    rswa = vllm_specs.RSWASpec(
        block_size=base.block_size,
        num_kv_heads=base.num_kv_heads,
        head_size=base.head_size,
        dtype=base.dtype,
        rswa_window=64,
    )
    config = groups(vllm_specs, (["x"], base))
    config[0].kv_cache_spec = rswa
    with pytest.raises(ValueError, match=r"group 0: hybridkv cannot store RSWASpec.*last 64"):
        plan_groups(config, [0], SHAPE)


def test_eagle_drops_where_vllm_s_coordinator_does(vllm_specs: Any) -> None:
    """vLLM drops EAGLE's block in the groups it marks as the draft head's, in every group
    of an equal spec (it looks them up together), and in all groups when it marks none."""
    config = groups(
        vllm_specs,
        (["target.0"], attention(vllm_specs, 64)),
        (["target.1"], attention(vllm_specs, 32)),
        (["draft"], attention(vllm_specs, 32)),
        (["m"], mamba(vllm_specs, 64)),
    )

    def drafted(marked: set[int], cacheable: list[int]) -> list[int]:
        for group_id, group in enumerate(config):
            group.is_eagle_group = group_id in marked
        plan = plan_groups(config, cacheable, SHAPE)
        return [group.vllm_group_id for group in plan.groups if group.drafted]

    assert drafted(set(), [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert drafted({2}, [0, 1, 2, 3]) == [1, 2]  # group 1's spec equals the draft's
    assert drafted({2}, [0, 1, 3]) == []  # a marked group outside the lookup spreads nothing
    assert drafted({0}, [0, 1, 2, 3]) == [0]
    # The draft's 32-token block after 192 fits in 224 tokens; the target's 64 would not.
    drafted({2}, [0, 2])
    plan = plan_groups(config, [0, 2], SHAPE)
    readable = [[True] * 3, [True] * 7]
    assert plan.coordinator(use_eagle=True).find_hit(223, readable, 224).tokens == 192
    drafted(set(), [0, 2])
    every = plan_groups(config, [0, 2], SHAPE).coordinator(use_eagle=True)
    assert every.find_hit(223, readable, 224).tokens == 128


def test_every_topology_shares_the_scope_each_has_a_topology_digest(vllm_specs: Any) -> None:
    """Each stage's kv_cache_config names its own layers (the scheduler's the first
    stage's): neither the scope nor the topology digest takes layer names; the scope is
    the same for every pipeline split and TP size, the topology digest names the cut."""

    def plan(names: list[str], stages: list[tuple[int, int]], tp: int = 1) -> Any:
        config = groups(vllm_specs, (names, attention(vllm_specs)), (["m"], mamba(vllm_specs)))
        shape = ModelShape(tp_size=tp, total_kv_heads=2 * tp)
        return plan_groups(config, [0, 1], shape, pp_stages=stages, num_layers=4)

    halves = [(0, 2), (2, 4)]
    assert plan(["l.0", "l.1"], halves).digest == plan(["l.2", "l.3"], halves).digest
    partitions = ([], halves, [(0, 1), (1, 4)], [(0, 1), (1, 2), (2, 4)])
    assert len({plan(["l.0"], stages).digest for stages in partitions}) == 4
    assert len({plan(["l.0"], stages).scope for stages in partitions}) == 1
    assert plan(["l.0"], []).digest != plan(["l.0"], [], tp=2).digest
    config = groups(vllm_specs, (["a"], attention(vllm_specs)))
    single = plan_groups(config, [0], SHAPE, pp_stages=halves)
    assert single.pp_size == 2
    with pytest.raises(ValueError, match="pp_rank 2 is not a stage of 2"):
        KeySpace(single, "m", pp_rank=2)
    # One group still takes the hybrid format: the single-group one has no stage field.
    assert KeySpace(single, "m").keys(0, [b"\1"], [0]) == [
        f"m@mooncake_hybrid_v1:{single.digest}@pp_rank:{stage}@group:0@block:32@01@0"
        for stage in (0, 1)
    ]


def test_the_scope_separates_incompatible_models(vllm_specs: Any) -> None:
    def scope(tp: int, block: int, heads: int, namespace: str = "") -> str:
        config = groups(vllm_specs, (["a"], attention(vllm_specs, block, heads // tp)))
        return plan_groups(config, [0], ModelShape(tp, heads), namespace).scope

    base = scope(1, 32, 2)
    assert base == scope(1, 32, 2) == scope(2, 32, 2)  # TP splits the same model's heads
    assert len({base, scope(1, 64, 2), scope(1, 32, 4), scope(1, 32, 2, "n")}) == 4


def test_a_state_sharded_by_tp_keeps_tp_sizes_apart(vllm_specs: Any) -> None:
    """No rule gives every state type's unsharded shapes: a sharded state's signature
    names its share, so another TP size never reads it (a replicated one is whole)."""

    def scope(tp: int, replicated: bool) -> str:
        config = groups(vllm_specs, (["m"], mamba(vllm_specs, tp_replicated=replicated)))
        return plan_groups(config, [0], ModelShape(tp, 2)).scope

    assert scope(1, False) != scope(2, False)
    assert scope(1, True) == scope(2, True)


@pytest.mark.parametrize(
    ("heads", "slots", "apart"),
    [(2, None, True), (1, None, False), (1, 2, True)],  # slots: a backend packing a head in 2
)
def test_the_digest_follows_how_vllm_orders_a_blocks_heads_and_tokens(
    vllm_specs: Any, heads: int, slots: int | None, apart: bool
) -> None:
    """vLLM's resolved KV cache layout orders a block's bytes: BLHNC and LBHNC blocks hold
    the same bytes and share objects; LBNHC interleaves the head slots, so its instances
    are kept apart, unless one head slot per page makes every order the same."""
    import torch
    from vllm.config import CacheConfig, ParallelConfig

    from hybridkv.integration.vllm_facts import plan_from_vllm

    spec = vllm_specs.FullAttentionSpec(
        block_size=32, num_kv_heads=heads, head_size=64, dtype=torch.float32, num_head_slots=slots
    )
    kv_cache_config: Any = SimpleNamespace(
        kv_cache_groups=groups(vllm_specs, (["a"], spec)), prefix_cacheable_group_ids=[0]
    )

    def digest(layout: str) -> str:
        cache = CacheConfig()
        cache.kv_cache_layout = layout
        vllm_config: Any = SimpleNamespace(
            parallel_config=ParallelConfig(),
            cache_config=cache,
            model_config=model_config(heads),
        )
        return plan_from_vllm(vllm_config, kv_cache_config, "", "").digest

    digests = {layout: digest(layout) for layout in ("LBHNC", "BLHNC", "LBNHC", "BLNHC")}
    assert digests["LBHNC"] == digests["BLHNC"]
    assert digests["LBNHC"] == digests["BLNHC"]
    assert (digests["LBHNC"] != digests["LBNHC"]) == apart


def test_a_namespace_and_a_key_format_have_key_prefixes_of_their_own(vllm_specs: Any) -> None:
    """A cache reset removes objects by key prefix: it must reach its own namespace and
    key format only (a single-group model's prefix also begins the model's hybrid keys)."""
    attention_only = [(["a"], attention(vllm_specs))]
    hybrid = [*attention_only, (["m"], mamba(vllm_specs))]

    def space(kinds: list[Any], namespace: str) -> KeySpace:
        plan = plan_groups(groups(vllm_specs, *kinds), list(range(len(kinds))), SHAPE, namespace)
        assert plan.hybrid == (kinds is hybrid)
        return KeySpace(plan, "tiny", namespace)

    spaces = {
        (len(kinds), namespace): (space(kinds, namespace), len(kinds))
        for kinds in (attention_only, hybrid)
        for namespace in ("", "a", "ab", "b-c")
    }
    for name, (keys, count) in spaces.items():
        hashes = [bytes([1]) * 32, bytes([255]) * 32]  # keys starting with 0 and f
        own = [key for g in range(count) for key in keys.keys(g, hashes, [0])]
        for other, (other_keys, _) in spaces.items():
            matches = [key.startswith(tuple(other_keys.prefixes())) for key in own]
            assert all(matches) if other == name else not any(matches), (name, other)


def test_a_model_named_like_another_s_namespace_keeps_keys_of_its_own(vllm_specs: Any) -> None:
    """Model `m` in namespace `a` and model `m~a` in none both rendered `m~a@...`: each
    read the other's objects, and a reset of the first removed the second's."""
    config = groups(vllm_specs, (["a"], attention(vllm_specs)))
    names = [("m", "a"), ("m~a", ""), ("m~a", "b"), ("m", ""), ("m~", "a"), ("m~", "")]
    spaces = {name: KeySpace(plan_groups(config, [0], SHAPE, name[1]), *name) for name in names}
    hashes = [bytes([1]) * 32, bytes([255]) * 32]
    for name, keys in spaces.items():
        own = keys.keys(0, hashes, [0])
        for other, other_keys in spaces.items():
            matches = [key.startswith(tuple(other_keys.prefixes())) for key in own]
            assert all(matches) if other == name else not any(matches), (name, other)
    # Ordinary names keep their keys; only a model with '~' and no namespace changed.
    assert spaces["m", "a"].keys(0, [b"\1"], [0]) == ["m~a@01@0"]
    assert spaces["m", ""].keys(0, [b"\1"], [0]) == ["m@01@0"]
    assert spaces["m~a", ""].keys(0, [b"\1"], [0]) == ["m~a~@01@0"]
    with pytest.raises(ValueError, match="namespace must not contain '~'"):
        KeySpace(plan_groups(config, [0], SHAPE), "m", "a~b")


@pytest.mark.parametrize(
    ("tp", "heads", "storing", "head_of", "writers"),
    [  # writers: the ranks putting blocks 0, 1, 2 and 3
        (4, 2, 2, [0, 0, 1, 1], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        (4, 8, 4, [0, 1, 2, 3], [[0, 1, 2, 3]] * 4),
        (2, 1, 1, [0, 0], [[0], [1], [0], [1]]),
        (4, 1, 1, [0, 0, 0, 0], [[0], [1], [2], [3]]),
        (1, 4, 1, [0], [[0]] * 4),
    ],
)
def test_storing_heads_under_tp(
    vllm_specs: Any,
    tp: int,
    heads: int,
    storing: int,
    head_of: list[int],
    writers: list[list[int]],
) -> None:
    config = groups(vllm_specs, (["a"], attention(vllm_specs, heads=max(1, heads // tp))))
    plan = plan_groups(config, [0], ModelShape(tp, heads)).groups[0].heads
    assert plan.storing == storing
    assert [plan.head_of(rank) for rank in range(tp)] == head_of
    assert [[r for r in range(tp) if plan.writes(r, block)] for block in range(4)] == writers


@given(
    st.sampled_from([(tp, storing) for tp in (1, 2, 4, 8, 16) for storing in (1, 2, 4, 8, 16)
                     if storing <= tp]),
    st.integers(0, 10_000),
    st.integers(0, 7),
)  # fmt: skip
def test_each_block_of_each_head_has_one_writer_holding_that_head(
    sizes: tuple[int, int], block: int, stripe: int
) -> None:
    tp, storing = sizes
    plan = HeadPlan(storing, tp, stripe)
    for head in plan.heads:
        writers = [r for r in range(tp) if plan.writes(r, block) and plan.head_of(r) == head]
        assert len(writers) == 1
    assert sum(plan.writes(r, block) for r in range(tp)) == storing


def test_replicas_share_the_puts_of_a_head_evenly() -> None:
    plan = HeadPlan(2, 8)  # four ranks hold each head
    puts = [sum(plan.writes(rank, block) for block in range(64)) for rank in range(8)]
    assert puts == [16] * 8


def test_the_groups_first_blocks_are_put_by_different_ranks(vllm_specs: Any) -> None:
    """Three groups of one KV head at TP=4 (as MLA latent, indexer and compressor state):
    a one-block prompt's three objects go to three ranks, not all to rank 0."""
    config = groups(
        vllm_specs,
        *[([f"{name}.0"], attention(vllm_specs, heads=1)) for name in ("a", "b", "c")],
    )
    plan = plan_groups(config, [0, 1, 2], ModelShape(4, 1))
    writers = [[r for r in range(4) if g.heads.writes(r, 0)] for g in plan.groups]
    assert writers == [[0], [1], [2]]


def test_mamba_state_is_sharded_unless_replicated(vllm_specs: Any) -> None:
    config = groups(vllm_specs, (["m"], mamba(vllm_specs)))
    assert plan_groups(config, [0], ModelShape(4, 2)).groups[0].heads == HeadPlan(4, 4)


@pytest.mark.parametrize(
    "setting", ["decode_context_parallel_size", "prefill_context_parallel_size"]
)
def test_parallelism_that_splits_a_block_across_ranks_is_refused(setting: str) -> None:
    """Context-parallel ranks hold the same heads but different tokens of each block:
    keyed by head alone they would load each other's."""
    from vllm.config import ParallelConfig

    from hybridkv.integration.vllm_facts import plan_from_vllm

    vllm_config: Any = SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=2, **{setting: 2})
    )
    with pytest.raises(ValueError, match=f"does not support .* yet \\({setting}=2\\)"):
        plan_from_vllm(vllm_config, SimpleNamespace(), "ns", "")


@pytest.mark.parametrize(("dbo", "ubatch"), [(True, 0), (False, 2)])
def test_layerwise_transfer_refuses_micro_batches(dbo: bool, ubatch: int) -> None:
    """Each micro-batch runs every layer: a layer's save would go out after the first."""
    from vllm.config import ParallelConfig

    from hybridkv.integration.vllm_facts import refuse_layerwise_micro_batches

    parallel = ParallelConfig(enable_dbo=dbo, ubatch_size=ubatch)
    with pytest.raises(ValueError, match=f"enable_dbo={dbo}, ubatch_size={ubatch}"):
        refuse_layerwise_micro_batches(SimpleNamespace(parallel_config=parallel))  # type: ignore[arg-type]
    refuse_layerwise_micro_batches(SimpleNamespace(parallel_config=ParallelConfig()))  # type: ignore[arg-type]


def test_layers_are_numbered_as_vllm_binds_their_caches() -> None:
    """LongCat-Flash holds two attention modules per layer, numbered apart by vLLM (one
    number each would name two integers and stop start-up); other models, one per layer."""
    from hybridkv.integration.vllm_facts import layer_numbers

    longcat = ["model.layers.3.self_attn.0.attn", "model.layers.3.self_attn.1.attn"]
    assert layer_numbers(longcat, "longcat_flash") == dict(zip(longcat, [6, 7], strict=True))
    names = ["model.layers.3.self_attn.attn", "mtp.layers.0.self_attn.attn"]
    assert layer_numbers(names, "qwen3_next") == dict(zip(names, [3, 0], strict=True))
    with pytest.raises(AssertionError, match="only contain one integer"):
        layer_numbers(longcat, "llama")


def _mla(specs: Any, head_size: int) -> Any:
    import torch

    return specs.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=head_size, dtype=torch.uint8
    )


def test_a_uniform_type_group_plans_as_its_first_layer_in_both_roles(vllm_specs: Any) -> None:
    """DeepSeek-V3.2's latent and indexer keys share one group of uneven pages (vLLM's
    UniformTypeKVCacheSpecs) in the workers' config; the scheduler's holds the first
    layer's spec in its place. Both roles must plan it alike, or their keys differ."""
    names = ["m.0.attn", "m.0.indexer", "m.1.attn", "m.1.indexer"]
    members = {name: _mla(vllm_specs, 656 if name.endswith("attn") else 132) for name in names}
    uniform = vllm_specs.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=members)
    shape = ModelShape(tp_size=2, total_kv_heads=1)
    worker = plan_groups(groups(vllm_specs, (names, uniform)), [0], shape)
    scheduler = plan_groups(groups(vllm_specs, (names, members["m.0.attn"])), [0], shape)
    assert worker.digest == scheduler.digest
    assert [g.kind for g in worker.groups] == [FullAttention(64)]
    assert worker.groups[0].heads.storing == 1  # the latent: once for every rank


def test_a_uniform_type_group_whose_layers_store_differently_is_refused(
    vllm_specs: Any,
) -> None:
    members = {"a": _mla(vllm_specs, 576), "b": attention(vllm_specs, block_size=64)}
    uniform = vllm_specs.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=members)
    shape = ModelShape(tp_size=2, total_kv_heads=2)
    with pytest.raises(ValueError, match=r"group 0: UniformTypeKVCacheSpecs: layer b"):
        plan_groups(groups(vllm_specs, (["a", "b"], uniform)), [0], shape)
