"""Lookups: which blocks a hit needs, the keys the pool is asked about (every storing head
and stage), prompt tails, quarantined keys."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from conftest import Clock, attention, groups, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_rig import (
    ONE_RANK,
    TOKENS,
    Pool,
    block_keys,
    image_input,
    make_side,
    put_blocks,
    tail_side,
    write_prompt,
)

from hybridkv.integration import hit_finder
from hybridkv.integration.block_query import RenderingQuery
from hybridkv.integration.config import ConnectorConfig
from hybridkv.integration.groups import ModelShape, plan_groups
from hybridkv.integration.keying import KeySpace, RequestHashes
from hybridkv.integration.scheduler import SchedulerSide


def test_hit_needs_every_storing_head_tp4_two_kv_heads(vllm_specs: Any) -> None:
    shape = ModelShape(tp_size=4, total_kv_heads=2)
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs, heads=1))], shape)
    put_blocks(side, pool, TOKENS, [0], 192)  # only head 0's objects: rank 2 and 3 would miss
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (0, False)
    put_blocks(side, pool, TOKENS, [1], 192)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (192, False)
    assert pool.queries == 2  # one batched query per lookup


def test_hit_is_capped_below_the_prompt_length(vllm_specs: Any) -> None:
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    tokens = TOKENS[:192]
    put_blocks(side, pool, tokens, [0], 192)
    # 192 tokens are all stored, but the last token must be computed: 160 at most.
    assert side.num_new_matched_tokens(request("r", tokens), 0) == (160, False)


def test_partial_prefix_and_local_hit(vllm_specs: Any) -> None:
    side, pool = make_side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), load_async=True
    )
    put_blocks(side, pool, TOKENS, [0], 96)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (96, True)
    assert side.num_new_matched_tokens(request("r", TOKENS), 64) == (32, True)
    assert side.num_new_matched_tokens(request("r", TOKENS), 96) == (0, False)


def test_keys_whose_load_failed_count_as_absent_while_quarantined(vllm_specs: Any) -> None:
    """A dead holder's objects stay listed until the master drops them: lookups must not
    offer them again, to the request vLLM recomputes (which asks again at once, in a
    loop otherwise) or to any other; the blocks before the first failed one still serve."""
    plan = plan_groups(groups(vllm_specs, (["a"], attention(vllm_specs))), [0], ModelShape(1, 2))
    pool, clock = Pool(), Clock()
    config = ConnectorConfig(failed_load_quarantine_s=30)
    side = SchedulerSide(KeySpace(plan, "tiny"), config, pool.query, clock=clock)
    put_blocks(side, pool, TOKENS, [0], 160)
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (160, False)
    side.loads_failed({"r"}, block_keys(side, TOKENS, 0, slice(2, 4)))
    assert side.take_stats()["quarantined_keys"] == 2
    # Another read of one of them, looked up before the failure was reported, fails too:
    # still the same two objects.
    side.loads_failed(set(), block_keys(side, TOKENS, 0, slice(3, 5)))
    assert side.take_stats()["quarantined_keys"] == 1
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (64, False)
    assert side.num_new_matched_tokens(request("other", TOKENS), 0) == (64, False)
    clock.now = 29.9
    assert side.num_new_matched_tokens(request("other", TOKENS), 0) == (64, False)
    clock.now = 30.0
    assert side.num_new_matched_tokens(request("other", TOKENS), 0) == (160, False)
    assert len(side.quarantine) == 0


def test_lookup_failure_is_a_miss(vllm_specs: Any) -> None:
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    put_blocks(side, pool, TOKENS, [0], 192)
    side.take_stats()
    pool.down = True
    assert side.num_new_matched_tokens(request("r", TOKENS), 0) == (0, False)
    stats = side.take_stats()
    assert stats.pop("lookup_seconds") > 0
    assert stats == {
        "queried_tokens": len(TOKENS),  # asked, though no answer came
        "hit_tokens": 0,
        "hit_requests": 0,
        "tail_hit_tokens": 0,
        "lookups": 1,
        "failed_lookups": 1,
        "remembered_lookups": 0,
        "quarantined_keys": 0,
    }


def test_lookup_seconds_sum_the_time_lookups_take(vllm_specs: Any) -> None:
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    put_blocks(side, pool, TOKENS, [0], 192)
    side.take_stats()
    answered = pool.query

    def slow_pool(keys: Sequence[str]) -> list[bool] | None:
        time.sleep(0.05)
        return answered(keys)

    side._hits.query = RenderingQuery(side.keys, slow_pool)
    side.num_new_matched_tokens(request("r", TOKENS), 0)
    side.num_new_matched_tokens(request("s", TOKENS), 0)
    assert side.take_stats()["lookup_seconds"] >= 0.1
    assert side.take_stats()["lookup_seconds"] == 0  # taken with the stats


def test_salt_and_lora_change_the_keys(vllm_specs: Any) -> None:
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    put_blocks(side, pool, TOKENS, [0], 192)
    assert side.num_new_matched_tokens(request("a", TOKENS, cache_salt="s"), 0) == (0, False)
    # A LoRA name pointed at another adapter is another LoRA (vLLM hashes the path too).
    lora = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v1")
    put_blocks(side, pool, TOKENS, [0], 192, writer=request("w", TOKENS, lora_request=lora))
    again = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v1")
    moved = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v2")
    assert side.num_new_matched_tokens(request("b", TOKENS, lora_request=again), 0) == (192, False)
    assert side.num_new_matched_tokens(request("c", TOKENS, lora_request=moved), 0) == (0, False)


def test_an_image_changes_the_keys_of_the_blocks_it_overlaps_and_later_ones(
    vllm_specs: Any,
) -> None:
    """As in vLLM's prefix cache: the blocks before an image are shared across images."""
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    cat = request("w", TOKENS, mm_features=[image_input("cat", 70, 30)])  # tokens 70-99: blocks 2-3
    put_blocks(side, pool, TOKENS, [0], 192, writer=cat)
    dog = request("a", TOKENS, mm_features=[image_input("dog", 70, 30)])
    assert side.num_new_matched_tokens(dog, 0) == (64, False)
    moved = request("b", TOKENS, mm_features=[image_input("cat", 71, 29)])  # same image, moved
    assert side.num_new_matched_tokens(moved, 0) == (64, False)
    assert side.num_new_matched_tokens(request("c", TOKENS), 0) == (64, False)
    again = request("d", TOKENS, mm_features=[image_input("cat", 70, 30)])
    assert side.num_new_matched_tokens(again, 0) == (192, False)


