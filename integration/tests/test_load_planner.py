"""Loads: a hit turned into block loads once vLLM allocates it (maybe cut shorter), in the
background where vLLM needs it, and given up after failing."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import attention, groups, mamba, request, scheduler_output
from scheduler_rig import (
    TOKENS,
    Pool,
    block_keys,
    make_side,
    put_blocks,
    tail_side,
    window_full_state,
    write_prompt,
)

from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace
from hybridkv.integration.scheduler import SchedulerSide
from hybridkv.integration.vllm_facts import background_loads_reason


def test_hits_load_in_the_background_when_vllm_requires_it(vllm_specs: Any) -> None:
    """A hybrid model's loads wait in the background whatever `load_async` says: only
    then can vLLM recompute a failed load."""
    plan = plan_groups(groups(vllm_specs, (["a"], attention(vllm_specs))), [0], ModelShape(1, 2))
    pool = Pool()
    config = ConnectorConfig(load_async=False)
    side = SchedulerSide(KeySpace(plan, "tiny"), config, pool.query, load_async_required=True)
    put_blocks(side, pool, TOKENS, [0], 96)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (96, True)


@pytest.mark.parametrize(
    ("kind", "vllm_groups", "stages", "reason"),
    [
        ("full", 1, (), None),
        ("full", 2, (), "2 KV cache groups"),
        ("window", 1, (), "a sliding-window or state group"),
        ("state", 1, (), "a sliding-window or state group"),
        ("full", 1, ((0, 1), (1, 2)), "2 pipeline stages"),
    ],
)
def test_loads_go_to_the_background_where_vllm_cannot_recompute_from_a_failed_block(
    vllm_specs: Any,
    kind: str,
    vllm_groups: int,
    stages: tuple[tuple[int, int], ...],
    reason: str | None,
) -> None:
    """Only a single-group model of prefix KV (full attention, MLA) without stages may load
    before the forward: vLLM recomputes such a failed load from the failed block on."""
    spec = {
        "full": attention(vllm_specs),
        "window": attention(vllm_specs, window=64),
        "state": mamba(vllm_specs),
    }[kind]
    plan = plan_groups(groups(vllm_specs, (["a"], spec)), [0], ModelShape(1, 2), pp_stages=stages)
    found = background_loads_reason(vllm_groups, plan)
    if reason is None:
        assert found is None
    else:
        assert found is not None
        assert found.startswith(reason)


def test_a_recomputed_request_saves_the_blocks_past_its_new_hit(vllm_specs: Any) -> None:
    """Its first hit had marked every block below it decided; vLLM computes them now, so
    they are saved (the pool may have lost them with their holder)."""
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    put_blocks(side, pool, TOKENS, [0], 160)
    r = request("r", TOKENS)
    assert side.num_new_matched_tokens(r, 0) == (160, False)
    side.after_alloc(r, ([1, 2, 3, 4, 5, 6, 7],), 160)
    side.build_meta(scheduler_output())
    side.loads_failed({"r"}, block_keys(side, TOKENS, 0, slice(2, 5)))
    assert side.num_new_matched_tokens(r, 0) == (64, False)
    side.after_alloc(r, ([11, 12, 13, 14, 15, 16, 17],), 64)
    meta = side.build_meta(scheduler_output(new=[("r", ([11, 12, 13, 14, 15, 16, 17],), 64, 136)]))
    (transfers,) = meta.requests
    assert [ref.index for ref in transfers.loads] == [0, 1]
    assert [(ref.index, ref.block_id) for ref in transfers.saves] == [
        (2, 13),
        (3, 14),
        (4, 15),
        (5, 16),
    ]


def test_a_request_whose_background_load_keeps_failing_is_computed_not_looked_up_for_ever(
    vllm_specs: Any,
) -> None:
    """A read failing with no object to blame (the client or the link failed) quarantines
    nothing: vLLM looks the request up again from token 0 and the pool offers the same
    hit. After a second failed load the request gets none, so vLLM computes it; another
    request, and the same id once it finished, still hit."""
    side, pool = make_side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    put_blocks(side, pool, TOKENS, [0], 128)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    r = request("r", TOKENS)
    for _ in range(2):
        assert side.num_new_matched_tokens(r, 0) == (128, True)
        side.after_alloc(r, table, 128)
        side.build_meta(scheduler_output())  # the background load goes out
        side.loads_failed(["r"], [])  # and fails, no key blamed
    assert side.num_new_matched_tokens(r, 0) == (0, False)
    assert side.num_new_matched_tokens(request("s", TOKENS), 0) == (128, True)
    side.forget("r")
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (128, True)


def test_a_background_load_resumed_with_replay_saves_nothing_again(vllm_specs: Any) -> None:
    """vLLM admits a finished background load at fewer tokens than it loaded when it
    replays some (DeepSeek-V4.1): the loaded blocks are the pool's already."""
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    put_blocks(side, pool, TOKENS, [0], 192)
    r = request("r", TOKENS)
    assert side.num_new_matched_tokens(r, 0) == (192, False)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(r, table, 192)
    side.build_meta(scheduler_output())
    r.num_computed_tokens = 128
    side.after_alloc(r, table, 0)
    meta = side.build_meta(scheduler_output(new=[("r", table, 128, 72)], tables={"r": table}))
    assert meta.requests == []


