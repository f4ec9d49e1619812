"""Saves: the blocks a step completes that a later lookup could need, once each, and the
prompt tails a chunk leaves."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import attention, mamba, request, scheduler_output
from scheduler_rig import (
    TOKENS,
    make_side,
    tail_side,
    write_prompt,
)

from hybridkv.integration.groups import ModelShape
from hybridkv.integration.keying import RequestHashes


def test_saves_the_workers_left_out_after_a_failed_load_are_planned_again(
    vllm_specs: Any,
) -> None:
    """Blocks 2-3 were computed over a failed load and not saved: planned again in the
    next step that has them complete (vLLM rolled the request back to block 1 here)."""
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    r = request("r", TOKENS)
    side.after_alloc(r, ([],), 0)
    table = ([1, 2, 3, 4, 5, 6, 7],)
    meta = side.build_meta(scheduler_output(new=[("r", table, 0, 128)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [0, 1, 2, 3]
    side.loads_failed((), (), {("r", 0, 2), ("r", 0, 3), ("gone", 0, 1)})
    meta = side.build_meta(scheduler_output(cached=[("r", 32, 32)], tables={"r": table}))
    assert meta.requests == []  # vLLM recomputes block 1; blocks 2-3 are not complete yet
    meta = side.build_meta(scheduler_output(cached=[("r", 64, 96)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [2, 3, 4]


def test_decode_saves_stop_at_the_tokens_vllm_knows(vllm_specs: Any) -> None:
    """With `save_decode_cache`, a block is saved once its tokens are known: async
    scheduling counts a step's token before it is sampled, speculative decoding schedules
    drafts that may be rejected. A block they would complete waits for its tokens."""
    side, _ = make_side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), save_decode_cache=True
    )
    prompt = TOKENS[:40]
    r = request("r", list(prompt))
    side.after_alloc(r, ([1, 2],), 0)
    table = ([1, 2],)
    meta = side.build_meta(scheduler_output(new=[("r", table, 0, 40)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [0]
    r.all_token_ids = prompt + list(range(23))  # 63 known; the 64th not sampled yet
    r.num_tokens = 63
    assert (
        side.build_meta(scheduler_output(cached=[("r", 63, 1)], tables={"r": table})).requests == []
    )
    meta = side.build_meta(scheduler_output(cached=[("r", 62, 4)], tables={"r": table}))
    assert meta.requests == []  # three drafts past the known tokens
    r.all_token_ids.append(7)
    r.num_tokens = 64
    meta = side.build_meta(scheduler_output(cached=[("r", 64, 1)], tables={"r": table}))
    assert [ref.index for ref in meta.requests[0].saves] == [1]


def test_with_eagle_states_are_saved_where_vllm_keeps_them(vllm_specs: Any) -> None:
    """With EAGLE vLLM ends a prompt's chunks one block earlier (after 160 of 200 tokens, not
    192) and its last chunk leaves no state at the end of the block it crosses: that block
    is not saved, the states up to 160 are."""
    side, _ = tail_side(vllm_specs, 0, use_eagle=True)
    req = request("w", TOKENS)
    side.after_alloc(req, ([], []), 0)
    tables = ([100 + b for b in range(7)], [200 + b for b in range(7)])
    saved = set()
    for output in (
        scheduler_output(new=[("w", tables, 0, 160)], tables={"w": tables}),
        scheduler_output(cached=[("w", 160, 40)], tables={"w": tables}),
    ):
        for transfers in side.build_meta(output).requests:
            saved |= {(ref.group, ref.index) for ref in transfers.saves}
    assert {index for group, index in saved if group == 1} == set(range(5))
    assert {index for group, index in saved if group == 0} == set(range(6))


def test_with_eagle_decode_saves_every_state_block_it_completes(vllm_specs: Any) -> None:
    """With `save_decode_cache` a request goes on past each block it completes, and stores
    the block EAGLE drops past it: a later request can hit at that block's end, so its
    state is saved, the prompt's last one (after 192 tokens) included."""
    side, _ = tail_side(vllm_specs, 0, use_eagle=True, save_decode_cache=True)
    prompt = TOKENS[:192]
    req = request("r", list(prompt))
    side.after_alloc(req, ([], []), 0)
    tables = ([100 + b for b in range(9)], [200 + b for b in range(9)])
    steps = [scheduler_output(new=[("r", tables, 0, 160)], tables={"r": tables})]
    steps.append(scheduler_output(cached=[("r", 160, 32)], tables={"r": tables}))
    saved = set()
    for output in steps:
        for transfers in side.build_meta(output).requests:
            saved |= {(ref.group, ref.index) for ref in transfers.saves}
    for done in range(193, 265):  # decode, a token a step
        req.all_token_ids.append(done % 500)
        req.num_tokens = done
        output = scheduler_output(cached=[("r", done - 1, 1)], tables={"r": tables})
        for transfers in side.build_meta(output).requests:
            saved |= {(ref.group, ref.index) for ref in transfers.saves}
    assert {index for group, index in saved if group == 1} == set(range(8))
    assert {index for group, index in saved if group == 0} == set(range(8))