def test_with_pipeline_stages_a_block_hits_only_when_every_stage_holds_it(
    vllm_specs: Any,
) -> None:
    """Each stage's workers store their own layers under their `pp_rank`; the scheduler
    asks about every stage's objects of each head."""
    kinds = [(["w"], attention(vllm_specs, window=64)), (["f"], attention(vllm_specs))]
    plan = plan_groups(groups(vllm_specs, *kinds), [0, 1], ONE_RANK, pp_stages=[(0, 1), (1, 2)])
    pool = Pool()
    side = SchedulerSide(KeySpace(plan, "tiny"), ConnectorConfig(), pool.query)
    for stage, upto in ((0, 192), (1, 128)):  # the second stage saved four blocks only
        put_blocks(side, pool, TOKENS, [0], upto, keys=KeySpace(plan, "tiny", pp_rank=stage))
    assert side.num_new_matched_tokens(request("r", TOKENS[:200]), 0) == (128, False)
    assert all("@pp_rank:" in key for key in pool.keys)
    assert len(side.keys.prefixes()) == 4  # two groups, two stages


def test_with_eagle_a_hit_drops_its_last_block_as_vllm_s_own_do(vllm_specs: Any) -> None:
    """EAGLE (and MTP) re-draft the last block of a hit: vLLM drops it from its own hits,
    and so from the pool's, which must reach one block further."""
    for use_eagle, tokens, hit in ((False, 200, 192), (True, 200, 160), (True, 192, 160)):
        side, pool = tail_side(vllm_specs, 0, use_eagle=use_eagle)
        put_blocks(side, pool, TOKENS, [0], 192)
        # A block-aligned prompt too: vLLM caps it at 191 tokens, but matches all six blocks
        assert side.num_new_matched_tokens(request("r", TOKENS[:tokens]), 0) == (hit, False)


def test_a_resend_of_the_same_prompt_resumes_at_its_tail(vllm_specs: Any) -> None:
    side, pool = tail_side(vllm_specs)
    prompt = TOKENS[:180]
    write_prompt(side, pool, prompt, [160, 176, 180])
    assert side.num_new_matched_tokens(request("again", prompt), 0) == (176, False)
    # vLLM's own cache already holds 160 tokens: the pool adds the tail's 16.
    assert side.num_new_matched_tokens(request("again", prompt), 160) == (16, False)


