"""Cache resets: every key moves to a new generation, and KV from before one (or computed
over it) is never saved under the new keys."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import attention, request, scheduler_output
from scheduler_rig import (
    TOKENS,
    admit,
    compute_after_reset,
    make_side,
    put_blocks,
    tail_side,
)

from hybridkv.integration.groups import ModelShape
from hybridkv.integration.keying import RequestHashes


def test_a_reset_moves_every_key_to_a_new_generation(vllm_specs: Any) -> None:
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    put_blocks(side, pool, TOKENS, [0], 192)
    req = request("r", TOKENS)
    assert side.num_new_matched_tokens(req, 0) == (192, False)
    side.reset()
    assert side.generation == 1
    assert side.num_new_matched_tokens(req, 0) == (0, False)  # the old objects never answer
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(req, table, 0)
    meta = side.build_meta(scheduler_output(new=[("r", table, 0, 64)], tables={"r": table}))
    assert meta.generation == 1
    saved = [ref.block_hash for ref in meta.requests[0].saves]
    old = RequestHashes(side.plan, "", None)
    old.cover(TOKENS, 64)
    new = RequestHashes(side.plan, "", None, generation=1)
    new.cover(TOKENS, 64)
    assert saved == new.for_group(32)[:2] != old.for_group(32)[:2]
    pool.keys.update(side.keys.keys(0, new.for_group(32)[:2], [0]))  # saved anew
    assert side.num_new_matched_tokens(request("s", TOKENS), 0) == (64, False)


def test_kv_from_before_a_reset_is_not_saved_under_the_new_generation(vllm_specs: Any) -> None:
    """A reset while a request's hit loads in the background: the KV it then holds is
    the old generation's; saved, it would reach instances that reset as often. A request
    vLLM looks up afresh (preempted by the reset) is saved again."""
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    put_blocks(side, pool, TOKENS, [0], 192)
    loading, preempted = request("loading", TOKENS), request("preempted", TOKENS[:100])
    table = ([1, 2, 3, 4, 5, 6, 7],)
    assert side.num_new_matched_tokens(loading, 0) == (192, False)
    side.after_alloc(loading, table, 192)
    side.after_alloc(preempted, ([8, 9, 10, 11],), 0)
    side.build_meta(scheduler_output(new=[("preempted", ([8, 9, 10, 11],), 0, 64)]))
    side.reset()
    side.after_alloc(loading, table, 0)  # its load done: vLLM schedules the rest
    assert side.num_new_matched_tokens(preempted, 0) == (0, False)  # new keys: a miss
    side.after_alloc(preempted, ([12, 13, 14, 15],), 0)
    meta = side.build_meta(
        scheduler_output(
            new=[("loading", table, 192, 8), ("preempted", ([12, 13, 14, 15],), 0, 100)]
        )
    )
    assert [(t.request_id, [ref.index for ref in t.saves]) for t in meta.requests] == [
        ("preempted", [0, 1, 2])
    ]
    assert meta.generation == 1


@pytest.mark.parametrize(
    ("resets", "computed_since", "admitted", "saved"),
    [
        (0, 0, 64, range(6)),  # before any reset, vLLM's own hit refills the pool
        (1, 0, 64, range(0)),  # a hit from before the reset: nothing computed over it
        (1, 100, 64, range(2, 6)),  # a hit computed since: the rest is saved
        (1, 100, 32, range(1, 6)),  # vLLM cut its hit after the lookup
        (1, 64, 96, range(0)),  # a hit reaching past what was computed since
        (1, 100, 70, range(0)),  # a hit where vLLM's hits never end (inside a hash unit)
        (2, 100, 64, range(0)),  # computed between the resets: the second forgot it
    ],
)
def test_after_a_reset_vllms_own_hit_and_what_it_computes_over_are_saved_only_if_fresh(
    vllm_specs: Any, resets: int, computed_since: int, admitted: int, saved: range
) -> None:
    """vLLM keeps its prefix cache when its own reset is refused (requests running): a
    local hit after the connector's reset may be KV from before it, and every block
    computed over it attends to it. Its blocks are never saved again; the blocks past
    them only when a request seen since the reset computed that prefix."""
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    for index in range(resets):
        side.reset()
        if index == 0 and computed_since:
            compute_after_reset(side, "first", TOKENS[:computed_since])
    meta = admit(side, request("r", TOKENS), ([1, 2, 3, 4, 5, 6, 7],), admitted)
    assert [ref.index for t in meta.requests for ref in t.saves] == list(saved)


@pytest.mark.parametrize("fresh", [False, True])
def test_a_pool_hit_over_a_local_hit_from_before_a_reset_loads_but_saves_nothing(
    vllm_specs: Any, fresh: bool
) -> None:
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    if fresh:
        compute_after_reset(side, "first", TOKENS[:64])
    put_blocks(side, pool, TOKENS, [0], 128, generation=1)
    r = request("r", TOKENS)
    assert side.num_new_matched_tokens(r, 64) == (64, False)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(r, table, 64)
    meta = side.build_meta(scheduler_output(new=[("r", table, 128, 72)], tables={"r": table}))
    (transfers,) = meta.requests
    assert [ref.index for ref in transfers.loads] == [2, 3]
    assert [ref.index for ref in transfers.saves] == ([4, 5] if fresh else [])


def test_after_a_reset_a_hit_on_what_a_request_generated_since_is_fresh(
    vllm_specs: Any,
) -> None:
    """A chat's next turn hits vLLM's blocks of the last turn's answer: computed since
    the reset, so the new turn's blocks are saved."""
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    tokens = list(TOKENS[:100])
    compute_after_reset(side, "first", tokens)
    tracked = side._requests.get("first")
    assert tracked is not None
    first = tracked.request
    for computed in range(100, 130):  # decode: one token per step
        tokens.append(TOKENS[computed])
        first.num_tokens = len(tokens)
        side.build_meta(scheduler_output(cached=[("first", computed, 1)]))
    meta = admit(side, request("r", TOKENS), ([1, 2, 3, 4, 5, 6, 7],), 128)
    assert [ref.index for t in meta.requests for ref in t.saves] == [4, 5]