def test_hybrid_window_and_state_loads_only_what_the_boundary_needs(vllm_specs: Any) -> None:
    side, pool = window_full_state(vllm_specs)
    put_blocks(side, pool, TOKENS, [0], 192)
    req = request("r", TOKENS)
    assert side.num_new_matched_tokens(req, 0) == (192, False)
    tables = ([0, 0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [0, 0, 0, 0, 0, 36, 37])
    side.after_alloc(req, tables, 192)
    meta = side.build_meta(scheduler_output(new=[("r", tables, 192, 8)], tables={"r": tables}))
    (transfers,) = meta.requests
    loads = {(ref.group, ref.index, ref.block_id) for ref in transfers.loads}
    # window 64 = 2 blocks before 192 (plus none other); all 6 full blocks; the last state.
    assert loads == {(0, 4, 11), (0, 5, 12)} | {(1, i, 21 + i) for i in range(6)} | {(2, 5, 36)}
    assert transfers.saves == []  # 200 tokens complete no new block


def test_a_hit_vllm_cuts_shorter_loads_what_the_shorter_boundary_needs(vllm_specs: Any) -> None:
    """DeepSeek-V4.1's bounded replay has vLLM cut an external hit to a multiple of its
    scheduler block size (the lcm over all groups, the replayed ones too): the loads follow
    the cut, at its own window and state, even one the pool lacks (its load fails)."""
    side, pool = window_full_state(vllm_specs)
    put_blocks(side, pool, TOKENS, [0], 192)
    # The state at the cut (after block 3) is not in the pool.
    pool.keys.difference_update(block_keys(side, TOKENS, 2, slice(3, 4)))
    req = request("r", TOKENS)
    assert side.num_new_matched_tokens(req, 0) == (192, False)
    tables = ([0, 0, 12, 13, 14, 15, 16], [20 + b for b in range(7)], [0, 0, 0, 33, 34, 35, 36])
    side.take_stats()
    side.after_alloc(req, tables, 128)
    assert side.take_stats()["hit_tokens"] == 128
    meta = side.build_meta(scheduler_output(new=[("r", tables, 128, 64)], tables={"r": tables}))
    (transfers,) = meta.requests
    loads = {(ref.group, ref.index, ref.block_id) for ref in transfers.loads}
    # The window's 2 blocks before 128, 4 full blocks, the state after block 3: its load
    # fails (the object is missing) and vLLM recomputes the request.
    assert loads == {(0, 2, 12), (0, 3, 13)} | {(1, i, 20 + i) for i in range(4)} | {(2, 3, 33)}
    # The step computes blocks 4 and 5 past the cut: saved as usual, in every group (the
    # window and the states at 160 and 192 are what those boundaries need).
    assert {(ref.group, ref.index) for ref in transfers.saves} == {
        (group, block) for group in range(3) for block in (4, 5)
    }


def test_an_allocation_no_hit_can_explain_is_refused(vllm_specs: Any) -> None:
    side, pool = window_full_state(vllm_specs)
    put_blocks(side, pool, TOKENS, [0], 192)
    tables = ([0] * 7, [20 + b for b in range(7)], [0] * 7)
    for external, why in ((200, "the hit was 192"), (100, "not a multiple of 32")):
        req = request(f"r{external}", TOKENS)
        assert side.num_new_matched_tokens(req, 0) == (192, False)
        with pytest.raises(RuntimeError, match=why):
            side.after_alloc(req, tables, external)


@pytest.mark.parametrize(
    ("stored", "prompt_tokens", "hit", "loads"),
    [
        # Blocks 0-6 stored whole: the hit reaches 224, block 5 loads whole.
        ([32 * k for k in range(1, 8)], 240, 224, {(0, 5, 15, 0), (0, 6, 16, 0), (1, 6, 26, 0)}),
        # A tail at 176 inside block 5: block 5 loads the tail's object, its only load.
        ([160, 176, 180], 180, 176, {(0, 5, 15, 176), (1, 5, 25, 176)}),
    ],
    ids=["whole", "tail"],
)
def test_the_block_vllm_s_own_hit_ends_inside_is_loaded_from_the_pool(
    vllm_specs: Any, stored: list[int], prompt_tokens: int, hit: int, loads: set[tuple]
) -> None:
    """vLLM's own hit (a Mamba "align" model hashing every 8 tokens) ends at 168, inside
    block 5, and reaches the connector so (vLLM 0.32 itself shows it only its block-aligned
    part): vLLM gives the request a copy of a block whose tokens past 168 are another
    prompt's. Where the pool's hit goes further, that block is the pool's to load, never
    left as vLLM's copy (nor a background load left with nothing to load)."""
    side, pool = tail_side(vllm_specs, load_async=True)
    prompt = (TOKENS + list(range(900, 960)))[:prompt_tokens]
    write_prompt(side, pool, prompt, stored)
    reader = request("r", prompt)
    assert side.num_new_matched_tokens(reader, 168) == (hit - 168, True)
    tables = ([10 + b for b in range(8)], [20 + b for b in range(8)])
    side.after_alloc(reader, tables, hit - 168)
    output = scheduler_output(new=[("r", tables, hit, 0)], tables={"r": tables})
    (transfers,) = side.build_meta(output).requests
    assert {(ref.group, ref.index, ref.block_id, ref.tail) for ref in transfers.loads} == loads