def test_a_tail_past_the_last_aligned_boundary_is_found_with_smaller_attention_blocks(
    vllm_specs: Any,
) -> None:
    """Attention blocks of 16 beside states of 64: the prompt's tail at 248 lies past its
    last aligned boundary (192) and needs attention blocks 12-14, which no aligned
    boundary does. The writer saves them and a resend asks about them, so it resumes at
    the tail, not at 192."""
    side, pool = tail_side(vllm_specs, block_sizes=(16, 64))
    prompt = (TOKENS + list(range(900, 960)))[:250]
    saves = write_prompt(side, pool, prompt, [64, 128, 192, 248, 250], blocks=16)
    assert sorted(ref.index for ref in saves if ref.group == 0 and not ref.tail) == list(range(15))
    assert {(ref.group, ref.index) for ref in saves if ref.tail == 248} == {(0, 15), (1, 3)}
    assert side.num_new_matched_tokens(request("again", prompt), 0) == (248, False)


def test_a_tail_query_without_answer_keeps_the_aligned_hit_and_is_no_failed_lookup(
    vllm_specs: Any,
) -> None:
    side, pool = tail_side(vllm_specs)
    prompt = TOKENS[:180]
    write_prompt(side, pool, prompt, [160, 176, 180])
    side.take_stats()
    answered = pool.query

    def first_query_only(keys: Sequence[str]) -> list[bool] | None:
        pool.down = pool.queries > 0
        return answered(keys)

    side._hits.query = RenderingQuery(side.keys, first_query_only)
    pool.queries = 0
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)
    assert pool.queries == 2
    stats = side.take_stats()
    assert (stats["lookups"], stats["failed_lookups"]) == (1, 0)


def test_a_failed_second_tail_query_keeps_the_aligned_hit(vllm_specs: Any) -> None:
    """The first tail query asks one group's partial objects, the second the others'."""
    side, pool = tail_side(vllm_specs)
    prompt = TOKENS[:180]
    write_prompt(side, pool, prompt, [160, 176, 180])
    answered = pool.query
    sizes: list[int] = []

    def two_queries_only(keys: Sequence[str]) -> list[bool] | None:
        sizes.append(len(keys))
        pool.down = pool.queries > 1
        return answered(keys)

    side._hits.query = RenderingQuery(side.keys, two_queries_only)
    pool.queries = 0
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)
    # Candidates 176 and 168 (after the aligned 160; 179 caps them), one object each.
    assert sizes[1:] == [2, 1]
    pool.down = False
    side._hits.query = RenderingQuery(side.keys, answered)
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (176, False)


def test_the_block_after_the_aligned_hit_is_asked_beyond_the_largest_candidates(
    vllm_specs: Any, monkeypatch: Any
) -> None:
    """Attention blocks readable far past a tail (a longer sibling whose states the pool
    no longer holds): the tail just past the aligned hit is still asked about."""
    monkeypatch.setattr(hit_finder, "MAX_TAIL_CANDIDATES", 2)
    side, pool = tail_side(vllm_specs)
    prompt = TOKENS[:180]
    write_prompt(side, pool, prompt, [160, 176, 180])
    other_writer, _ = tail_side(vllm_specs)
    sibling = [*TOKENS, *range(5000, 5050)]  # 250 tokens, the written prompt's 180 first
    saves = write_prompt(other_writer, pool, sibling, [32 * k for k in range(1, 8)] + [250])
    evicted = [ref for ref in saves if ref.group == 1 and ref.index >= 5]
    assert [ref.index for ref in evicted] == [5, 6]  # the states after 192 and 224
    for ref in evicted:
        pool.keys -= set(side.keys.keys(1, [ref.block_hash], [0]))
    reader = request("r", [*sibling[:240], *range(9000, 9010)])  # blocks 0..6 readable
    assert side.num_new_matched_tokens(reader, 0) == (176, False)


def test_a_tail_needs_every_group_s_partial_object(vllm_specs: Any) -> None:
    side, pool = tail_side(vllm_specs)
    prompt = TOKENS[:180]
    saves = write_prompt(side, pool, prompt, [160, 176, 180])
    (state_tail,) = [ref for ref in saves if ref.tail and ref.group == 1]
    pool.keys -= set(side.keys.keys(1, [state_tail.block_hash], [0]))
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)