def test_after_a_reset_a_hit_on_what_another_request_computes_in_the_same_step_is_fresh(
    vllm_specs: Any,
) -> None:
    """vLLM caches the blocks a step computes when it schedules them: a request admitted
    in that step may hit them (here 128 tokens, half of them computed in this step)."""
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    first = ([40, 41, 42, 43, 44, 45, 46],)
    admit(side, request("a", TOKENS), first, 0, 64)
    b = request("b", TOKENS[:128] + [7] * 72)
    assert side.num_new_matched_tokens(b, 128) == (0, False)
    second = ([40, 41, 42, 43, 1, 2, 3],)
    side.after_alloc(b, second, 0)
    output = scheduler_output(
        new=[("b", second, 128, 72)], cached=[("a", 64, 64)], tables={"a": first, "b": second}
    )
    meta = side.build_meta(output)
    assert {t.request_id: [ref.index for ref in t.saves] for t in meta.requests} == {
        "a": [2, 3],
        "b": [4, 5],
    }


def test_after_a_reset_a_hit_on_what_a_resumed_request_computes_in_the_same_step_is_fresh(
    vllm_specs: Any,
) -> None:
    """A preempted request resumes ahead of a new one in vLLM's waiting queue: the new
    one may hit the blocks the resumed one computes in that step. Both are judged in
    vLLM's order, so the resumed one's prefixes are known fresh first."""
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    first = ([40, 41, 42, 43, 44, 45, 46],)
    a = request("a", TOKENS)
    admit(side, a, first, 0, 64)
    # Preempted; looked up again, it hits its own 64 tokens in vLLM's prefix cache.
    assert side.num_new_matched_tokens(a, 64) == (0, False)
    side.after_alloc(a, first, 0)
    b = request("b", TOKENS[:128] + [7] * 72)
    assert side.num_new_matched_tokens(b, 128) == (0, False)
    second = ([40, 41, 42, 43, 1, 2, 3],)
    side.after_alloc(b, second, 0)
    output = scheduler_output(
        new=[("b", second, 128, 72)],
        resumed=[("a", first, 64, 64)],
        order=["a", "b"],
        tables={"a": first, "b": second},
    )
    meta = side.build_meta(output)
    assert {t.request_id: [ref.index for ref in t.saves] for t in meta.requests} == {
        "a": [2, 3],
        "b": [4, 5],
    }


