"""Tracked requests: their hashes however the tokens arrive, a streaming session's next
chunk, and prompts without token ids."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import attention, request, scheduler_output
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scheduler_rig import (
    TOKENS,
    image_input,
    make_side,
    put_blocks,
)

from hybridkv.integration.groups import ModelShape
from hybridkv.integration.keying import RequestHashes


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(0, 99), min_size=1, max_size=150),
    st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 140), st.integers(1, 40))),
    st.lists(st.integers(0, 150)),
)
@example(list(range(64)), [("a", 3, 2)], [10])  # the block's image came with an earlier call
def test_hashes_with_images_do_not_depend_on_how_the_tokens_arrive(
    vllm_specs: Any, tokens: list[int], images: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    side, _ = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    r = request("r", tokens, mm_features=[image_input(*image) for image in images])
    whole = RequestHashes(side.plan, "", r)
    whole.cover(tokens, len(tokens))
    pieces = RequestHashes(side.plan, "", r)
    for cut in sorted(cuts):
        pieces.cover(tokens, cut)
    pieces.cover(tokens, len(tokens))
    assert pieces.for_group(32) == whole.for_group(32)
    # A block overlapping no image hashes as without images, given the same chain.
    plain = RequestHashes(side.plan, "", None)
    plain.cover(tokens, len(tokens))
    first = min((offset // 32 for _, offset, _ in images), default=len(tokens))
    assert whole.for_group(32)[:first] == plain.for_group(32)[:first]


@pytest.mark.parametrize("rewound", [True, False])
def test_a_streaming_session_names_its_next_chunk_as_a_whole_request_would(
    vllm_specs: Any, rewound: bool
) -> None:
    """A streaming-input session keeps its KV between chunks; for the next one vLLM drops
    the token it sampled last and appends the chunk's tokens and images. With async
    scheduling, the step computing that token may have run (and completed a block) before
    the stop was seen: that block holds the dropped token, and is computed again."""
    side, _ = make_side(
        vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2), save_decode_cache=True
    )
    table = ([1, 2, 3, 4, 5, 6, 7],)
    r = request("r", TOKENS[:60])
    side.after_alloc(r, table, 0)
    side.build_meta(scheduler_output(new=[("r", table, 0, 60)], tables={"r": table}))
    r.all_token_ids = [*TOKENS[:60], 7, 8, 9, 10]  # the last one sampled before the stop
    r.num_tokens = 64
    meta = side.build_meta(scheduler_output(cached=[("r", 60, 4)], tables={"r": table}))
    dropped = meta.requests[0].saves
    assert [ref.index for ref in dropped] == [1]
    # The next turn resumes at the safe frontier, 63 (or, had the step not run, at 64 with
    # the token kept), and appends an image's chunk.
    frontier = 63 if rewound else 64
    del r.all_token_ids[frontier:]
    r.all_token_ids += TOKENS[100:160]
    r.num_prompt_tokens = r.num_tokens = len(r.all_token_ids)
    r.mm_features = [image_input("cat", frontier + 2, 24)]
    r.num_computed_tokens = frontier
    side.after_alloc(r, table, 0)
    meta = side.build_meta(scheduler_output(new=[("r", table, frontier, 60)], tables={"r": table}))
    whole = RequestHashes(side.plan, "", r)
    whole.cover(r.all_token_ids, len(r.all_token_ids) // 32 * 32)
    saved = [(ref.index, ref.block_hash) for ref in meta.requests[0].saves]
    if rewound:  # block 1 again, now holding the chunk's first token
        assert saved[0] == (1, whole.for_group(32)[1]) != (1, dropped[0].block_hash)
        saved = saved[1:]
    else:
        assert dropped[0].block_hash == whole.for_group(32)[1]
    assert saved == [(2, whole.for_group(32)[2])]
    tokens_only = RequestHashes(side.plan, "", None)
    tokens_only.cover(r.all_token_ids, 96)
    assert tokens_only.for_group(32)[2] != whole.for_group(32)[2]  # the image counts


def test_a_prompt_given_as_embeddings_is_neither_looked_up_nor_saved(vllm_specs: Any) -> None:
    """vLLM fills its token ids with 0: saved under their hashes, its KV would be what a
    prompt of token 0 repeated loads."""
    side, pool = make_side(vllm_specs, [(["a"], attention(vllm_specs))], ModelShape(1, 2))
    zeros = [0] * 100
    embedded = request("e", zeros, prompt_embeds=object())
    put_blocks(side, pool, zeros, [0], 96)
    assert side.num_new_matched_tokens(embedded, 0) == (0, False)
    assert pool.queries == 0
    table = ([1, 2, 3, 4],)
    side.after_alloc(embedded, table, 0)
    meta = side.build_meta(scheduler_output(new=[("e", table, 0, 100)], tables={"e": table}))
    assert meta.requests == []