def test_saves_complete_blocks_once_and_skip_null_blocks(vllm_specs: Any) -> None:
    kinds = [(["w"], attention(vllm_specs, window=64)), (["m"], mamba(vllm_specs))]
    side, _ = make_side(vllm_specs, kinds, ModelShape(1, 2))
    req = request("r", TOKENS)
    side.after_alloc(req, ([1, 2], [0, 3]), 0)
    step1 = ([1, 2], [0, 3])
    meta = side.build_meta(scheduler_output(new=[("r", step1, 0, 64)], tables={"r": step1}))
    saved = {(ref.group, ref.index, ref.block_id) for ref in meta.requests[0].saves}
    assert saved == {(0, 0, 1), (0, 1, 2), (1, 1, 3)}  # Mamba block 0 is null: no state
    step2 = ([1, 2, 5, 6], [0, 3, 0, 7])
    meta = side.build_meta(scheduler_output(cached=[("r", 64, 64)], tables={"r": step2}))
    saved = {(ref.group, ref.index, ref.block_id) for ref in meta.requests[0].saves}
    assert saved == {(0, 2, 5), (0, 3, 6), (1, 3, 7)}
    # Decode past the prompt saves nothing more.
    meta = side.build_meta(scheduler_output(cached=[("r", 200, 1)], tables={"r": step2}))
    assert meta.requests == []


@pytest.mark.parametrize("resets", [0, 1])
def test_prompt_tail_is_stored_where_vllm_ends_the_chunk_and_extends_a_later_hit(
    vllm_specs: Any, resets: int
) -> None:
    """(After a reset too: the block a tail hit ends in is the pool's, not vLLM's own.)"""
    side, pool = tail_side(vllm_specs)
    for _ in range(resets):
        side.reset()
    prompt = TOKENS[:180]  # vLLM's tail: 179 // 8 * 8 = 176, inside block 5
    saves = write_prompt(side, pool, prompt, [160, 176, 180])
    tails = [(ref.group, ref.index, ref.block_id, ref.tail) for ref in saves if ref.tail]
    assert tails == [(0, 5, 105, 176), (1, 5, 205, 176)]
    assert {ref.block_hash for ref in saves if ref.tail} == {
        RequestHashes(side.plan, "", None, side.generation).prefix(prompt, 176)
    }
    # A longer prompt with the same start resumes after 176 tokens, not at block 5's start.
    reader = request("r", prompt + list(range(900, 920)))
    assert side.num_new_matched_tokens(reader, 0) == (176, False)
    tables = ([10 + b for b in range(7)], [20 + b for b in range(7)])
    side.take_stats()  # the writer's lookups
    side.after_alloc(reader, tables, 176)
    assert side.take_stats() == {
        "queried_tokens": 0,  # counted by the lookup, taken with the writer's
        "hit_tokens": 176,
        "hit_requests": 1,
        "tail_hit_tokens": 16,
        "lookups": 0,
        "failed_lookups": 0,
        "remembered_lookups": 0,
        "lookup_seconds": 0.0,
        "quarantined_keys": 0,
    }
    output = scheduler_output(new=[("r", tables, 176, 16)], tables={"r": tables})
    (transfers,) = side.build_meta(output).requests
    loads = {(ref.group, ref.index, ref.block_id, ref.tail) for ref in transfers.loads}
    assert loads == {(0, b, 10 + b, 0) for b in range(5)} | {(0, 5, 15, 176), (1, 5, 25, 176)}
    # Completing block 5 saves it whole, under the whole block's hash.
    assert {(ref.group, ref.index, ref.tail) for ref in transfers.saves} == {(0, 5, 0), (1, 5, 0)}
    # The prompt's end, a multiple of 8 inside block 6, leaves a tail too.
    (transfers,) = side.build_meta(
        scheduler_output(cached=[("r", 192, 8)], tables={"r": tables})
    ).requests
    assert {(ref.group, ref.index, ref.tail) for ref in transfers.saves} == {
        (0, 6, 200),
        (1, 6, 200),
    }