def test_prefixes_a_request_skipping_vllms_prefix_cache_computes_are_not_fresh(
    vllm_specs: Any,
) -> None:
    """Prompt logprobs make vLLM skip its prefix cache: the request recomputes a prefix
    of which vLLM may still hold an older block, which it goes on serving first."""
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    skipping = request("a", TOKENS[:100], skip_reading_prefix_cache=True)
    admit(side, skipping, ([40, 41, 42, 43],))
    assert admit(side, request("b", TOKENS), ([1, 2, 3, 4, 5, 6, 7],), 64).requests == []


def test_a_tainted_request_whose_background_load_failed_stays_unsaved(
    vllm_specs: Any,
) -> None:
    """vLLM goes on from the tokens that did load, without a lookup: the request still
    computes over its vLLM-own hit from before the reset, and saves nothing; nor does a
    later request hitting those blocks."""
    side, pool = make_side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    side.reset()
    put_blocks(side, pool, TOKENS, [0], 128, generation=1)
    b = request("b", TOKENS)
    assert side.num_new_matched_tokens(b, 64) == (64, True)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    side.after_alloc(b, table, 64)
    side.build_meta(scheduler_output())  # the background load goes out
    side.loads_failed(["b"], [])  # block 3 failed: vLLM keeps 96 tokens
    b.num_computed_tokens = 96
    side.after_alloc(b, table, 0)
    meta = side.build_meta(scheduler_output(new=[("b", table, 96, 104)], tables={"b": table}))
    later = admit(side, request("c", TOKENS[:64] + [9] * 100), ([1, 2, 20, 21, 22, 23],), 64)
    assert [ref.index for t in [*meta.requests, *later.requests] for ref in t.saves] == []


def test_a_request_looked_up_again_after_its_stale_hit_left_saves_again(
    vllm_specs: Any,
) -> None:
    """Tainted by a local hit from before the reset, preempted, and admitted again once
    vLLM evicted that hit: it computes from its first token and saves."""
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    side.reset()
    r = request("r", TOKENS)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    assert admit(side, r, table, 64, 64).requests == []
    assert side.num_new_matched_tokens(r, 0) == (0, False)
    side.after_alloc(r, table, 0)
    meta = side.build_meta(scheduler_output(resumed=[("r", table, 0, 200)], tables={"r": table}))
    assert [ref.index for t in meta.requests for ref in t.saves] == list(range(6))


@pytest.mark.parametrize(("local_hit_unit", "saved"), [(8, True), (0, False)])
def test_after_a_reset_a_hit_inside_a_block_is_fresh_where_vllm_hashes(
    vllm_specs: Any, local_hit_unit: int, saved: bool
) -> None:
    """vLLM's own hits may end inside a block at its hash unit (a Mamba "align" model with
    a finer `prefix_match_unit`), whether or not prompt tails are stored: the prefixes
    remembered fresh end there too (unknown unit: only block ends, a hit inside a block is
    never known fresh)."""
    side, _ = tail_side(vllm_specs, 0, local_hit_unit=local_hit_unit)
    side.reset()
    admit(
        side, request("a", TOKENS[:100]), ([100 + b for b in range(8)], [200 + b for b in range(8)])
    )
    other = ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17])
    assert bool(admit(side, request("b", TOKENS), other, 40).requests) is saved