def test_at_tp2_a_tail_needs_every_storing_head_s_partial_object(vllm_specs: Any) -> None:
    """Two ranks with a KV head each and the state sharded: four objects per tail."""
    side, pool = tail_side(vllm_specs, shape=ModelShape(tp_size=2, total_kv_heads=2))
    assert [g.heads.storing for g in side.plan.groups] == [2, 2]
    prompt = TOKENS[:180]
    saves = write_prompt(side, pool, prompt, [160, 176, 180])
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (176, False)
    for group in (0, 1):
        (tail,) = [ref for ref in saves if ref.tail and ref.group == group]
        second_rank = set(side.keys.keys(group, [tail.block_hash], [1]))
        pool.keys -= second_rank
        assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)
        pool.keys |= second_rank


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(1, 200), st.integers(0, 220), st.integers(1, 40))
def test_a_reader_finds_what_a_writer_stored_whole_blocks_and_tails(
    vllm_specs: Any, written_length: int, shared: int, extra: int
) -> None:
    """Oracle: the writer stores the whole blocks of its prompt and a tail where a chunk
    ends inside a block at a multiple of 8 (vLLM's checkpoint, the prompt's end); a reader
    sharing `shared` tokens with it resumes at the largest of those it may use."""
    side, pool = tail_side(vllm_specs)
    written = TOKENS[:written_length]
    checkpoint = (written_length - 1) // 8 * 8  # where vLLM ends a chunk for the tail
    chunks = sorted({*range(32, written_length + 1, 32), checkpoint, written_length} - {0})
    write_prompt(side, pool, written, chunks)
    shared = min(shared, written_length)
    reader = written[:shared] + [5000 + i for i in range(extra)]  # never the writer's
    cap = len(reader) - 1
    usable = min(shared, cap)
    whole = min(usable, written_length) // 32 * 32
    tails = {end for end in chunks if end % 8 == 0 and end % 32}
    expected = max([whole, *(t for t in tails if whole < t <= usable and t < whole + 32)])
    got, _ = side.num_new_matched_tokens(request("r", reader), 0)
    assert got == expected


SEARCHING = {"test_exact_lookup_keys": 0}  # every lookup searches, however few its keys


LONG = list(range(100, 100 + 32 * 1000 + 8))  # 1,000 full blocks of 32: more than a probe round


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(0, len(LONG)), st.integers(0, len(LONG)))
def test_a_long_lookup_searches_the_same_hit_with_far_fewer_keys(
    vllm_specs: Any, stored: int, both_heads: int
) -> None:
    """Head 0 stored `stored` tokens, head 1 `both_heads`: the search confirms every head
    of the block it stops at, so it finds the exact hit of a prefix-closed pool."""
    shape = ModelShape(tp_size=4, total_kv_heads=2)
    side, pool = make_side(
        vllm_specs, [(["a"], attention(vllm_specs, heads=1))], shape, **SEARCHING
    )
    put_blocks(side, pool, LONG, [0], stored)
    put_blocks(side, pool, LONG, [1], min(stored, both_heads))
    asked: list[int] = []
    answered = pool.query

    def counting(keys: Sequence[str]) -> list[bool] | None:
        asked.append(len(keys))
        return answered(keys)

    side._hits.query = RenderingQuery(side.keys, counting)
    hit, _ = side.num_new_matched_tokens(request("r", LONG), 0)
    assert hit == min(stored, both_heads, len(LONG) - 1) // 32 * 32
    exact_keys = 2 * 1000  # 2 heads x 1,000 blocks
    # Heads that disagree: the second is searched with every head asked (up to 512 blocks).
    assert sum(asked) < (exact_keys if both_heads < stored else exact_keys // 10)


def test_while_keys_are_quarantined_lookups_are_exact(vllm_specs: Any) -> None:
    """A search confirms head 1 only at the block it stops at: a block in the middle whose
    head 1 failed to load would be offered again (and fail again) unless the lookups of a
    quarantine ask every key."""
    shape = ModelShape(tp_size=2, total_kv_heads=2)
    side, pool = make_side(
        vllm_specs, [(["a"], attention(vllm_specs, heads=1))], shape, **SEARCHING
    )
    put_blocks(side, pool, LONG, [0, 1], len(LONG))
    full = (len(LONG) - 1) // 32 * 32
    assert side.num_new_matched_tokens(request("r", LONG), 0) == (full, False)
    hashes = hit_finder_hashes(side, LONG)
    failed = side.keys.keys(0, [hashes[100]], [1])  # head 1 of block 100
    pool.keys.difference_update(failed)
    assert side.num_new_matched_tokens(request("r", LONG), 0) == (full, False)  # documented
    side.loads_failed({"r"}, failed)
    assert side.num_new_matched_tokens(request("r", LONG), 0) == (100 * 32, False)


def hit_finder_hashes(side: SchedulerSide, tokens: list[int]) -> list[bytes]:
    hashes = RequestHashes(side.plan, "", None)
    hashes.cover(tokens, len(tokens))
    return list(hashes.for_group(side.plan.groups[0].block_size))