@pytest.mark.parametrize("tail_unit", [0, 8])
def test_decode_saves_the_attention_blocks_a_later_boundary_needs_that_the_prompt_s_did_not(
    vllm_specs: Any, tail_unit: int
) -> None:
    """With `save_decode_cache`, attention blocks of 16 beside states of 64: blocks 5 and
    6 complete (at 96 and 112) before any boundary needs them; the boundary at 128 does.
    They are saved once decode grows the mask there, so a reader hits at 128."""
    side, pool = tail_side(vllm_specs, tail_unit, block_sizes=(16, 64), save_decode_cache=True)
    writer = request("w", TOKENS[:100])
    side.after_alloc(writer, ([], []), 0)
    tables = ([100 + b for b in range(16)], [200 + b for b in range(4)])
    saves = []
    outputs = [scheduler_output(new=[("w", tables, 0, 100)], tables={"w": tables})]
    for done in range(100, 140):  # then one generated token a step
        outputs.append(scheduler_output(cached=[("w", done, 1)], tables={"w": tables}))
    for step, output in enumerate(outputs):
        if step:
            writer.all_token_ids.append(TOKENS[len(writer.all_token_ids)])
            writer.num_tokens += 1
        for transfers in side.build_meta(output).requests:
            saves.extend(transfers.saves)
    whole = [ref for ref in saves if not ref.tail]
    assert sorted(ref.index for ref in whole if ref.group == 0) == list(range(8))
    assert len({(ref.group, ref.index) for ref in whole}) == len(whole)  # each once
    for ref in saves:
        pool.keys.update(side.keys.keys(ref.group, [ref.block_hash], [0]))
    reader = request("r", [*TOKENS[:139], 1, 2, 3])
    assert side.num_new_matched_tokens(reader, 0) == (128, False)


def test_a_streaming_session_s_next_chunk_saves_the_attention_blocks_its_boundaries_need(
    vllm_specs: Any,
) -> None:
    """A 100-token first chunk leaves attention block 5 (tokens 80-95) unsaved: no boundary
    up to 100 needs it. The next chunk grows the prompt to 160, whose boundary at 128
    does: it is saved then."""
    side, _ = tail_side(vllm_specs, block_sizes=(16, 64))
    session = request("w", TOKENS[:100])
    side.after_alloc(session, ([], []), 0)
    tables = ([100 + b for b in range(16)], [200 + b for b in range(4)])
    saves = []
    output = scheduler_output(new=[("w", tables, 0, 100)], tables={"w": tables})
    saves.extend(ref for t in side.build_meta(output).requests for ref in t.saves)
    assert 5 not in {ref.index for ref in saves if ref.group == 0 and not ref.tail}
    session.all_token_ids = TOKENS[:160]
    session.num_prompt_tokens = session.num_tokens = 160
    session.num_computed_tokens = 100
    side.after_alloc(session, tables, 0)
    output = scheduler_output(new=[("w", tables, 100, 60)], tables={"w": tables})
    saves.extend(ref for t in side.build_meta(output).requests for ref in t.saves)
    attention_blocks = sorted(ref.index for ref in saves if ref.group == 0 and not ref.tail)
    assert attention_blocks == list(range(9))


def test_no_tails_where_vllm_makes_none_or_when_turned_off(vllm_specs: Any) -> None:
    prompt = TOKENS[:180]
    for side, pool in [tail_side(vllm_specs, 0), tail_side(vllm_specs, prompt_tails=False)]:
        saves = write_prompt(side, pool, prompt, [160, 176, 180])
        assert not [ref for ref in saves if ref.tail]
        assert side.num_new_matched_tokens(request("r", prompt), 0) == (160, False)


def test_tails_only_at_unit_multiples_inside_the_prompt(vllm_specs: Any) -> None:
    side, pool = tail_side(vllm_specs)
    # Chunks ending at 170 (not a multiple of 8) and 192 (a block end) leave no tail;
    # decode past the prompt neither.
    saves = write_prompt(side, pool, TOKENS[:192], [170, 192, 193, 200])
    assert not [ref for ref in saves if ref.tail]
